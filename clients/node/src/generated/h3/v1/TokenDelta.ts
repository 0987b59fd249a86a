// Original file: ../../protos/h3/v1/h3.proto


/**
 * One token as it is made, or several in one message when the daemon's side of the stream fell
 * behind the engine (the tokens already queued go out together, in order).
 */
export interface TokenDelta {
  /**
   * Text completed by these tokens (may be empty: a partial character, or held back because it
   * could start a stop string).
   */
  'text'?: (string);
  'tokenIds'?: (number)[];
}

/**
 * One token as it is made, or several in one message when the daemon's side of the stream fell
 * behind the engine (the tokens already queued go out together, in order).
 */
export interface TokenDelta__Output {
  /**
   * Text completed by these tokens (may be empty: a partial character, or held back because it
   * could start a stop string).
   */
  'text': (string);
  'tokenIds': (number)[];
}
