// Original file: ../../protos/h3/v1/h3.proto


export interface ReleaseSessionResponse {
}

export interface ReleaseSessionResponse__Output {
}
