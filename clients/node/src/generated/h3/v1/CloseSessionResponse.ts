// Original file: ../../protos/h3/v1/h3.proto


export interface CloseSessionResponse {
}

export interface CloseSessionResponse__Output {
}
