// Original file: ../../protos/h3/v1/h3.proto


export interface AppendContextRequest {
  'sessionId'?: (string);
  /**
   * What to append: text (tokenized on its own, valid UTF-8) or token ids (each < the vocabulary
   * size), not both.
   */
  'text'?: (string);
  'tokenIds'?: (number)[];
  /**
   * Chat sessions only (INVALID_ARGUMENT otherwise, and with token_ids): the message's role,
   * "user" (the default), "assistant" or "system".
   */
  'role'?: (string);
}

export interface AppendContextRequest__Output {
  'sessionId': (string);
  /**
   * What to append: text (tokenized on its own, valid UTF-8) or token ids (each < the vocabulary
   * size), not both.
   */
  'text': (string);
  'tokenIds': (number)[];
  /**
   * Chat sessions only (INVALID_ARGUMENT otherwise, and with token_ids): the message's role,
   * "user" (the default), "assistant" or "system".
   */
  'role': (string);
}
