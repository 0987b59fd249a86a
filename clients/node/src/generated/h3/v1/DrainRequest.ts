// Original file: ../../protos/h3/v1/h3.proto


export interface DrainRequest {
  /**
   * Seconds to wait for requests in flight before cancelling them; 0: the daemon's
   * `drain_timeout_s`.
   */
  'timeoutS'?: (number | string);
}

export interface DrainRequest__Output {
  /**
   * Seconds to wait for requests in flight before cancelling them; 0: the daemon's
   * `drain_timeout_s`.
   */
  'timeoutS': (number);
}
