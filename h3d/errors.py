"""The errors h3d raises on purpose. Each says what went wrong in words a user can act on.

The daemon maps these classes to gRPC status codes in one place; the CLI prints their message and
exits non-zero. Anything else that escapes is a bug.
"""


class H3Error(Exception):
    """Base class: an expected failure with a message meant for the user."""


class ConfigError(H3Error):
    """A configuration key has a bad value; the message names the key and the reason."""


class ModelLoadError(H3Error):
    """A model folder is missing files, or holds an architecture h3d does not support."""


class InvalidRequest(H3Error):
    """A request's arguments are out of range or inconsistent (maps to INVALID_ARGUMENT)."""


class SessionNotFound(H3Error):
    """No session has that id (maps to NOT_FOUND)."""


class ContextTooLong(InvalidRequest):
    """The session's context would pass `max_context_tokens`."""


class OutOfBlocks(H3Error):
    """The KV pool has no free slot left for the request (maps to RESOURCE_EXHAUSTED)."""


class TiersFull(OutOfBlocks):
    """HBM, DDR and the archive (within `ssd_capacity_mb`) together cannot hold the sessions' KV
    with the request's: the engine forgets cold KV (the prefix cache's, closed sessions') first."""


class NoArchive(H3Error):
    """The operation needs the SSD archive and none is configured (maps to FAILED_PRECONDITION)."""


class SsdDegraded(H3Error):
    """The SSD tier takes no writes now (a full disk, an I/O error); it is tried again every
    `ssd_retry_interval_s` (maps to UNAVAILABLE)."""


class LogNotDurable(H3Error):
    """A session's token log could not be fsynced (an I/O error): its latest tokens were streamed
    but may be lost in a crash (maps to UNAVAILABLE)."""


class NoChatTemplate(H3Error):
    """A chat session was asked of a model without a chat template (maps to FAILED_PRECONDITION)."""


class SessionBusy(InvalidRequest):
    """The session already has a request in flight (maps to FAILED_PRECONDITION)."""


def clip(text: str, limit: int = 64) -> str:
    """`text` cut to `limit` characters, for messages and logs: a client's input is never echoed
    whole (a 1 MB session id would not fit in a status message)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RemoteError(H3Error):
    """The remote tier's store cannot do what was asked (`h3d.remote`)."""


class RemoteUnavailable(RemoteError):
    """The remote store did not answer within `remote_timeout_s`, or refused the connection (maps
    to UNAVAILABLE)."""


class KVNoRoom(RemoteError):
    """The remote store is too full to take KV blocks (`KV_MAX_FILL` of its maxmemory): its room is
    kept for the token logs; the KV is computed again by whoever needs it."""


class NotDurable(RemoteError):
    """The remote store does not persist every write before acknowledging it (`remote_log = sync` needs it)."""


class Fenced(RemoteError):
    """A write by a daemon whose lease on the session is gone (expired, or taken by another:
    `lease_gone`), or whose log in the store is not what this daemon wrote (another wrote it)."""

    def __init__(self, message: str, lease_gone: bool = False) -> None:
        super().__init__(message)
        self.lease_gone = lease_gone


class Held(RemoteError):
    """The session is served by another daemon of the remote store (`holder`: its `<owner> <token>`;
    maps to FAILED_PRECONDITION)."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


class NoRemoteTier(H3Error):
    """What was asked needs the remote tier (`remote_url`), which is off (maps to FAILED_PRECONDITION)."""
