// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

export interface AppendSummary {
  /**
   * Tokens added to the context.
   */
  'tokensAdded'?: (number | string | Long);
  /**
   * Seconds from the request to the end of its prefill.
   */
  'prefillS'?: (number | string);
  /**
   * The context's length now.
   */
  'numTokens'?: (number | string | Long);
}

export interface AppendSummary__Output {
  /**
   * Tokens added to the context.
   */
  'tokensAdded': (number);
  /**
   * Seconds from the request to the end of its prefill.
   */
  'prefillS': (number);
  /**
   * The context's length now.
   */
  'numTokens': (number);
}
