// Original file: ../../protos/h3/v1/h3.proto


export interface SnapshotSessionRequest {
  'sessionId'?: (string);
}

export interface SnapshotSessionRequest__Output {
  'sessionId': (string);
}
