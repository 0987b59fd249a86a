// Original file: ../../protos/h3/v1/h3.proto

import type { Tier as _h3_v1_Tier, Tier__Output as _h3_v1_Tier__Output } from '../../h3/v1/Tier.js';

export interface EvictSessionRequest {
  'sessionId'?: (string);
  /**
   * TIER_DDR: drop its HBM copies (keeping DDR ones); TIER_SSD: archive every full block and drop
   * its HBM and DDR copies (needs `ssd_path`). The partial last block stays where it is.
   */
  'to'?: (_h3_v1_Tier);
}

export interface EvictSessionRequest__Output {
  'sessionId': (string);
  /**
   * TIER_DDR: drop its HBM copies (keeping DDR ones); TIER_SSD: archive every full block and drop
   * its HBM and DDR copies (needs `ssd_path`). The partial last block stays where it is.
   */
  'to': (_h3_v1_Tier__Output);
}
