// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

export interface AppendProgress {
  /**
   * Tokens of this append whose KV is computed, of `tokens_total`.
   */
  'tokensDone'?: (number | string | Long);
  'tokensTotal'?: (number | string | Long);
}

export interface AppendProgress__Output {
  /**
   * Tokens of this append whose KV is computed, of `tokens_total`.
   */
  'tokensDone': (number);
  'tokensTotal': (number);
}
