"""The connection to the daemon: the channel and stubs (`Client`), the files the user names, and the
two errors that commands raise instead of printing.

- `connect` reads the global options: `--socket` (default `$H3D_SOCKET`, else /run/h3d/h3d.sock) or
  `--address` (TLS with `--tls-ca`), `--token-file`, `--timeout`.
- Every unary call goes through `Client.call` (the bearer token, the deadline); streams through
  `Client.stream` (the token, no deadline).
- A file that cannot be read (token, CA, `append --file`) is a `UsageError` (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2_grpc

from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

DEFAULT_SOCKET = "/run/h3d/h3d.sock"
SOCKET_ENV = "H3D_SOCKET"


class UsageError(Exception):
    """A usage problem found after parsing (a bad file, conflicting options, an ambiguous id): exit 2."""


class NoSuchSession(Exception):
    """No session has the id (or id prefix) given: reported as NOT_FOUND, exit 1."""


class Client:
    """One channel to the daemon, the stubs over it, and what every call carries."""

    def __init__(self, target: str, channel: grpc.Channel, token: str | None, timeout: float) -> None:
        self.target = target
        self.channel = channel
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.h3 = rpc.H3Stub(channel)
        self.admin = rpc.H3AdminStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def call(
        self, method: Callable[..., Any], request: Message, timeout: float | None = None, unbounded: bool = False
    ) -> Any:
        """A unary call with the token and a deadline: `timeout`, else `--timeout`; none if `unbounded`."""
        deadline = None if unbounded else (timeout if timeout is not None else self.timeout)
        return method(request, timeout=deadline, metadata=self.metadata)

    def stream(self, method: Callable[..., Any], request: Message) -> Any:
        """A server-streaming call (no deadline); iterate it, `.cancel()` it."""
        return method(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()  # cancels the calls still in flight


def read_token(path: str) -> str:
    """The first non-blank line of the file that is not a `#` comment."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the token file {path}: {_reason(exc)}") from None
    for line in lines:
        token = line.strip()
        if token and not token.startswith("#"):
            return token
    raise UsageError(f"the token file {path} holds no token")


def read_text(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {_reason(exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def connect(args: argparse.Namespace) -> Client:
    if args.socket is not None and args.address is not None:
        raise UsageError("give --socket or --address, not both")
    if args.tls_ca is not None and args.address is None:
        raise UsageError("--tls-ca needs --address (the Unix socket has no TLS)")
    token = read_token(args.token_file) if args.token_file is not None else None
    if args.address is not None:
        target = args.address
        if args.tls_ca is not None:
            try:
                ca = Path(args.tls_ca).read_bytes()
            except OSError as exc:
                raise UsageError(f"cannot read the CA file {args.tls_ca}: {_reason(exc)}") from None
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca))
        else:
            channel = grpc.insecure_channel(target)
    else:
        path = args.socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        target = f"unix:{path}"
        channel = grpc.insecure_channel(target)
    return Client(target, channel, token, args.timeout)
