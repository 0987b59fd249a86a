// H3AdminClient: the operators' `h3.v1.H3Admin` service (tier moves, pinning, snapshots, policy,
// drain and resume, config). When the daemon has an `admin_token_file`, it needs one of its tokens.

import type { Metadata } from "@grpc/grpc-js";

import { type CallOptions, unary } from "./calls.js";
import { type ConnectionOptions, connect } from "./connection.js";
import type { GetConfigResponse__Output as GetConfigResponse } from "./generated/h3/v1/GetConfigResponse.js";
import type { H3AdminClient as H3AdminStub } from "./generated/h3/v1/H3Admin.js";
import { h3Package } from "./proto.js";
import type { DrainResult, EvictResult, Policy, ResumeResult, Session, SnapshotResult } from "./types.js";

export interface PinOptions extends CallOptions {
  /** Seconds the pin lasts; unset or 0: until unpinned. */
  ttlS?: number;
}

export interface DrainOptions extends CallOptions {
  /** Seconds to wait for requests in flight before cancelling them; unset: the daemon's `drain_timeout_s`. */
  timeoutS?: number;
}

const TIERS = { ddr: "TIER_DDR", ssd: "TIER_SSD" } as const;

/** A client of one daemon's `h3.v1.H3Admin` service; every method rejects with an H3Error subclass. */
export class H3AdminClient {
  readonly #stub: H3AdminStub;
  readonly #metadata: Metadata;

  constructor(options: ConnectionOptions) {
    [this.#stub, this.#metadata] = connect(h3Package().H3Admin, options);
  }

  /** Move a session's KV down now: to DDR (drop its HBM copies), or to the SSD archive. */
  evictSession(sessionId: string, to: keyof typeof TIERS, options: CallOptions = {}): Promise<EvictResult> {
    const request = { sessionId, to: TIERS[to] };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.evictSession(request, metadata, callOptions, callback),
    );
  }

  /** Keep a session's HBM blocks in HBM, for `ttlS` seconds or until unpinned. */
  pinSession(sessionId: string, options: PinOptions = {}): Promise<Session> {
    const request = { sessionId, ttlS: options.ttlS };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.pinSession(request, metadata, callOptions, callback),
    );
  }

  /** Remove a session's pin. */
  unpinSession(sessionId: string, options: CallOptions = {}): Promise<Session> {
    const request = { sessionId, unpin: true };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.pinSession(request, metadata, callOptions, callback),
    );
  }

  /** Make every full block of a session durable in the SSD archive now. */
  snapshotSession(sessionId: string, options: CallOptions = {}): Promise<SnapshotResult> {
    const request = { sessionId };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.snapshotSession(request, metadata, callOptions, callback),
    );
  }

  /** Switch the HBF policy of a session's decode steps. */
  setPolicy(sessionId: string, policy: Policy, options: CallOptions = {}): Promise<Session> {
    const request = { sessionId, policy };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.setPolicy(request, metadata, callOptions, callback),
    );
  }

  /** Stop accepting requests; wait for those in flight (up to `timeoutS`), cancel the rest. */
  drain(options: DrainOptions = {}): Promise<DrainResult> {
    const request = { timeoutS: options.timeoutS };
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.drain(request, metadata, callOptions, callback),
    );
  }

  /** Undo a drain: accept requests again (a SIGTERM's drain is not undone: UnavailableError). */
  resume(options: CallOptions = {}): Promise<ResumeResult> {
    return unary(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.resume({}, metadata, callOptions, callback),
    );
  }

  /** The daemon's effective configuration (every key, defaults included; secrets left out). */
  async getConfig(options: CallOptions = {}): Promise<Record<string, unknown>> {
    const response = await unary<GetConfigResponse>(this.#metadata, options, (metadata, callOptions, callback) =>
      this.#stub.getConfig({}, metadata, callOptions, callback),
    );
    return JSON.parse(response.json) as Record<string, unknown>;
  }

  /** Close the channel: make no more calls with this client. */
  closeChannel(): void {
    this.#stub.close();
  }
}
