// Original file: ../../protos/h3/v1/h3.proto

import type { TierStats as _h3_v1_TierStats, TierStats__Output as _h3_v1_TierStats__Output } from '../../h3/v1/TierStats.js';
import type { SessionStats as _h3_v1_SessionStats, SessionStats__Output as _h3_v1_SessionStats__Output } from '../../h3/v1/SessionStats.js';
import type { Throughput as _h3_v1_Throughput, Throughput__Output as _h3_v1_Throughput__Output } from '../../h3/v1/Throughput.js';
import type { GraphStats as _h3_v1_GraphStats, GraphStats__Output as _h3_v1_GraphStats__Output } from '../../h3/v1/GraphStats.js';

export interface Stats {
  'global'?: (_h3_v1_TierStats | null);
  'sessions'?: (_h3_v1_SessionStats)[];
  'throughput'?: (_h3_v1_Throughput | null);
  /**
   * Seconds since the daemon started.
   */
  'uptimeS'?: (number | string);
  /**
   * The daemon is draining (refusing new requests).
   */
  'draining'?: (boolean);
  'graphs'?: (_h3_v1_GraphStats | null);
}

export interface Stats__Output {
  'global': (_h3_v1_TierStats__Output | null);
  'sessions': (_h3_v1_SessionStats__Output)[];
  'throughput': (_h3_v1_Throughput__Output | null);
  /**
   * Seconds since the daemon started.
   */
  'uptimeS': (number);
  /**
   * The daemon is draining (refusing new requests).
   */
  'draining': (boolean);
  'graphs': (_h3_v1_GraphStats__Output | null);
}
