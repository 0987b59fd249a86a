// Original file: ../../protos/h3/v1/h3.proto


export interface ResumeRequest {
}

export interface ResumeRequest__Output {
}
