// The messages the clients return, as the generated types name them (src/generated), and the
// options the clients take.

export type { AppendProgress__Output as AppendProgress } from "./generated/h3/v1/AppendProgress.js";
export type { AppendSummary__Output as AppendSummary } from "./generated/h3/v1/AppendSummary.js";
export type { DrainResponse__Output as DrainResult } from "./generated/h3/v1/DrainResponse.js";
export type { EvictSessionResponse__Output as EvictResult } from "./generated/h3/v1/EvictSessionResponse.js";
export { FinishReason } from "./generated/h3/v1/FinishReason.js";
export type { GenerateSummary__Output as GenerateSummary } from "./generated/h3/v1/GenerateSummary.js";
export type { ListSessionsResponse__Output as SessionPage } from "./generated/h3/v1/ListSessionsResponse.js";
export type { ResumeResponse__Output as ResumeResult } from "./generated/h3/v1/ResumeResponse.js";
export type { SamplingParams__Output as SamplingParams } from "./generated/h3/v1/SamplingParams.js";
export type { Session__Output as Session } from "./generated/h3/v1/Session.js";
export type { SessionStats__Output as SessionStats } from "./generated/h3/v1/SessionStats.js";
export type { SnapshotSessionResponse__Output as SnapshotResult } from "./generated/h3/v1/SnapshotSessionResponse.js";
export type { Stats__Output as Stats } from "./generated/h3/v1/Stats.js";
export type { Throughput__Output as Throughput } from "./generated/h3/v1/Throughput.js";
export { Tier } from "./generated/h3/v1/Tier.js";
export type { TierResidency__Output as TierResidency } from "./generated/h3/v1/TierResidency.js";
export type { TierStats__Output as TierStats } from "./generated/h3/v1/TierStats.js";
export type { TokenDelta__Output as TokenDelta } from "./generated/h3/v1/TokenDelta.js";

/** HBF policy of a session's decode steps. */
export type Policy = "attention_entropy" | "exact" | "fixed" | "layerwise";

/** The role of a message appended to a chat session. */
export type Role = "user" | "assistant" | "system";

/** How tokens are sampled; unset fields take the session's defaults, which take the daemon's. */
export interface SamplingOptions {
  /** Tokens to generate at most: 1 ..= the daemon's `max_tokens_limit`. */
  maxTokens?: number;
  /** Softmax temperature, >= 0; 0 is greedy. */
  temperature?: number;
  /** Nucleus sampling, in (0, 1]. */
  topP?: number;
  /** Keep the k most likely tokens; 0 keeps all. */
  topK?: number;
  /** Seed of the request's random generator (a uint64, as a number or a decimal string). */
  seed?: number | string;
  /** Stop when the text contains one of these (the stop string itself is not returned). */
  stop?: readonly string[];
  /** Stop after generating one of these token ids (it is returned). */
  stopTokenIds?: readonly number[];
  /** Keep generating past the model's end-of-sequence tokens. */
  ignoreEos?: boolean;
}
