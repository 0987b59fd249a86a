// Original file: ../../protos/h3/v1/h3.proto

import type { Long } from '@grpc/proto-loader';

export interface Throughput {
  /**
   * Generated tokens per second over the last `window_s` seconds.
   */
  'tokensPerS'?: (number | string);
  'windowS'?: (number | string);
  'generatedTokensTotal'?: (number | string | Long);
  'prefillTokensTotal'?: (number | string | Long);
  /**
   * Requests running in the engine, and waiting: for a batch slot (max_batch_size), or, where the
   * sessions' KV is more than HBM and DDR hold, for earlier requests to end (a decode step runs the
   * oldest whose KV fits there, so that it does not read the rest from the archive).
   */
  'activeRequests'?: (number);
  'queuedRequests'?: (number);
  'sessions'?: (number);
  /**
   * Engine steps (one batched forward pass each: decode tokens and prefill chunks together)
   * since start. The growth of generated_tokens_total over that of steps_total is the mean
   * decode batch: how full the engine's steps are.
   */
  'stepsTotal'?: (number | string | Long);
  /**
   * Prefix reuse (`share_prefixes`): first requests of sessions without KV that looked for another
   * session holding KV for their first blocks of tokens, those that found one, and the tokens whose
   * KV they copied instead of computing it.
   */
  'prefixQueriesTotal'?: (number | string | Long);
  'prefixHitsTotal'?: (number | string | Long);
  'prefixReusedTokensTotal'?: (number | string | Long);
  /**
   * Finished request sessions whose KV is kept for prefix reuse (`prefix_cache_sessions`).
   */
  'prefixCacheSessions'?: (number);
}

export interface Throughput__Output {
  /**
   * Generated tokens per second over the last `window_s` seconds.
   */
  'tokensPerS': (number);
  'windowS': (number);
  'generatedTokensTotal': (number);
  'prefillTokensTotal': (number);
  /**
   * Requests running in the engine, and waiting: for a batch slot (max_batch_size), or, where the
   * sessions' KV is more than HBM and DDR hold, for earlier requests to end (a decode step runs the
   * oldest whose KV fits there, so that it does not read the rest from the archive).
   */
  'activeRequests': (number);
  'queuedRequests': (number);
  'sessions': (number);
  /**
   * Engine steps (one batched forward pass each: decode tokens and prefill chunks together)
   * since start. The growth of generated_tokens_total over that of steps_total is the mean
   * decode batch: how full the engine's steps are.
   */
  'stepsTotal': (number);
  /**
   * Prefix reuse (`share_prefixes`): first requests of sessions without KV that looked for another
   * session holding KV for their first blocks of tokens, those that found one, and the tokens whose
   * KV they copied instead of computing it.
   */
  'prefixQueriesTotal': (number);
  'prefixHitsTotal': (number);
  'prefixReusedTokensTotal': (number);
  /**
   * Finished request sessions whose KV is kept for prefix reuse (`prefix_cache_sessions`).
   */
  'prefixCacheSessions': (number);
}
