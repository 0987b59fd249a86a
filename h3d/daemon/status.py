"""Every error a client can see, mapped to its gRPC status code: the one place that decides.

Handlers raise `h3d.errors` classes (or the daemon's own below); the service wrapper turns them
into a status with the error's message. Anything else is a bug: logged with its traceback and
answered INTERNAL without details.
"""

from __future__ import annotations

import grpc

from h3d.errors import (
    ConfigError,
    ContextTooLong,
    H3Error,
    InvalidRequest,
    LogNotDurable,
    NoArchive,
    NoChatTemplate,
    OutOfBlocks,
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


# Most specific first: the first class an error is an instance of decides.
CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (ContextTooLong, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoArchive, grpc.StatusCode.FAILED_PRECONDITION),
    (NoChatTemplate, grpc.StatusCode.FAILED_PRECONDITION),
    (OutOfBlocks, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MessageTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (SsdDegraded, grpc.StatusCode.UNAVAILABLE),
    (LogNotDurable, grpc.StatusCode.UNAVAILABLE),
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
