// Original file: ../../protos/h3/v1/h3.proto

import type { TierResidency as _h3_v1_TierResidency, TierResidency__Output as _h3_v1_TierResidency__Output } from '../../h3/v1/TierResidency.js';
import type { Long } from '@grpc/proto-loader';

export interface SessionStats {
  'sessionId'?: (string);
  'numTokens'?: (number | string | Long);
  'residency'?: (_h3_v1_TierResidency | null);
  /**
   * This session's blocks read from HBM / all blocks it read.
   */
  'hbmHitRate'?: (number | string);
  'ssdReadCount'?: (number | string | Long);
  'windowTokens'?: (number | string | Long);
  /**
   * Inter-token latency of its streams as the daemon sent them (milliseconds), over its last 512
   * tokens; 0 before its second token.
   */
  'itlMsP50'?: (number | string);
  'itlMsP99'?: (number | string);
  /**
   * Its fair share of HBM now, in blocks over all layers (h3d.tiers.shares): sessions with a
   * request in flight share the unpinned HBM in proportion to the blocks their policy reads per
   * step, with a floor each; 0 for an idle or pinned session (a pinned one keeps what it holds).
   */
  'hbmShareBlocks'?: (number | string | Long);
}

export interface SessionStats__Output {
  'sessionId': (string);
  'numTokens': (number);
  'residency': (_h3_v1_TierResidency__Output | null);
  /**
   * This session's blocks read from HBM / all blocks it read.
   */
  'hbmHitRate': (number);
  'ssdReadCount': (number);
  'windowTokens': (number);
  /**
   * Inter-token latency of its streams as the daemon sent them (milliseconds), over its last 512
   * tokens; 0 before its second token.
   */
  'itlMsP50': (number);
  'itlMsP99': (number);
  /**
   * Its fair share of HBM now, in blocks over all layers (h3d.tiers.shares): sessions with a
   * request in flight share the unpinned HBM in proportion to the blocks their policy reads per
   * step, with a floor each; 0 for an idle or pinned session (a pinned one keeps what it holds).
   */
  'hbmShareBlocks': (number);
}
