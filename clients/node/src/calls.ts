// How one call is made: the client's metadata (its token), a deadline, an AbortSignal that cancels
// it, and grpc-js failures turned into H3Errors. Both clients make every call through these two.

import type { CallOptions as GrpcCallOptions, ClientReadableStream, ClientUnaryCall, Metadata } from "@grpc/grpc-js";

import { abortError, toH3Error } from "./errors.js";

/** Options every method takes. */
export interface CallOptions {
  /** Aborting it cancels the call, which then rejects with an AbortError. */
  signal?: AbortSignal;
  /** Milliseconds the call may take in all, from its start (streams included); then DeadlineExceededError. */
  deadlineMs?: number;
}

type Callback<T> = (error: Error | null, value?: T) => void;

/** A unary call: `start` makes it with the metadata, grpc-js options and callback it is given. */
export function unary<T>(
  metadata: Metadata,
  { signal, deadlineMs }: CallOptions,
  start: (metadata: Metadata, options: GrpcCallOptions, callback: Callback<T>) => ClientUnaryCall,
): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    if (signal?.aborted) {
      reject(abortError(signal));
      return;
    }
    const cancel = (): void => call.cancel();
    const call = start(metadata.clone(), grpcOptions(deadlineMs), (error, value) => {
      signal?.removeEventListener("abort", cancel);
      if (error !== null) {
        reject(toH3Error(error, signal));
      } else {
        resolve(value as T);
      }
    });
    signal?.addEventListener("abort", cancel, { once: true });
  });
}

/**
 * A server-streaming call's messages. The call starts with the first `next()`; a consumer that
 * stops early (`break`, `return()`) cancels it, so the daemon frees the request's slot at once.
 */
export async function* serverStream<T>(
  metadata: Metadata,
  { signal, deadlineMs }: CallOptions,
  start: (metadata: Metadata, options: GrpcCallOptions) => ClientReadableStream<T>,
): AsyncGenerator<T, void, undefined> {
  if (signal?.aborted) {
    throw abortError(signal);
  }
  const call = start(metadata.clone(), grpcOptions(deadlineMs));
  const cancel = (): void => call.cancel();
  signal?.addEventListener("abort", cancel, { once: true });
  let ended = false;
  try {
    for await (const message of call) {
      yield message as T;
    }
    ended = true;
  } catch (error) {
    ended = true;
    throw toH3Error(error, signal);
  } finally {
    signal?.removeEventListener("abort", cancel);
    if (!ended) {
      call.cancel();
    }
  }
}

function grpcOptions(deadlineMs: number | undefined): GrpcCallOptions {
  return deadlineMs === undefined ? {} : { deadline: Date.now() + deadlineMs };
}
