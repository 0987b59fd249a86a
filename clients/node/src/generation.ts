// A Generate call seen from JavaScript: an async iterable of text deltas, and its summary.

import { status as Status } from "@grpc/grpc-js";

import { CancelledError, H3Error } from "./errors.js";
import type { GenerateResponse__Output as GenerateResponse } from "./generated/h3/v1/GenerateResponse.js";
import type { GenerateSummary, TokenDelta } from "./types.js";

/** What `Generation.collect()` gathers. */
export interface GenerationResult {
  text: string;
  tokenIds: number[];
  summary: GenerateSummary;
}

/**
 * The tokens of one Generate call, as they are produced:
 *
 *     const generation = h3.generate(sessionId, { prompt, maxTokens: 64 });
 *     for await (const delta of generation) process.stdout.write(delta.text);
 *     const summary = await generation.done;   // finish reason, token counts, ttft, ...
 *
 * The call starts when the iteration does, and a Generation is iterated once. `done` settles when
 * the iteration ends: with the summary, or with the error that ended the stream (the same error the
 * loop throws). Leaving the loop early (`break`) cancels the call; `done` then rejects with a
 * CancelledError. `collect()` does the iteration for callers that want only the result.
 */
export class Generation implements AsyncIterable<TokenDelta> {
  /** The stream's summary (its last message); see the class comment for when it settles. */
  readonly done: Promise<GenerateSummary>;
  readonly #events: AsyncIterable<GenerateResponse>;
  #resolve: (summary: GenerateSummary) => void = () => {};
  #reject: (error: unknown) => void = () => {};
  #started = false;

  constructor(events: AsyncIterable<GenerateResponse>) {
    this.#events = events;
    this.done = new Promise<GenerateSummary>((resolve, reject) => {
      this.#resolve = resolve;
      this.#reject = reject;
    });
    // The loop throws the same error: a caller that never reads `done` must not get an
    // unhandled rejection for it.
    this.done.catch(() => {});
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<TokenDelta, void, undefined> {
    if (this.#started) {
      throw new Error("a Generation can be iterated only once");
    }
    this.#started = true;
    let summary: GenerateSummary | undefined;
    try {
      for await (const message of this.#events) {
        if (message.delta) {
          yield message.delta;
        } else if (message.done) {
          summary = message.done;
        }
      }
      if (summary === undefined) {
        throw new H3Error(Status.UNKNOWN, "the Generate stream ended without its summary");
      }
      this.#resolve(summary);
    } catch (error) {
      this.#reject(error);
      throw error;
    } finally {
      // A no-op once settled; otherwise the consumer left the loop early and the call was cancelled.
      this.#reject(new CancelledError(Status.CANCELLED, "the iteration stopped before the stream's summary"));
    }
  }

  /** Iterate to the end: the whole text, the token ids and the summary. */
  async collect(): Promise<GenerationResult> {
    let text = "";
    const tokenIds: number[] = [];
    for await (const delta of this) {
      text += delta.text;
      tokenIds.push(...delta.tokenIds);
    }
    return { text, tokenIds, summary: await this.done };
  }
}
