"""Every error a client can see, mapped to its gRPC status code and to its HTTP status (with the
OpenAI error object's `type` and `code`): the one place that decides.

Handlers raise `h3d.errors` classes (or the daemon's own below); the service wrapper (gRPC) and
the HTTP API's middleware turn them into a status with the error's message. Anything else is a
bug: logged with its traceback and answered INTERNAL (500) without details.
"""

from __future__ import annotations

import grpc

from h3d.errors import (
    ConfigError,
    ContextTooLong,
    Fenced,
    H3Error,
    Held,
    InvalidRequest,
    LogNotDurable,
    NoArchive,
    NoChatTemplate,
    NoRemoteTier,
    OutOfBlocks,
    RemoteError,
    SessionBusy,
    SessionNotFound,
    SsdDegraded,
)
from h3d.tiers.identity import ArchiveCorrupt


class Draining(H3Error):
    """The daemon is draining and takes no new work."""


class Overloaded(H3Error):
    """Too many requests are queued; the client should retry later."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unauthenticated(H3Error):
    """No token, or one the daemon does not know."""


class PermissionDenied(H3Error):
    """A client token calling an admin RPC."""


class MessageTooLarge(H3Error):
    """A request or response larger than `max_message_bytes`."""


class _Named(H3Error):
    """An error that may name the request's parameter it is about (`param`) and its own `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class NotFound(_Named):
    """A named thing (a model, a stored response, a route) that does not exist (gRPC NOT_FOUND, HTTP 404)."""


class Conflict(_Named):
    """A request that the state of what it names refuses (gRPC FAILED_PRECONDITION, HTTP 409)."""


class BadParam(InvalidRequest):
    """An HTTP request's parameter refused; `param` names it (the OpenAI error object's `param`)."""

    def __init__(self, param: str | None, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.code = code


# Most specific first: the first class an error is an instance of decides.
CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (ContextTooLong, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoArchive, grpc.StatusCode.FAILED_PRECONDITION),
    (NoChatTemplate, grpc.StatusCode.FAILED_PRECONDITION),
    (NoRemoteTier, grpc.StatusCode.FAILED_PRECONDITION),
    (OutOfBlocks, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MessageTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (SsdDegraded, grpc.StatusCode.UNAVAILABLE),
    (LogNotDurable, grpc.StatusCode.UNAVAILABLE),
    (Held, grpc.StatusCode.FAILED_PRECONDITION),
    (Fenced, grpc.StatusCode.ABORTED),
    (RemoteError, grpc.StatusCode.UNAVAILABLE),  # (unreachable, slow, full: a store that cannot take it now)
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ArchiveCorrupt, grpc.StatusCode.DATA_LOSS),
    (H3Error, grpc.StatusCode.INTERNAL),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    for cls, code in CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


# HTTP: (status, the OpenAI error object's `type`, its `code`). Most specific first, as CODES.
HTTP: tuple[tuple[type[BaseException], int, str, str | None], ...] = (
    (SessionNotFound, 404, "invalid_request_error", "not_found"),
    (NotFound, 404, "invalid_request_error", "not_found"),
    (SessionBusy, 409, "invalid_request_error", "conflict"),
    (Conflict, 409, "invalid_request_error", "conflict"),
    (ContextTooLong, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequest, 400, "invalid_request_error", None),
    (ConfigError, 400, "invalid_request_error", None),
    (NoChatTemplate, 400, "invalid_request_error", "no_chat_template"),
    (NoRemoteTier, 409, "invalid_request_error", "no_remote_tier"),
    (MessageTooLarge, 413, "invalid_request_error", "request_too_large"),
    (Overloaded, 429, "rate_limit_error", "overloaded"),
    (OutOfBlocks, 503, "server_error", "out_of_kv_blocks"),
    (NoArchive, 503, "server_error", "no_archive"),
    (Draining, 503, "server_error", "draining"),
    (SsdDegraded, 503, "server_error", "ssd_degraded"),
    (LogNotDurable, 503, "server_error", "log_not_durable"),
    (Held, 409, "invalid_request_error", "session_elsewhere"),
    (Fenced, 409, "invalid_request_error", "session_elsewhere"),
    (RemoteError, 503, "server_error", "remote_unavailable"),
    (Unauthenticated, 401, "authentication_error", "invalid_api_key"),
    (PermissionDenied, 403, "permission_error", "permission_denied"),
    (ArchiveCorrupt, 500, "server_error", "data_loss"),
    (H3Error, 500, "server_error", "internal_error"),
)


def http_status_of(error: BaseException) -> tuple[int, str, str | None]:
    """(HTTP status, error type, error code) of `error`; one that names its own code gives it."""
    for cls, status, kind, code in HTTP:
        if isinstance(error, cls):
            if isinstance(error, BadParam | _Named) and error.code:
                code = error.code
            return status, kind, code
    return 500, "server_error", "internal_error"
