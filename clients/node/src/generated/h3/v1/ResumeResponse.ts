// Original file: ../../protos/h3/v1/h3.proto


export interface ResumeResponse {
  /**
   * Whether the daemon was draining (false: it was serving already).
   */
  'wasDraining'?: (boolean);
}

export interface ResumeResponse__Output {
  /**
   * Whether the daemon was draining (false: it was serving already).
   */
  'wasDraining': (boolean);
}
