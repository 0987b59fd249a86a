// Every failed call rejects with an H3Error: one subclass per gRPC status code the daemon uses
// (protos/h3/v1/h3.proto lists what each means), so callers can `catch` by class.

import { Metadata, status as Status, type ServiceError } from "@grpc/grpc-js";

/** The trailer the daemon sets on RESOURCE_EXHAUSTED when the client should retry later. */
export const RETRY_AFTER_TRAILER = "retry-after-ms";

/** A call that ended with a gRPC status other than OK. */
export class H3Error extends Error {
  /** The gRPC status code (compare with `Status.NOT_FOUND`, ...). */
  readonly code: Status;
  /** The daemon's message, meant for a person (it names the bad field, if any). */
  readonly details: string;
  /** The call's trailing metadata. */
  readonly metadata: Metadata;
  /** From the `retry-after-ms` trailer: how long to wait before retrying, when the daemon says. */
  readonly retryAfterMs: number | undefined;

  constructor(code: Status, details: string, metadata: Metadata = new Metadata(), options?: ErrorOptions) {
    super(`${Status[code] ?? code}: ${details}`, options);
    this.name = new.target.name;
    this.code = code;
    this.details = details;
    this.metadata = metadata;
    this.retryAfterMs = retryAfter(metadata);
  }
}

/** No such session, or one that belongs to another token. */
export class NotFoundError extends H3Error {}
/** A field out of range or malformed; `details` names it. */
export class InvalidArgumentError extends H3Error {}
/** The session has a request in flight, or the daemon lacks a configuration the call needs. */
export class FailedPreconditionError extends H3Error {}
/** Too many requests queued (see `retryAfterMs`), the KV tiers are full, or a message too large. */
export class ResourceExhaustedError extends H3Error {}
/** The daemon is draining, or cannot be reached. */
export class UnavailableError extends H3Error {}
/** The call's deadline (`deadlineMs`) passed before it ended. */
export class DeadlineExceededError extends H3Error {}
/** The call was cancelled (by the daemon, or by this client without an AbortSignal). */
export class CancelledError extends H3Error {}
/** The call was cancelled by this client's AbortSignal; `cause` is the signal's reason. */
export class AbortError extends CancelledError {}
/** No token, or one the daemon does not know. */
export class UnauthenticatedError extends H3Error {}
/** A client token calling an H3Admin RPC. */
export class PermissionDeniedError extends H3Error {}
/** Archived KV failed its checksum. */
export class DataLossError extends H3Error {}
/** A bug in the daemon (its log has the traceback). */
export class InternalError extends H3Error {}

type ErrorClass = new (code: Status, details: string, metadata?: Metadata, options?: ErrorOptions) => H3Error;

const CLASSES: Partial<Record<Status, ErrorClass>> = {
  [Status.NOT_FOUND]: NotFoundError,
  [Status.INVALID_ARGUMENT]: InvalidArgumentError,
  [Status.FAILED_PRECONDITION]: FailedPreconditionError,
  [Status.RESOURCE_EXHAUSTED]: ResourceExhaustedError,
  [Status.UNAVAILABLE]: UnavailableError,
  [Status.DEADLINE_EXCEEDED]: DeadlineExceededError,
  [Status.CANCELLED]: CancelledError,
  [Status.UNAUTHENTICATED]: UnauthenticatedError,
  [Status.PERMISSION_DENIED]: PermissionDeniedError,
  [Status.DATA_LOSS]: DataLossError,
  [Status.INTERNAL]: InternalError,
};

/**
 * The H3Error for what a grpc-js call failed with. A call cancelled because `signal` aborted is an
 * AbortError whatever the status says; anything that is not a gRPC status (a bug in this client, a
 * bad argument caught before sending) is returned unchanged.
 */
export function toH3Error(error: unknown, signal?: AbortSignal): unknown {
  if (error instanceof H3Error) {
    return error;
  }
  if (signal?.aborted) {
    return abortError(signal, isServiceError(error) ? error : undefined);
  }
  if (!isServiceError(error)) {
    return error;
  }
  const cls = CLASSES[error.code] ?? H3Error;
  return new cls(error.code, error.details, error.metadata ?? new Metadata(), { cause: error });
}

/** The error of a call that `signal` cancelled (or stopped before it started). */
export function abortError(signal: AbortSignal, error?: ServiceError): AbortError {
  const details = error?.details ?? "the call was aborted";
  return new AbortError(Status.CANCELLED, details, error?.metadata ?? new Metadata(), { cause: signal.reason });
}

function isServiceError(error: unknown): error is ServiceError {
  return error instanceof Error && typeof (error as Partial<ServiceError>).code === "number" && "details" in error;
}

function retryAfter(metadata: Metadata): number | undefined {
  const [value] = metadata.get(RETRY_AFTER_TRAILER);
  const ms = typeof value === "string" ? Number.parseInt(value, 10) : Number.NaN;
  return Number.isFinite(ms) ? ms : undefined;
}
