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
store's sweep of the blocks no session needs (a daemon gives a session up, or stops, and writes
its blocks again, which renews them).

What must stay true: a block is read into the archive only under the session whose tokens give
its key (the chain covers every token before it), and only whole blocks travel.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import numpy as np

from h3d.tiers.archive import Archive
from h3d.tiers.codecs import CODEC_IDS, CODECS_BY_ID, Codec
from h3d.tiers.identity import BlockKey, CacheIdentity

MAGIC = b"H3KV"
_HEAD = struct.Struct("<4sBII")  # magic, codec id, tokens, crc32 of the payload


def digests(tokens: Sequence[int], block_size: int, blocks: int) -> list[str]:
    """The hash chain of the first `blocks` whole blocks of `tokens`."""
    out, prev = [], b""
    for j in range(blocks):
        ids = np.asarray(tokens[j * block_size : (j + 1) * block_size], dtype="<u4").tobytes()
        prev = hashlib.sha256(prev + ids).digest()
        out.append(prev.hex()[:32])
    return out


def layout(identity: CacheIdentity) -> str:
    return f"{identity.dtype}.{identity.block_size}.{identity.num_kv_heads}.{identity.head_dim}"


def pack(tokens: int, codec: Codec, payload: bytes) -> bytes:
    return _HEAD.pack(MAGIC, CODEC_IDS[codec], tokens, zlib.crc32(payload)) + payload


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


def outgoing(archive: Archive, name: str, tokens: Sequence[int]) -> list[tuple[int, str, bytes]]:
    """The whole blocks `name` has in `archive`, as (layer, digest, value) to write to the store."""
    bs = archive.identity.block_size
    full = len(tokens) // bs
    held = sorted((layer, j) for (layer, j), n in archive.blocks_of(name).items() if n == bs and j < full)
    if not held:
        return []
    chain = digests(tokens, bs, full)
    records = archive.get_records([BlockKey(name, layer, j) for layer, j in held])
    return [
        (layer, chain[j], pack(n, codec, payload))
        for (layer, j), (n, codec, payload) in zip(held, records, strict=True)
    ]


def incoming(archive: Archive, name: str, tokens: Sequence[int], layers: int, values: list[bytes | None]) -> int:
    """Archive under `name` the blocks the store gave (`values`: one per (layer, block) of
    `wanted(...)`'s order, None where it had none). Returns the blocks archived."""
    bs = archive.identity.block_size
    full = len(tokens) // bs
    items = []
    for i, value in enumerate(values):
        got = unpack(value) if value is not None else None
        if got is None or got[0] != bs:
            continue
        layer, j = divmod(i, full)
        if not (got[1] is archive.codec_for(layer) or got[1].lossless):
            continue
        items.append((BlockKey(name, layer, j), bs, got[1], got[2]))
    if items:
        archive.put_records(items)
    return len(items)


def wanted(identity: CacheIdentity, tokens: Sequence[int], layers: int) -> list[tuple[int, str]]:
    """(layer, digest) of every whole block of `tokens` in every layer, layer-major."""
    bs = identity.block_size
    chain = digests(tokens, bs, len(tokens) // bs)
    return [(layer, d) for layer in range(layers) for d in chain]
