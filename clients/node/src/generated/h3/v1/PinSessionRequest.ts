// Original file: ../../protos/h3/v1/h3.proto


export interface PinSessionRequest {
  'sessionId'?: (string);
  /**
   * Seconds the pin lasts; 0: until unpinned.
   */
  'ttlS'?: (number | string);
  /**
   * Remove the pin instead.
   */
  'unpin'?: (boolean);
}

export interface PinSessionRequest__Output {
  'sessionId': (string);
  /**
   * Seconds the pin lasts; 0: until unpinned.
   */
  'ttlS': (number);
  /**
   * Remove the pin instead.
   */
  'unpin': (boolean);
}
