// Original file: ../../protos/h3/v1/h3.proto


export interface CloseSessionRequest {
  'sessionId'?: (string);
  /**
   * Delete the session now: its token log and archived KV go, and its id is unknown from then on.
   * Without purge the session is closed: its requests in flight are cancelled, its KV moves to
   * the archive only (freeing HBM and DDR), it stays listed with `closed`, and its next request
   * reopens it. Closed sessions' archived KV is the first evicted past ssd_capacity_mb. A close
   * without purge is answered once the daemon has queued it (every later call sees the session
   * closed; its KV moves between decode steps); a purge is answered once the data is gone.
   */
  'purge'?: (boolean);
}

export interface CloseSessionRequest__Output {
  'sessionId': (string);
  /**
   * Delete the session now: its token log and archived KV go, and its id is unknown from then on.
   * Without purge the session is closed: its requests in flight are cancelled, its KV moves to
   * the archive only (freeing HBM and DDR), it stays listed with `closed`, and its next request
   * reopens it. Closed sessions' archived KV is the first evicted past ssd_capacity_mb. A close
   * without purge is answered once the daemon has queued it (every later call sees the session
   * closed; its KV moves between decode steps); a purge is answered once the data is gone.
   */
  'purge': (boolean);
}
