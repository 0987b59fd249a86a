// Original file: ../../protos/h3/v1/h3.proto


export interface TokenDelta {
  /**
   * Text completed by these tokens (may be empty: a partial character, or held back because it
   * could start a stop string).
   */
  'text'?: (string);
  'tokenIds'?: (number)[];
}

export interface TokenDelta__Output {
  /**
   * Text completed by these tokens (may be empty: a partial character, or held back because it
   * could start a stop string).
   */
  'text': (string);
  'tokenIds': (number)[];
}
