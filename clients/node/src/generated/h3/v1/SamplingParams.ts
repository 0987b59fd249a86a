// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

/**
 * How tokens are sampled. Unset fields take the session's defaults (set at CreateSession), which
 * take the daemon's (`[sampling]` in h3d.toml).
 */
export interface SamplingParams {
  /**
   * Tokens to generate at most: 1 ..= the daemon's `max_tokens_limit`.
   */
  'maxTokens'?: (number);
  /**
   * Softmax temperature, >= 0; 0 is greedy.
   */
  'temperature'?: (number | string);
  /**
   * Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; (0, 1].
   */
  'topP'?: (number | string);
  /**
   * Keep the k most likely tokens; 0 keeps all.
   */
  'topK'?: (number);
  /**
   * Seed of this request's random generator (reproducible sampling); unset: random.
   */
  'seed'?: (number | string | Long);
  /**
   * Stop when the generated text contains one of these (the stop string itself is not returned).
   */
  'stop'?: (string)[];
  /**
   * Stop after generating one of these token ids (it is returned).
   */
  'stopTokenIds'?: (number)[];
  /**
   * Keep generating past the model's end-of-sequence tokens.
   */
  'ignoreEos'?: (boolean);
  /**
   * OpenAI's presence penalty, -2 ..= 2: a token's logit loses this once if this request generated
   * it already (the prompt and earlier turns do not count). Unset: 0.
   */
  'presencePenalty'?: (number | string);
  /**
   * OpenAI's frequency penalty, -2 ..= 2: a token's logit loses this times the number of times this
   * request generated it. Unset: 0.
   */
  'frequencyPenalty'?: (number | string);
  '_maxTokens'?: "maxTokens";
  '_temperature'?: "temperature";
  '_topP'?: "topP";
  '_topK'?: "topK";
  '_seed'?: "seed";
  '_presencePenalty'?: "presencePenalty";
  '_frequencyPenalty'?: "frequencyPenalty";
}

/**
 * How tokens are sampled. Unset fields take the session's defaults (set at CreateSession), which
 * take the daemon's (`[sampling]` in h3d.toml).
 */
export interface SamplingParams__Output {
  /**
   * Tokens to generate at most: 1 ..= the daemon's `max_tokens_limit`.
   */
  'maxTokens'?: (number);
  /**
   * Softmax temperature, >= 0; 0 is greedy.
   */
  'temperature'?: (number);
  /**
   * Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; (0, 1].
   */
  'topP'?: (number);
  /**
   * Keep the k most likely tokens; 0 keeps all.
   */
  'topK'?: (number);
  /**
   * Seed of this request's random generator (reproducible sampling); unset: random.
   */
  'seed'?: (number);
  /**
   * Stop when the generated text contains one of these (the stop string itself is not returned).
   */
  'stop': (string)[];
  /**
   * Stop after generating one of these token ids (it is returned).
   */
  'stopTokenIds': (number)[];
  /**
   * Keep generating past the model's end-of-sequence tokens.
   */
  'ignoreEos': (boolean);
  /**
   * OpenAI's presence penalty, -2 ..= 2: a token's logit loses this once if this request generated
   * it already (the prompt and earlier turns do not count). Unset: 0.
   */
  'presencePenalty'?: (number);
  /**
   * OpenAI's frequency penalty, -2 ..= 2: a token's logit loses this times the number of times this
   * request generated it. Unset: 0.
   */
  'frequencyPenalty'?: (number);
  '_maxTokens'?: "maxTokens";
  '_temperature'?: "temperature";
  '_topP'?: "topP";
  '_topK'?: "topK";
  '_seed'?: "seed";
  '_presencePenalty'?: "presencePenalty";
  '_frequencyPenalty'?: "frequencyPenalty";
}
