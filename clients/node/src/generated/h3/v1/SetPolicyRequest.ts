// Original file: ../../protos/h3/v1/h3.proto


export interface SetPolicyRequest {
  'sessionId'?: (string);
  /**
   * attention_entropy, exact, fixed or layerwise.
   */
  'policy'?: (string);
}

export interface SetPolicyRequest__Output {
  'sessionId': (string);
  /**
   * attention_entropy, exact, fixed or layerwise.
   */
  'policy': (string);
}
