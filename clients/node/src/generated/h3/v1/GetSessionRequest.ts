// Original file: ../../protos/h3/v1/h3.proto


export interface GetSessionRequest {
  'sessionId'?: (string);
  /**
   * Include the context's token ids and text.
   */
  'withTokens'?: (boolean);
}

export interface GetSessionRequest__Output {
  'sessionId': (string);
  /**
   * Include the context's token ids and text.
   */
  'withTokens': (boolean);
}
