// @h3d/client: a Node client of h3d, the daemon serving LLM inference from a tiered KV cache.

export { status as Status, credentials } from "@grpc/grpc-js";
export { H3AdminClient, type DrainOptions, type PinOptions } from "./admin.js";
export type { CallOptions } from "./calls.js";
export {
  H3Client,
  type AppendOptions,
  type CloseOptions,
  type CreateSessionOptions,
  type GenerateOptions,
  type ForkSessionOptions,
  type GetSessionOptions,
  type ListSessionsOptions,
} from "./client.js";
export type { ConnectionOptions } from "./connection.js";
export * from "./errors.js";
export { Generation, type GenerationResult } from "./generation.js";
export * from "./types.js";
