// Original file: ../../protos/h3/v1/h3.proto

import type { SamplingParams as _h3_v1_SamplingParams, SamplingParams__Output as _h3_v1_SamplingParams__Output } from '../../h3/v1/SamplingParams.js';

export interface CreateSessionRequest {
  /**
   * Prepended to the context (tokenized as the first piece, with the tokenizer's special tokens);
   * in a chat session, the template's system message.
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
  /**
   * A chat session: what is appended is a message (AppendContextRequest.role, "user" by default)
   * rendered through the model's chat template, `system_prompt` is the template's system message,
   * and Generate adds the assistant turn's header and stops at the template's end of turn
   * (a `prompt` is appended as a user message first). FAILED_PRECONDITION if the model has no
   * chat template.
   */
  'chat'?: (boolean);
}

export interface CreateSessionRequest__Output {
  /**
   * Prepended to the context (tokenized as the first piece, with the tokenizer's special tokens);
   * in a chat session, the template's system message.
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
  /**
   * A chat session: what is appended is a message (AppendContextRequest.role, "user" by default)
   * rendered through the model's chat template, `system_prompt` is the template's system message,
   * and Generate adds the assistant turn's header and stops at the template's end of turn
   * (a `prompt` is appended as a user message first). FAILED_PRECONDITION if the model has no
   * chat template.
   */
  'chat': (boolean);
}
