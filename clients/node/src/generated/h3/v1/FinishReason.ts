// Original file: ../../protos/h3/v1/h3.proto

export const FinishReason = {
  FINISH_REASON_UNSPECIFIED: 'FINISH_REASON_UNSPECIFIED',
  /**
   * An end-of-sequence token, a stop token id or a stop string.
   */
  FINISH_REASON_STOP: 'FINISH_REASON_STOP',
  /**
   * max_tokens, or the context reached `max_context_tokens`.
   */
  FINISH_REASON_LENGTH: 'FINISH_REASON_LENGTH',
  /**
   * The request was cancelled (the client went away, or the daemon drained).
   */
  FINISH_REASON_CANCELLED: 'FINISH_REASON_CANCELLED',
} as const;

export type FinishReason =
  | 'FINISH_REASON_UNSPECIFIED'
  | 0
  /**
   * An end-of-sequence token, a stop token id or a stop string.
   */
  | 'FINISH_REASON_STOP'
  | 1
  /**
   * max_tokens, or the context reached `max_context_tokens`.
   */
  | 'FINISH_REASON_LENGTH'
  | 2
  /**
   * The request was cancelled (the client went away, or the daemon drained).
   */
  | 'FINISH_REASON_CANCELLED'
  | 3

export type FinishReason__Output = typeof FinishReason[keyof typeof FinishReason]
