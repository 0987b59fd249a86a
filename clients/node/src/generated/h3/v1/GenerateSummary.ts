// Original file: ../../protos/h3/v1/h3.proto

import type { FinishReason as _h3_v1_FinishReason, FinishReason__Output as _h3_v1_FinishReason__Output } from '../../h3/v1/FinishReason.js';
import type { TierResidency as _h3_v1_TierResidency, TierResidency__Output as _h3_v1_TierResidency__Output } from '../../h3/v1/TierResidency.js';
import type { TierStats as _h3_v1_TierStats, TierStats__Output as _h3_v1_TierStats__Output } from '../../h3/v1/TierStats.js';

export interface GenerateSummary {
  'finishReason'?: (_h3_v1_FinishReason);
  /**
   * Context tokens before generation, and tokens generated.
   */
  'promptTokens'?: (number);
  'completionTokens'?: (number);
  /**
   * Seconds from the request to its first token.
   */
  'ttftS'?: (number | string);
  /**
   * Decode throughput after the first token.
   */
  'tokensPerS'?: (number | string);
  /**
   * The session's tier figures after this request.
   */
  'residency'?: (_h3_v1_TierResidency | null);
  'tierStats'?: (_h3_v1_TierStats | null);
}

export interface GenerateSummary__Output {
  'finishReason': (_h3_v1_FinishReason__Output);
  /**
   * Context tokens before generation, and tokens generated.
   */
  'promptTokens': (number);
  'completionTokens': (number);
  /**
   * Seconds from the request to its first token.
   */
  'ttftS': (number);
  /**
   * Decode throughput after the first token.
   */
  'tokensPerS': (number);
  /**
   * The session's tier figures after this request.
   */
  'residency': (_h3_v1_TierResidency__Output | null);
  'tierStats': (_h3_v1_TierStats__Output | null);
}
