// Original file: ../../protos/h3/v1/h3.proto

import type { SamplingParams as _h3_v1_SamplingParams, SamplingParams__Output as _h3_v1_SamplingParams__Output } from '../../h3/v1/SamplingParams.js';

export interface CreateSessionRequest {
  /**
   * Prepended to the context (tokenized as the first piece, with the tokenizer's special tokens).
   */
  'systemPrompt'?: (string);
  /**
   * HBF policy; empty: the daemon's `policy`.
   */
  'policy'?: (string);
  /**
   * The session's sampling defaults; unset fields: the daemon's.
   */
  'sampling'?: (_h3_v1_SamplingParams | null);
}

export interface CreateSessionRequest__Output {
  /**
   * Prepended to the context (tokenized as the first piece, with the tokenizer's special tokens).
   */
  'systemPrompt': (string);
  /**
   * HBF policy; empty: the daemon's `policy`.
   */
  'policy': (string);
  /**
   * The session's sampling defaults; unset fields: the daemon's.
   */
  'sampling': (_h3_v1_SamplingParams__Output | null);
}
