// Original file: ../../protos/h3/v1/h3.proto

import type { SamplingParams as _h3_v1_SamplingParams, SamplingParams__Output as _h3_v1_SamplingParams__Output } from '../../h3/v1/SamplingParams.js';

export interface GenerateRequest {
  'sessionId'?: (string);
  /**
   * Appended to the context first (tokenized on its own); may be empty when the context is not.
   */
  'prompt'?: (string);
  /**
   * Or token ids to append first (not with `prompt`).
   */
  'promptTokenIds'?: (number)[];
  'sampling'?: (_h3_v1_SamplingParams | null);
}

export interface GenerateRequest__Output {
  'sessionId': (string);
  /**
   * Appended to the context first (tokenized on its own); may be empty when the context is not.
   */
  'prompt': (string);
  /**
   * Or token ids to append first (not with `prompt`).
   */
  'promptTokenIds': (number)[];
  'sampling': (_h3_v1_SamplingParams__Output | null);
}
