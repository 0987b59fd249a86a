// Original file: ../../protos/h3/v1/h3.proto


export interface GetStatsRequest {
  /**
   * One session's figures only; empty: every session of the caller.
   */
  'sessionId'?: (string);
}

export interface GetStatsRequest__Output {
  /**
   * One session's figures only; empty: every session of the caller.
   */
  'sessionId': (string);
}
