// Original file: ../../protos/h3/v1/h3.proto

import type { TokenDelta as _h3_v1_TokenDelta, TokenDelta__Output as _h3_v1_TokenDelta__Output } from '../../h3/v1/TokenDelta.js';
import type { GenerateSummary as _h3_v1_GenerateSummary, GenerateSummary__Output as _h3_v1_GenerateSummary__Output } from '../../h3/v1/GenerateSummary.js';

export interface GenerateResponse {
  'delta'?: (_h3_v1_TokenDelta | null);
  /**
   * The last message of the stream.
   */
  'done'?: (_h3_v1_GenerateSummary | null);
  'event'?: "delta"|"done";
}

export interface GenerateResponse__Output {
  'delta'?: (_h3_v1_TokenDelta__Output | null);
  /**
   * The last message of the stream.
   */
  'done'?: (_h3_v1_GenerateSummary__Output | null);
  'event'?: "delta"|"done";
}
