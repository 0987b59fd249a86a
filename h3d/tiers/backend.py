"""The tiers below DDR, behind one small interface.

A cold tier holds archived KV blocks by key (`BlockKey`: session, layer, block index), each a
record of the block's K and V that comes back bit for bit (or within its codec's stated error),
and refuses what it cannot vouch for (`ArchiveCorrupt`). The SSD archive (`h3d.tiers.archive`)
is the first; a remote store shared by several daemons is the next. LMCache's storage backend is
the model: contains / put / get / remove / close, with the durability rule stated on `put`, and
`link` for a block several sessions share.

The tier manager (`h3d.tiers.manager`), the mover (`h3d.tiers.mover`) and a session's lifecycle
(`h3d.tiers.lifecycle`) use a cold tier only through this interface. What a tier keeps is decided
above it: which blocks are written (spill past `ddr_high_watermark`, snapshots), which are
forgotten (closed sessions past `ssd_capacity_mb`), and which sessions are pinned (the KV cache's
`SessionKV.pinned_until`): a tier evicts nothing on its own, so it has no pins of its own.

What must stay true of every implementation: a block is durable when `put` returns (a DDR copy
is dropped only after that), and nothing else is; `contains` and `blocks_of` say what a `get`
would return; a failed write raises `ArchiveWriteFailed` and leaves what was durable before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from h3d.tiers.codecs import Codec
from h3d.tiers.identity import BlockKey

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12


class ColdTier(Protocol):
    def contains(self, key: BlockKey) -> bool:
        """Whether a durable record of `key` is held."""
        ...

    def put(self, items: list[tuple[BlockKey, torch.Tensor, torch.Tensor]]) -> None:
        """Store blocks ((key, k [Hkv, n, D], v [Hkv, n, D]) each), durably when it returns;
        a record of the same key is replaced. Raises `ArchiveWriteFailed`."""
        ...

    def put_blocks(
        self, session: str, layers: np.ndarray, indices: np.ndarray, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[Codec, Buffer]]:
        """`put` of whole blocks of one session in bulk: block i is (`layers[i]`, `indices[i]`),
        k[:, i], v[:, i] of k, v [Hkv, n, block_size, D] (write-behind's path). Durable when it
        returns, which gives the records' codec and payload each; raises `ArchiveWriteFailed`."""
        ...

    def get(self, key: BlockKey) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's (k, v), each [Hkv, n, D]. Raises `ArchiveCorrupt` for a damaged or missing
        record."""
        ...

    def get_bytes(self, keys: list[BlockKey]) -> list[tuple[int, Buffer]]:
        """The blocks' bytes (tokens, K then V of the tier's dtype), lossy records decoded, as
        `get` would give them; many at once. Raises `ArchiveCorrupt` or KeyError like `get`."""
        ...

    def blocks_of(self, session: str) -> dict[tuple[int, int], int]:
        """The session's held blocks: (layer, index) -> tokens in the record."""
        ...

    def link(self, session: str, source: str, blocks: list[tuple[int, int]]) -> int:
        """Give `session` the records `source` holds for `blocks` ((layer, index) pairs), durably
        and without storing them again (a block several sessions share is held once); a record
        stays while any session's key points at it. Returns the blocks linked (those `source`
        lacks are skipped); raises `ArchiveWriteFailed`."""
        ...

    def remove(self, session: str, first: int = 0) -> int:
        """Forget every block of `session` (those of index `first` and later), durably; returns
        the records dropped."""
        ...

    def stored_bytes(self) -> int:
        """Bytes the held records take in the tier (as stored: compressed)."""
        ...

    def live_bytes(self) -> int:
        """Bytes of the records the tier holds now (what its capacity counts)."""
        ...

    def recover(self) -> None:
        """After a failed write: back to the last durable state, taking writes again."""
        ...

    def close(self) -> None:
        """Finish and release (what is durable stays)."""
        ...
