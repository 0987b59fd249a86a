// Original file: ../../protos/h3/v1/h3.proto


export interface ListSessionsRequest {
  /**
   * Sessions per page: 1..1000; 0 means 100.
   */
  'pageSize'?: (number);
  /**
   * From a previous response's `next_page_token`; empty for the first page.
   */
  'pageToken'?: (string);
  /**
   * With the remote tier: every session of the caller's in the store, those other daemons serve
   * (or none does) too, read from the store (`served_by`; residency unknown). Without it, this
   * daemon's sessions.
   */
  'all'?: (boolean);
}

export interface ListSessionsRequest__Output {
  /**
   * Sessions per page: 1..1000; 0 means 100.
   */
  'pageSize': (number);
  /**
   * From a previous response's `next_page_token`; empty for the first page.
   */
  'pageToken': (string);
  /**
   * With the remote tier: every session of the caller's in the store, those other daemons serve
   * (or none does) too, read from the store (`served_by`; residency unknown). Without it, this
   * daemon's sessions.
   */
  'all': (boolean);
}
