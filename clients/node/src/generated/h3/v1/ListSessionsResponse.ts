// Original file: ../../protos/h3/v1/h3.proto

import type { Session as _h3_v1_Session, Session__Output as _h3_v1_Session__Output } from '../../h3/v1/Session.js';

export interface ListSessionsResponse {
  'sessions'?: (_h3_v1_Session)[];
  /**
   * Empty on the last page.
   */
  'nextPageToken'?: (string);
  /**
   * The caller's sessions in all.
   */
  'total'?: (number);
}

export interface ListSessionsResponse__Output {
  'sessions': (_h3_v1_Session__Output)[];
  /**
   * Empty on the last page.
   */
  'nextPageToken': (string);
  /**
   * The caller's sessions in all.
   */
  'total': (number);
}
