// Original file: ../../protos/h3/v1/h3.proto

import type { TierResidency as _h3_v1_TierResidency, TierResidency__Output as _h3_v1_TierResidency__Output } from '../../h3/v1/TierResidency.js';
import type { Long } from '@grpc/proto-loader';

export interface EvictSessionResponse {
  /**
   * Block copies moved or dropped.
   */
  'blocksMoved'?: (number | string | Long);
  'residency'?: (_h3_v1_TierResidency | null);
}

export interface EvictSessionResponse__Output {
  /**
   * Block copies moved or dropped.
   */
  'blocksMoved': (number);
  'residency': (_h3_v1_TierResidency__Output | null);
}
