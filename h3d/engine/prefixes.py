"""Which sessions hold KV for which token prefixes: a hash chain over each session's full blocks.

A block's hash covers the previous block's hash and the block's tokens, from a root that is the
sharing scope (`share_prefixes`: the session's owner, so that one tenant's prompts cannot be probed
by another's timing, or one scope for all), as vLLM's prefix cache keys blocks: two sessions whose
chains agree on their first n hashes hold the same first n blocks of tokens, and so the same KV for
them. A new session's first request asks `longest` for the session whose KV covers most of its
tokens, and copies that KV (`Engine`, `KVCache.fork`) instead of computing it.

Chains are extended lazily, block by block, as sessions grow (`refresh`: only blocks not hashed
yet); a session whose tokens were cut (a rewind) is forgotten and hashed again (`forget`). Pure
Python (hashlib), owned by the engine's thread.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

SCOPES = ("owner", "all", "off")


def _hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).digest()


def root(scope: str) -> bytes:
    """The chain's first parent: the sharing scope (an owner, or "" for all)."""
    return hashlib.blake2b(b"h3d-prefix\0" + scope.encode(), digest_size=16).digest()


@dataclass(slots=True)
class _Chain:
    scope: str
    hashes: list[bytes] = field(default_factory=list)  # of the session's first full blocks


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[str, _Chain] = {}
        self._where: dict[bytes, set[str]] = {}  # block hash -> sessions whose chains hold it

    def refresh(self, key: str, scope: str, tokens: list[int]) -> None:
        """Hash `key`'s full blocks of `tokens` not hashed yet (its tokens only grew since)."""
        chain = self._chains.get(key)
        if chain is None or chain.scope != scope:
            self.forget(key)
            chain = self._chains[key] = _Chain(scope)
        bs = self.block_size
        for j in range(len(chain.hashes), len(tokens) // bs):
            h = _hash(chain.hashes[-1] if chain.hashes else root(scope), tokens[j * bs : (j + 1) * bs])
            chain.hashes.append(h)
            self._where.setdefault(h, set()).add(key)

    def forget(self, key: str) -> None:
        chain = self._chains.pop(key, None)
        for h in chain.hashes if chain is not None else ():
            holders = self._where.get(h)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._where[h]

    def longest(self, scope: str, tokens: list[int], exclude: str = "") -> dict[str, int]:
        """The sessions of `scope` whose chains begin with the full blocks of `tokens`: each with
        the number of leading blocks it shares (only those sharing the most), `exclude` left out."""
        bs = self.block_size
        parent, found = root(scope), {}
        for j in range(len(tokens) // bs):
            parent = _hash(parent, tokens[j * bs : (j + 1) * bs])
            holders = self._where.get(parent, set()) - {exclude}
            if not holders:
                break
            found = dict.fromkeys(holders, j + 1)
        return found

    def __len__(self) -> int:
        return len(self._chains)
