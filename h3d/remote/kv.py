"""A session's KV blocks carried through the remote store: written by the daemon that gives a
session up, read by the one that takes it over, so that its first token does not wait for its
context to be computed again.

A block is keyed by its content: the layer and a hash chain over the tokens of the session's
blocks up to it (`digests`: sha256 of the previous block's digest and this block's token ids),
under the store's namespace (the model) and the cache's layout (dtype, block size, KV heads, head
dimension). Two sessions whose contexts begin alike (a fork) have the same keys for those blocks,
which the store holds once. A value is the archive's record payload as its codec wrote it (never
decoded on the way), with its codec, token count and crc32 (`pack`): a value that fails its check
is not used (the block is computed again). Values expire `ttl_s` after they were last written: the
store's sweep of the blocks no session needs (a daemon gives a session up, or stops, and renews
the blocks the store has of it, writing only those it lacks).

Blocks reach the store two ways: as write-behind archives them (`h3d.remote.copyup`, so that a
daemon killed leaves its sessions' archived KV in the store), and when a daemon gives a session up
or stops (`outgoing`: what the store lacks of it).

A session handed over (or a daemon stopping) also writes its partial last block: the KV of the
tokens past its last whole block, but for the last token (which the next request feeds), keyed
by the chain of its whole blocks and then those tokens (`tail_digest`), so that the daemon that
takes it over holds every token's KV its giver held and its first request is a decode step that
reads its selection, not a prompt's exact prefill of those tokens over every block (on a GPU
that read a 32K session's 4.3 GB back from the archive: docs/BENCHMARKS.md). Write-behind copies
whole blocks only (a partial block changes with every token).

What must stay true: a block is read into the archive only under the session whose tokens give
its key (the chain covers every token before it, a partial block's key its own tokens too), and
only blocks of the tokens taken over travel.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from h3d.tiers.archive import Archive
from h3d.tiers.codecs import CODEC_IDS, CODECS_BY_ID, Codec
from h3d.tiers.identity import BlockKey, CacheIdentity

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"H3KV"
_HEAD = struct.Struct("<4sBII")  # magic, codec id, tokens, crc32 of the payload


def _next(prev: bytes, ids: Sequence[int]) -> bytes:
    return hashlib.sha256(prev + np.asarray(ids, dtype="<u4").tobytes()).digest()


def _chain(tokens: Sequence[int], block_size: int, blocks: int) -> tuple[bytes, list[str]]:
    out, prev = [], b""
    for j in range(blocks):
        prev = _next(prev, tokens[j * block_size : (j + 1) * block_size])
        out.append(prev.hex()[:32])
    return prev, out


def digests(tokens: Sequence[int], block_size: int, blocks: int) -> list[str]:
    """The hash chain of the first `blocks` whole blocks of `tokens`."""
    return _chain(tokens, block_size, blocks)[1]


def tail_digest(tokens: Sequence[int], block_size: int) -> str | None:
    """The key of the partial block `tokens` end with (None: they end on a whole block): the chain
    of their whole blocks, then the partial block's tokens, marked apart from a whole block's."""
    full = len(tokens) // block_size
    if len(tokens) == full * block_size:
        return None
    return _tail(_chain(tokens, block_size, full)[0], tokens[full * block_size :])


def _tail(prev: bytes, rest: Sequence[int]) -> str:
    return hashlib.sha256(b"tail" + prev + np.asarray(rest, dtype="<u4").tobytes()).hexdigest()[:32]


class Chains:
    """Each session's `digests`, extended as its tokens grow (each block hashed once); a session
    whose tokens were cut (a rewind) or that is gone is `forget`-ten. Owned by one thread."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._chains: dict[str, tuple[bytes, list[str]]] = {}

    def of(self, name: str, tokens: Sequence[int], blocks: int) -> list[str]:
        """The digests of `name`'s first `blocks` whole blocks (fewer if `tokens` has fewer)."""
        prev, out = self._chains.get(name, (b"", []))
        bs = self.block_size
        for j in range(len(out), min(blocks, len(tokens) // bs)):
            prev = _next(prev, tokens[j * bs : (j + 1) * bs])
            out.append(prev.hex()[:32])
        self._chains[name] = (prev, out)
        return out[:blocks]

    def forget(self, name: str) -> None:
        self._chains.pop(name, None)


def layout(identity: CacheIdentity) -> str:
    return f"{identity.dtype}.{identity.block_size}.{identity.num_kv_heads}.{identity.head_dim}"


def pack(tokens: int, codec: Codec, payload: Buffer) -> bytes:
    return b"".join((_HEAD.pack(MAGIC, CODEC_IDS[codec], tokens, zlib.crc32(payload)), payload))


def unpack(value: bytes) -> tuple[int, Codec, bytes] | None:
    """(tokens, codec, payload), or None for a value that is not one (or fails its crc)."""
    if len(value) < _HEAD.size:
        return None
    magic, codec_id, tokens, crc = _HEAD.unpack_from(value)
    payload = value[_HEAD.size :]
    codec = CODECS_BY_ID.get(codec_id)
    if magic != MAGIC or codec is None or zlib.crc32(payload) != crc:
        return None
    return tokens, codec, payload


def outgoing(
    archive: Archive,
    name: str,
    tokens: Sequence[int],
    lacks: Callable[[list[tuple[int, str]]], list[bool]] | None = None,
) -> list[tuple[int, str, bytes]]:
    """The blocks `name` has in `archive` of `tokens` but their last (which the next request
    feeds), whole and the partial last one, as (layer, digest, value) to write to the store; with
    `lacks` (which of these (layer, digest) the store lacks), only those."""
    bs = archive.identity.block_size
    kv = tokens[: max(len(tokens) - 1, 0)]
    key, sizes = _keys(kv, bs), _sizes(kv, bs)
    held = sorted((layer, j) for (layer, j), n in archive.blocks_of(name).items() if j < len(sizes) and sizes[j] == n)
    if held and lacks is not None:
        held = [h for h, lacking in zip(held, lacks([(layer, key[j]) for layer, j in held]), strict=True) if lacking]
    if not held:
        return []
    records = archive.get_records([BlockKey(name, layer, j) for layer, j in held])
    return [
        (layer, key[j], pack(n, codec, payload)) for (layer, j), (n, codec, payload) in zip(held, records, strict=True)
    ]


def incoming(archive: Archive, name: str, tokens: Sequence[int], layers: int, values: list[bytes | None]) -> int:
    """Archive under `name` the blocks the store gave (`values`: one per (layer, block) of
    `wanted(...)`'s order, None where it had none). Returns the blocks archived."""
    bs = archive.identity.block_size
    sizes = _sizes(tokens, bs)
    items = []
    for i, value in enumerate(values):
        got = unpack(value) if value is not None else None
        layer, j = divmod(i, len(sizes))
        if got is None or got[0] != sizes[j]:
            continue
        if not (got[1] is archive.codec_for(layer) or got[1].lossless):
            continue
        items.append((BlockKey(name, layer, j), got[0], got[1], got[2]))
    if items:
        archive.put_records(items)
    return len(items)


def _sizes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The token count of each block of `tokens`, the partial last one's included."""
    full, rest = divmod(len(tokens), block_size)
    return [block_size] * full + ([rest] if rest else [])


def wanted(identity: CacheIdentity, tokens: Sequence[int], layers: int) -> list[tuple[int, str]]:
    """(layer, digest) of every block of `tokens` (the KV taken over: the partial last one's too)
    in every layer, layer-major."""
    keys = _keys(tokens, identity.block_size)
    return [(layer, d) for layer in range(layers) for d in keys]


def _keys(tokens: Sequence[int], block_size: int) -> list[str]:
    """The key of each block of `tokens`: the whole ones' chain, then the partial last one's."""
    full = len(tokens) // block_size
    prev, chain = _chain(tokens, block_size, full)  # (once: the tail's key goes on from it)
    return chain + ([_tail(prev, tokens[full * block_size :])] if len(tokens) > full * block_size else [])
