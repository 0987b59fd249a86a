// Original file: ../../protos/h3/v1/h3.proto

export const Tier = {
  TIER_UNSPECIFIED: 'TIER_UNSPECIFIED',
  TIER_HBM: 'TIER_HBM',
  TIER_DDR: 'TIER_DDR',
  TIER_SSD: 'TIER_SSD',
} as const;

export type Tier =
  | 'TIER_UNSPECIFIED'
  | 0
  | 'TIER_HBM'
  | 1
  | 'TIER_DDR'
  | 2
  | 'TIER_SSD'
  | 3

export type Tier__Output = typeof Tier[keyof typeof Tier]
