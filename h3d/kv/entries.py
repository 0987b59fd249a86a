"""Block entries: the metadata of every KV block, one entry per block of one layer.

A session's `BlockTable` points to entries by id (`BlockTable.ids`, [layers, blocks]); an entry
holds where the block's bytes are (its HBM slot, its DDR slot, whether a durable archive copy
exists), its hotness for HBF promotion, the step it was last staged from the archive at, and how
many tables point to it. The archive key of a block follows from the position it has in a
session's table (session name, layer, index); `home` says whose name keys its archive record.
Entries are arrays indexed by id, so that a step's reads and moves over many blocks are a few
vectorized gathers and scatters.

Several tables point to one entry where sessions share a prefix (a fork, a prefix reused: the
same block index in each, `BlockManager.share`): its copies are then read by all of them.

Entry 0 (`NULL_ENTRY`) is no block: in no tier, never written. Table columns past a session's
blocks point to it.

Owner: `h3d.kv.blocks.BlockManager` allocates and releases entries and writes their residency;
`h3d.tiers.promotion.Promoter` writes their hotness. What must stay true (checked by
`BlockManager.check_invariants`): an entry is free exactly when no table points to it, and its
reference count is the number of table cells that point to it; a free entry is in no tier and
has no hotness.
"""

from __future__ import annotations

import numpy as np

NONE = -1
NULL_ENTRY = 0


class Entries:
    def __init__(self, capacity: int = 1024) -> None:
        capacity = max(2, capacity)
        self.hbm = np.full(capacity, NONE, dtype=np.int64)  # [E] HBM slot or NONE
        self.ddr = np.full(capacity, NONE, dtype=np.int64)  # [E] DDR slot or NONE
        self.archived = np.zeros(capacity, dtype=bool)  # [E] a durable archive copy exists
        self.num_archived = 0  # entries with `archived` set (none: no block is in the archive only)
        self.hotness = np.zeros(capacity, dtype=np.float32)  # [E] `Promoter.rank`'s value
        self.refs = np.zeros(capacity, dtype=np.int32)  # [E] table cells pointing to it
        self.staged_at = np.full(capacity, -1, dtype=np.int64)  # [E] the step it last came from the archive
        self.home = np.full(capacity, NONE, dtype=np.int64)  # [E] the session whose archive record `archived` is
        # Free ids as a stack, lowest on top (entry 0 is never handed out).
        self._stack = np.arange(capacity - 1, 0, -1, dtype=np.int64)
        self._top = capacity - 1

    @property
    def capacity(self) -> int:
        return len(self.hbm)

    @property
    def num_used(self) -> int:
        """Entries that tables point to."""
        return self.capacity - 1 - self._top

    def allocate(self, n: int) -> np.ndarray:
        """`n` new entries ([n] ids), each in no tier, pointed to once."""
        if n > self._top:
            self._grow(self.capacity - 1 - self._top + n)
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self.refs[ids] = 1
        return ids

    def release(self, ids: np.ndarray) -> None:
        """One reference fewer to each of `ids` (the null entry ignored); an entry no table points
        to any more is reset and free again. Its slots are the caller's to give back first."""
        ids = ids[ids > NULL_ENTRY]
        if not len(ids):
            return
        np.subtract.at(self.refs, ids, 1)
        gone = ids[self.refs[ids] == 0]
        gone = np.unique(gone)
        self.num_archived -= int(np.count_nonzero(self.archived[gone]))
        self.hbm[gone] = NONE
        self.ddr[gone] = NONE
        self.archived[gone] = False
        self.hotness[gone] = 0.0
        self.staged_at[gone] = -1
        self.home[gone] = NONE
        self._stack[self._top : self._top + len(gone)] = gone[::-1]
        self._top += len(gone)

    def free_ids(self) -> np.ndarray:
        return self._stack[: self._top]

    def _grow(self, used: int) -> None:
        old = self.capacity
        new = max(2 * old, used + 1)
        fills = {"hbm": NONE, "ddr": NONE, "archived": False, "hotness": 0.0, "refs": 0, "staged_at": -1, "home": NONE}
        for name, fill in fills.items():
            arr = getattr(self, name)
            grown = np.full(new, fill, dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        stack = np.empty(new - 1, dtype=np.int64)
        fresh = np.arange(new - 1, old - 1, -1, dtype=np.int64)  # the new ids, lowest last
        stack[: len(fresh)] = fresh
        stack[len(fresh) : len(fresh) + self._top] = self._stack[: self._top]
        self._stack = stack
        self._top += len(fresh)
