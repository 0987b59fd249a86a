// Original file: ../../protos/h3/v1/h3.proto


export interface GetConfigRequest {
}

export interface GetConfigRequest__Output {
}
