"""Bearer tokens: who is calling, and whether they may call H3Admin.

- No `auth_token_file`: every caller that reaches the socket is the one client `local`.
- With one: each call needs `authorization: Bearer <token>` with a listed token (or an admin
  token); its owner id is a hash of the token, so sessions are private per token.
- With an `admin_token_file`, H3Admin calls need one of its tokens (admins see every session).
Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from h3d.daemon.config import DaemonConfig, read_tokens
from h3d.daemon.status import PermissionDenied, Unauthenticated

LOCAL = "local"


@dataclass(frozen=True, slots=True)
class Caller:
    owner: str  # the id sessions are keyed by
    admin: bool


class Auth:
    def __init__(self, config: DaemonConfig) -> None:
        self.clients: list[str] | None = None
        self.admins: list[str] | None = None
        self.reload(config)

    def reload(self, config: DaemonConfig) -> None:
        self.clients = read_tokens(config.auth_token_file) if config.auth_token_file else None
        self.admins = read_tokens(config.admin_token_file) if config.admin_token_file else None

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, admin_call: bool) -> Caller:
        token = _bearer(metadata)
        is_admin = token is not None and self.admins is not None and _known(token, self.admins)
        if admin_call and self.admins is not None and not is_admin:
            if token is None:
                raise Unauthenticated("this call needs the admin token (authorization: Bearer <token>)")
            raise PermissionDenied("this call needs the admin token")
        if self.clients is None:
            return Caller(LOCAL, admin=admin_call or is_admin)
        if token is None:
            raise Unauthenticated("missing token: send the metadata `authorization: Bearer <token>`")
        if not (is_admin or _known(token, self.clients)):
            raise Unauthenticated("unknown token")
        return Caller(hashlib.sha256(token.encode()).hexdigest()[:16], admin=admin_call or is_admin)


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _known(token: str, tokens: list[str]) -> bool:
    found = False
    for t in tokens:  # no early exit: the time taken does not depend on which token matched
        found |= hmac.compare_digest(token.encode(), t.encode())
    return found
