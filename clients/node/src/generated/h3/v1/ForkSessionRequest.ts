// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

export interface ForkSessionRequest {
  /**
   * The session to fork (yours).
   */
  'sessionId'?: (string);
  /**
   * The fork's context: this many of the session's first tokens; unset: all of them.
   */
  'atTokens'?: (number | string | Long);
  '_atTokens'?: "atTokens";
}

export interface ForkSessionRequest__Output {
  /**
   * The session to fork (yours).
   */
  'sessionId': (string);
  /**
   * The fork's context: this many of the session's first tokens; unset: all of them.
   */
  'atTokens'?: (number);
  '_atTokens'?: "atTokens";
}
