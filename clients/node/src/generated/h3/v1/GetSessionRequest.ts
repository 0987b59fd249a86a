// Original file: ../../protos/h3/v1/h3.proto


export interface GetSessionRequest {
  'sessionId'?: (string);
  /**
   * Include the context's token ids and text.
   */
  'withTokens'?: (boolean);
  /**
   * With the remote tier: take the session over from the store now if another daemon does not
   * serve it (its lease, its log; the KV is computed again by its next request), as any other call
   * naming it does. Without it, GetSession reads a session this daemon does not serve from the
   * store, leaving it where it is (`served_by`). FAILED_PRECONDITION if another daemon serves it.
   */
  'takeOver'?: (boolean);
}

export interface GetSessionRequest__Output {
  'sessionId': (string);
  /**
   * Include the context's token ids and text.
   */
  'withTokens': (boolean);
  /**
   * With the remote tier: take the session over from the store now if another daemon does not
   * serve it (its lease, its log; the KV is computed again by its next request), as any other call
   * naming it does. Without it, GetSession reads a session this daemon does not serve from the
   * store, leaving it where it is (`served_by`). FAILED_PRECONDITION if another daemon serves it.
   */
  'takeOver': (boolean);
}
