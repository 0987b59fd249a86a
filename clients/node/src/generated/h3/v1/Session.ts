// Original file: ../../protos/h3/v1/h3.proto

import type { SamplingParams as _h3_v1_SamplingParams, SamplingParams__Output as _h3_v1_SamplingParams__Output } from '../../h3/v1/SamplingParams.js';
import type { TierResidency as _h3_v1_TierResidency, TierResidency__Output as _h3_v1_TierResidency__Output } from '../../h3/v1/TierResidency.js';
import type { Long } from '@grpc/proto-loader';

export interface Session {
  /**
   * Opaque id (32 hex digits).
   */
  'sessionId'?: (string);
  /**
   * Tokens in the context (given and generated).
   */
  'numTokens'?: (number | string | Long);
  /**
   * Tokens whose KV is computed (the rest are prefilled by the next request).
   */
  'cachedTokens'?: (number | string | Long);
  /**
   * HBF policy of its decode steps: attention_entropy, exact, fixed or layerwise.
   */
  'policy'?: (string);
  /**
   * Unix time (seconds) of creation and of the last request.
   */
  'createdAt'?: (number | string);
  'lastUsedAt'?: (number | string);
  /**
   * A request (append or generate) is in flight.
   */
  'busy'?: (boolean);
  /**
   * Pinned in HBM (PinSession); `pinned_until` is its Unix expiry, 0 for no expiry.
   */
  'pinned'?: (boolean);
  'pinnedUntil'?: (number | string);
  /**
   * Its sampling defaults.
   */
  'sampling'?: (_h3_v1_SamplingParams | null);
  'residency'?: (_h3_v1_TierResidency | null);
  /**
   * HBF token budget per layer of its decode steps (attention_entropy resizes it).
   */
  'windowTokens'?: (number | string | Long);
  /**
   * Only with GetSessionRequest.with_tokens: the whole context, as ids and decoded text.
   */
  'tokenIds'?: (number)[];
  'text'?: (string);
  /**
   * Closed (CloseSession without purge, or idle past session_ttl_s): its KV is in the archive
   * only, nothing of it in HBM or DDR; its next Append or Generate reopens it where it stopped.
   */
  'closed'?: (boolean);
  /**
   * A chat session (CreateSessionRequest.chat).
   */
  'chat'?: (boolean);
  /**
   * Messages of a chat session's conversation (appended and generated).
   */
  'numMessages'?: (number);
  /**
   * With the remote tier: the daemon that serves the session now (its lease's holder), when it
   * is not this one (GetSession reads such a session from the store without taking it over; the
   * residency and cached_tokens are then unknown, 0). Empty otherwise.
   */
  'servedBy'?: (string);
}

export interface Session__Output {
  /**
   * Opaque id (32 hex digits).
   */
  'sessionId': (string);
  /**
   * Tokens in the context (given and generated).
   */
  'numTokens': (number);
  /**
   * Tokens whose KV is computed (the rest are prefilled by the next request).
   */
  'cachedTokens': (number);
  /**
   * HBF policy of its decode steps: attention_entropy, exact, fixed or layerwise.
   */
  'policy': (string);
  /**
   * Unix time (seconds) of creation and of the last request.
   */
  'createdAt': (number);
  'lastUsedAt': (number);
  /**
   * A request (append or generate) is in flight.
   */
  'busy': (boolean);
  /**
   * Pinned in HBM (PinSession); `pinned_until` is its Unix expiry, 0 for no expiry.
   */
  'pinned': (boolean);
  'pinnedUntil': (number);
  /**
   * Its sampling defaults.
   */
  'sampling': (_h3_v1_SamplingParams__Output | null);
  'residency': (_h3_v1_TierResidency__Output | null);
  /**
   * HBF token budget per layer of its decode steps (attention_entropy resizes it).
   */
  'windowTokens': (number);
  /**
   * Only with GetSessionRequest.with_tokens: the whole context, as ids and decoded text.
   */
  'tokenIds': (number)[];
  'text': (string);
  /**
   * Closed (CloseSession without purge, or idle past session_ttl_s): its KV is in the archive
   * only, nothing of it in HBM or DDR; its next Append or Generate reopens it where it stopped.
   */
  'closed': (boolean);
  /**
   * A chat session (CreateSessionRequest.chat).
   */
  'chat': (boolean);
  /**
   * Messages of a chat session's conversation (appended and generated).
   */
  'numMessages': (number);
  /**
   * With the remote tier: the daemon that serves the session now (its lease's holder), when it
   * is not this one (GetSession reads such a session from the store without taking it over; the
   * residency and cached_tokens are then unknown, 0). Empty otherwise.
   */
  'servedBy': (string);
}
