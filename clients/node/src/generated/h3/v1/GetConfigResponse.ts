// Original file: ../../protos/h3/v1/h3.proto


export interface GetConfigResponse {
  /**
   * The effective configuration as one JSON object (every key, defaults included; token file
   * paths are shown, their contents never).
   */
  'json'?: (string);
}

export interface GetConfigResponse__Output {
  /**
   * The effective configuration as one JSON object (every key, defaults included; token file
   * paths are shown, their contents never).
   */
  'json': (string);
}
