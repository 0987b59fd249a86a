// Original file: ../../protos/h3/v1/h3.proto

import type { AppendProgress as _h3_v1_AppendProgress, AppendProgress__Output as _h3_v1_AppendProgress__Output } from '../../h3/v1/AppendProgress.js';
import type { AppendSummary as _h3_v1_AppendSummary, AppendSummary__Output as _h3_v1_AppendSummary__Output } from '../../h3/v1/AppendSummary.js';

export interface AppendContextResponse {
  'progress'?: (_h3_v1_AppendProgress | null);
  /**
   * The last message of the stream.
   */
  'done'?: (_h3_v1_AppendSummary | null);
  'event'?: "progress"|"done";
}

export interface AppendContextResponse__Output {
  'progress'?: (_h3_v1_AppendProgress__Output | null);
  /**
   * The last message of the stream.
   */
  'done'?: (_h3_v1_AppendSummary__Output | null);
  'event'?: "progress"|"done";
}
