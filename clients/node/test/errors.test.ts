// gRPC failures mapped to H3Error classes, without a daemon.

import { Metadata, type ServiceError } from "@grpc/grpc-js";
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  AbortError,
  CancelledError,
  DataLossError,
  DeadlineExceededError,
  FailedPreconditionError,
  H3Error,
  InternalError,
  InvalidArgumentError,
  NotFoundError,
  PermissionDeniedError,
  ResourceExhaustedError,
  Status,
  toH3Error,
  UnauthenticatedError,
  UnavailableError,
} from "../src/index.js";

function serviceError(code: Status, details: string, trailers: Record<string, string> = {}): ServiceError {
  const metadata = new Metadata();
  for (const [key, value] of Object.entries(trailers)) {
    metadata.set(key, value);
  }
  return Object.assign(new Error(`${code} ${Status[code]}: ${details}`), { code, details, metadata });
}

test("each status code the daemon uses maps to its class", () => {
  const classes: Array<[Status, new (...args: never[]) => H3Error]> = [
    [Status.NOT_FOUND, NotFoundError],
    [Status.INVALID_ARGUMENT, InvalidArgumentError],
    [Status.FAILED_PRECONDITION, FailedPreconditionError],
    [Status.RESOURCE_EXHAUSTED, ResourceExhaustedError],
    [Status.UNAVAILABLE, UnavailableError],
    [Status.DEADLINE_EXCEEDED, DeadlineExceededError],
    [Status.CANCELLED, CancelledError],
    [Status.UNAUTHENTICATED, UnauthenticatedError],
    [Status.PERMISSION_DENIED, PermissionDeniedError],
    [Status.DATA_LOSS, DataLossError],
    [Status.INTERNAL, InternalError],
  ];
  for (const [code, cls] of classes) {
    const cause = serviceError(code, "what went wrong");
    const error = toH3Error(cause);
    assert.ok(error instanceof cls, `${Status[code]}: ${String(error)}`);
    assert.ok(error instanceof H3Error && error instanceof Error);
    assert.equal(error.code, code);
    assert.equal(error.details, "what went wrong");
    assert.equal(error.message, `${Status[code]}: what went wrong`);
    assert.equal(error.name, cls.name);
    assert.equal(error.cause, cause);
    assert.equal(error.retryAfterMs, undefined);
  }
  const other = toH3Error(serviceError(Status.ABORTED, "odd"));
  assert.ok(other instanceof H3Error && other.constructor === H3Error && other.code === Status.ABORTED);
});

test("the retry-after-ms trailer is read", () => {
  const error = toH3Error(serviceError(Status.RESOURCE_EXHAUSTED, "queue full", { "retry-after-ms": "250" }));
  assert.ok(error instanceof ResourceExhaustedError);
  assert.equal(error.retryAfterMs, 250);
  assert.deepEqual(error.metadata.get("retry-after-ms"), ["250"]);
});

test("a call cancelled by an aborted signal is an AbortError, a CancelledError", () => {
  const controller = new AbortController();
  const reason = new Error("user pressed Ctrl-C");
  controller.abort(reason);
  const error = toH3Error(serviceError(Status.CANCELLED, "Cancelled on client"), controller.signal);
  assert.ok(error instanceof AbortError && error instanceof CancelledError);
  assert.equal(error.name, "AbortError");
  assert.equal(error.code, Status.CANCELLED);
  assert.equal(error.cause, reason);
});

test("what is not a gRPC status passes through unchanged", () => {
  const bug = new TypeError("not a status");
  assert.equal(toH3Error(bug), bug);
  const h3 = new NotFoundError(Status.NOT_FOUND, "no session");
  assert.equal(toH3Error(h3), h3);
});
