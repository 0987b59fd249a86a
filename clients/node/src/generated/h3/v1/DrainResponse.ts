// Original file: ../../protos/h3/v1/h3.proto


export interface DrainResponse {
  'requestsFinished'?: (number);
  'requestsCancelled'?: (number);
}

export interface DrainResponse__Output {
  'requestsFinished': (number);
  'requestsCancelled': (number);
}
