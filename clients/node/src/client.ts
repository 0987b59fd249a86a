// H3Client: the daemon's `h3.v1.H3` service (sessions, context, generation, stats) as promises and
// async iterables.

import { type Metadata, status as Status } from "@grpc/grpc-js";

import { type CallOptions, serverStream, unary } from "./calls.js";
import { type ConnectionOptions, connect } from "./connection.js";
import { H3Error } from "./errors.js";
import type { AppendContextResponse__Output as AppendEvent } from "./generated/h3/v1/AppendContextResponse.js";
import type { H3Client as H3Stub } from "./generated/h3/v1/H3.js";
import type { SamplingParams as SamplingParamsInput } from "./generated/h3/v1/SamplingParams.js";
import { Generation } from "./generation.js";
import { h3Package } from "./proto.js";
import type {
  AppendProgress,
  AppendSummary,
  Policy,
  Role,
  SamplingOptions,
  Session,
  SessionPage,
  Stats,
} from "./types.js";

export interface CreateSessionOptions extends CallOptions {
  /**
   * Prepended to the context (tokenized as the first piece, with the tokenizer's special tokens);
   * in a chat session, the chat template's system message.
   */
  systemPrompt?: string;
  /** HBF policy; unset: the daemon's `policy`. */
  policy?: Policy;
  /** The session's sampling defaults; unset fields: the daemon's. */
  sampling?: SamplingOptions;
  /**
   * A chat session: each append is a message (`role`, "user" by default) rendered through the
   * model's chat template, and a generation is the assistant's turn (its `prompt` appended as a
   * user message first), ending at the template's end of turn. FailedPreconditionError if the
   * model has no chat template.
   */
  chat?: boolean;
}

export interface GetSessionOptions extends CallOptions {
  /** Include the context's token ids and text. */
  withTokens?: boolean;
  /**
   * With the remote tier (`remote_url`): take the session over from the store now if no other
   * daemon serves it (FailedPreconditionError if one does). Without it, a session another daemon
   * serves is read from the store and left there (`servedBy`).
   */
  takeOver?: boolean;
}

export interface ForkSessionOptions extends CallOptions {
  /** The fork's context: this many of the session's first tokens (all of them if unset). */
  atTokens?: number;
}

export interface ListSessionsOptions extends CallOptions {
  /** Sessions per page: 1..1000; unset: 100. */
  pageSize?: number;
  /** A previous page's `nextPageToken`; unset: the first page. */
  pageToken?: string;
  /** With the remote tier: the caller's sessions in the whole store, those other daemons serve too. */
  all?: boolean;
}

export interface CloseOptions extends CallOptions {
  /** Also delete the session's archived blocks now. */
  purge?: boolean;
}

export interface AppendOptions extends CallOptions {
  /** Called as the daemon prefills the appended tokens. */
  onProgress?: (progress: AppendProgress) => void;
  /**
   * The message's role, in a chat session (unset: "user"); InvalidArgumentError in a plain session,
   * or with token ids.
   */
  role?: Role;
}

export interface GenerateOptions extends SamplingOptions, CallOptions {
  /**
   * Appended to the context first: text (tokenized on its own) or token ids; in a chat session,
   * text only, appended as a user message.
   */
  prompt?: string | readonly number[];
}

/** A client of one daemon's `h3.v1.H3` service; every method rejects with an H3Error subclass. */
export class H3Client {
  readonly #stub: H3Stub;
  readonly #metadata: Metadata;

  constructor(options: ConnectionOptions) {
    [this.#stub, this.#metadata] = connect(h3Package().H3, options);
  }

  /** Open a session (its system prompt is prefilled with the first request). */
  createSession(options: CreateSessionOptions = {}): Promise<Session> {
    const request = {
      systemPrompt: options.systemPrompt,
      policy: options.policy,
      sampling: options.sampling && samplingParams(options.sampling),
      chat: options.chat,
    };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.createSession(request, metadata, callOptions, callback),
    );
  }

  /** One session's metadata (and, with `withTokens`, its whole context). */
  getSession(sessionId: string, options: GetSessionOptions = {}): Promise<Session> {
    const request = { sessionId, withTokens: options.withTokens, takeOver: options.takeOver };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.getSession(request, metadata, callOptions, callback),
    );
  }

  /**
   * A new session whose context is the first `atTokens` tokens of another's (all by default),
   * its KV blocks shared and its last tokens prefilled before this resolves: ready to decode.
   */
  forkSession(sessionId: string, options: ForkSessionOptions = {}): Promise<Session> {
    const request = { sessionId, atTokens: options.atTokens };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.forkSession(request, metadata, callOptions, callback),
    );
  }

  /** One page of the caller's sessions, oldest first. */
  listSessions(options: ListSessionsOptions = {}): Promise<SessionPage> {
    const request = { pageSize: options.pageSize, pageToken: options.pageToken, all: options.all };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.listSessions(request, metadata, callOptions, callback),
    );
  }

  /** Every session of the caller, oldest first, fetched a page at a time. */
  async *sessions(options: ListSessionsOptions = {}): AsyncGenerator<Session, void, undefined> {
    let pageToken = options.pageToken;
    do {
      const page = await this.listSessions({ ...options, pageToken });
      yield* page.sessions;
      pageToken = page.nextPageToken;
    } while (pageToken !== "");
  }

  /**
   * With the remote tier (`remote_url`): hand the session over to the other daemons of the store
   * at once (its log's last bytes and its KV stored, its lease released, forgotten here).
   * FailedPreconditionError without the remote tier.
   */
  async releaseSession(sessionId: string, options: CallOptions = {}): Promise<void> {
    const request = { sessionId };
    await unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.releaseSession(request, metadata, callOptions, callback),
    );
  }

  /** Close a session and free its KV in every tier. */
  async close(sessionId: string, options: CloseOptions = {}): Promise<void> {
    const request = { sessionId, purge: options.purge };
    await unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.closeSession(request, metadata, callOptions, callback),
    );
  }

  /**
   * Add text or token ids to the context and prefill them (in a chat session: a message of
   * `role`, as text); resolves to the append's summary.
   */
  async append(
    sessionId: string,
    input: string | readonly number[],
    options: AppendOptions = {},
  ): Promise<AppendSummary> {
    const { role } = options;
    const request =
      typeof input === "string" ? { sessionId, text: input, role } : { sessionId, tokenIds: [...input], role };
    const events = serverStream<AppendEvent>(this.#metadata, options, (metadata, callOptions) =>
      this.#stub.appendContext(request, metadata, callOptions),
    );
    let summary: AppendSummary | undefined;
    for await (const event of events) {
      if (event.progress) {
        options.onProgress?.(event.progress);
      } else if (event.done) {
        summary = event.done; // the last message; the loop reads on to the call's status
      }
    }
    if (summary === undefined) {
      throw new H3Error(Status.UNKNOWN, "the AppendContext stream ended without its summary");
    }
    return summary;
  }

  /**
   * Generate, continuing the session's context (after appending `prompt`, if any): iterate the
   * result for the text deltas, then read its `done` for the summary (see Generation).
   */
  generate(sessionId: string, options: GenerateOptions = {}): Generation {
    const { prompt } = options;
    const request = {
      sessionId,
      ...(typeof prompt === "string" ? { prompt } : { promptTokenIds: prompt && [...prompt] }),
      sampling: samplingParams(options),
    };
    return new Generation(
      serverStream(this.#metadata, options, (metadata, callOptions) =>
        this.#stub.generate(request, metadata, callOptions),
      ),
    );
  }

  /** Tier and throughput figures: global, and per session (`sessionId`'s only, or all the caller's). */
  stats(sessionId?: string, options: CallOptions = {}): Promise<Stats> {
    const request = { sessionId };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.getStats(request, metadata, callOptions, callback),
    );
  }

  /** Close the channel: make no more calls with this client. */
  closeChannel(): void {
    this.#stub.close();
  }
}

/** The SamplingParams message of `options`: fields left undefined stay unset (the defaults apply). */
export function samplingParams(options: SamplingOptions): SamplingParamsInput {
  return {
    maxTokens: options.maxTokens,
    temperature: options.temperature,
    topP: options.topP,
    topK: options.topK,
    seed: options.seed,
    stop: options.stop && [...options.stop],
    stopTokenIds: options.stopTokenIds && [...options.stopTokenIds],
    ignoreEos: options.ignoreEos,
  };
}
