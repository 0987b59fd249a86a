// Original file: ../../protos/h3/v1/h3.proto


export interface ReleaseSessionRequest {
  'sessionId'?: (string);
}

export interface ReleaseSessionRequest__Output {
  'sessionId': (string);
}
