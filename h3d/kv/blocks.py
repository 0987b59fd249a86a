"""Block bookkeeping: which pool slot holds which block of which session and layer.

Pure Python/NumPy, no torch: the tier and scheduler logic built on it is unit-testable on any host.
A *block* is `block_size` tokens of one layer's K and V; its bytes live in a pool slot
(`h3d.kv.pool.KVPool`). Slot `NULL_SLOT` is reserved and never handed out: it stays zero and pads
block tables, so a padded gather reads finite zeros.

Each layer has its own region of slots and its own free list: a layer's budget is fixed, and a
session's blocks of one layer tend to sit in consecutive slots, which lets attention read long runs
of blocks in place instead of gathering them.

Owner: `BlockManager` is the only writer of the free lists, the slot owners and the block tables.
What must stay true (checked by `BlockManager.check_invariants`):
- no slot is owned twice, and free + used = capacity;
- a table points only at slots owned by its session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

import numpy as np

from h3d.errors import OutOfBlocks

SeqId = NewType("SeqId", int)
NULL_SLOT = 0
_FREE = -1


class SlotAllocator:
    """Free list over the slots [first, first + capacity) of one pool. Owner: BlockManager.

    `owner` is shared by every allocator of a pool (indexed by global slot id).
    """

    def __init__(self, first: int, capacity: int, owner: np.ndarray) -> None:
        self.capacity = capacity
        # Lowest slots first: a lone session gets ascending, contiguous slots.
        self._free: list[int] = list(range(first + capacity - 1, first - 1, -1))
        self.owner = owner

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: SeqId) -> np.ndarray:
        if n > len(self._free):
            raise OutOfBlocks(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        slots = np.array([self._free.pop() for _ in range(n)], dtype=np.int64)
        self.owner[slots] = owner
        return slots

    def release(self, slots: np.ndarray) -> None:
        slots = slots[slots != NULL_SLOT]
        self.owner[slots] = _FREE
        self._free.extend(int(s) for s in slots[::-1])


@dataclass(slots=True)
class BlockTable:
    """One session's slots, per layer: `slots[layer, j]` holds tokens [j*bs, (j+1)*bs).

    `num_tokens` is the number of tokens whose KV is written; the last block may be partly filled.
    """

    slots: np.ndarray  # [L, capacity] int64, NULL_SLOT past num_blocks
    num_blocks: int = 0
    num_tokens: int = 0
    runs_cache: tuple[int, list[list[tuple[int, int]]]] | None = None  # (num_blocks, runs)

    def active(self) -> np.ndarray:
        return self.slots[:, : self.num_blocks]  # [L, num_blocks]


class BlockManager:
    """Allocates blocks for sessions' tokens and maps token positions to pool rows."""

    def __init__(self, slots_per_layer: int, num_layers: int, block_size: int) -> None:
        if slots_per_layer < 1:
            raise ValueError("the KV pool needs at least one slot per layer")
        self.owner = np.full(1 + slots_per_layer * num_layers, _FREE, dtype=np.int64)  # [num_slots]
        self.allocators = [
            SlotAllocator(1 + layer * slots_per_layer, slots_per_layer, self.owner) for layer in range(num_layers)
        ]
        self.slots_per_layer = slots_per_layer
        self.num_layers = num_layers
        self.block_size = block_size
        self._tables: dict[SeqId, BlockTable] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq: SeqId) -> bool:
        return seq in self._tables

    def table(self, seq: SeqId) -> BlockTable:
        return self._tables[seq]

    def allocate(self, seq: SeqId) -> BlockTable:
        """Open an empty table for `seq`."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq} already has a block table")
        table = BlockTable(slots=np.full((self.num_layers, 4), NULL_SLOT, dtype=np.int64))
        self._tables[seq] = table
        return table

    @property
    def num_slots(self) -> int:
        return len(self.owner)

    @property
    def num_free(self) -> int:
        """Free slots per layer (every layer holds the same number of blocks per session)."""
        return min(a.num_free for a in self.allocators)

    def blocks_needed(self, seq: SeqId, n_tokens: int) -> int:
        """New blocks per layer that `n_tokens` more tokens of `seq` take."""
        table = self._tables[seq]
        return self.blocks_for(table.num_tokens + n_tokens) - table.num_blocks

    def can_append(self, seq: SeqId, n_tokens: int) -> bool:
        return self.blocks_needed(seq, n_tokens) <= self.num_free

    def append(self, seq: SeqId, n_tokens: int) -> np.ndarray:
        """Reserve room for `n_tokens` more tokens; returns their pool rows, [L, n_tokens].

        A row is `slot * block_size + offset`: where the token's K/V go in a pool viewed as
        [num_slots * block_size, kv_heads, head_dim].
        """
        table = self._tables[seq]
        start, end = table.num_tokens, table.num_tokens + n_tokens
        new_blocks = self.blocks_for(end) - table.num_blocks
        if new_blocks > 0:
            if new_blocks > self.num_free:
                raise OutOfBlocks(f"KV pool exhausted: need {new_blocks} blocks per layer, {self.num_free} free")
            self._grow(table, table.num_blocks + new_blocks)
            for layer, alloc in enumerate(self.allocators):
                table.slots[layer, table.num_blocks : table.num_blocks + new_blocks] = alloc.allocate(new_blocks, seq)
            table.num_blocks += new_blocks
        table.num_tokens = end
        positions = np.arange(start, end, dtype=np.int64)  # [n]
        block_slots = table.slots[:, positions // self.block_size]  # [L, n]
        return block_slots * self.block_size + positions % self.block_size

    def free(self, seq: SeqId) -> None:
        table = self._tables.pop(seq, None)
        if table is not None:
            for layer, alloc in enumerate(self.allocators):
                alloc.release(table.slots[layer, : table.num_blocks])

    def _grow(self, table: BlockTable, blocks: int) -> None:
        cap = table.slots.shape[1]
        if blocks <= cap:
            return
        grown = np.full((self.num_layers, max(blocks, 2 * cap)), NULL_SLOT, dtype=np.int64)
        grown[:, :cap] = table.slots
        table.slots = grown

    def runs(self, seq: SeqId) -> list[list[tuple[int, int]]]:
        """Per layer, the session's blocks as maximal runs of consecutive slots: (first slot, count)."""
        table = self._tables[seq]
        if table.runs_cache is not None and table.runs_cache[0] == table.num_blocks:
            return table.runs_cache[1]
        active = table.active()  # [L, nb]
        if table.num_blocks == 0:
            return [[] for _ in range(self.num_layers)]
        breaks = np.diff(active, axis=1) != 1  # [L, nb-1]
        out = []
        for layer in range(self.num_layers):
            starts = np.concatenate(([0], np.flatnonzero(breaks[layer]) + 1))
            ends = np.concatenate((starts[1:], [table.num_blocks]))
            out.append(list(zip(active[layer, starts].tolist(), (ends - starts).tolist(), strict=True)))
        table.runs_cache = (table.num_blocks, out)
        return out

    def padded_tables(self, seqs: list[SeqId], width: int | None = None) -> np.ndarray:
        """Block tables of `seqs` side by side, NULL_SLOT-padded: [L, B, width]."""
        tables = [self._tables[s] for s in seqs]
        width = width if width is not None else max((t.num_blocks for t in tables), default=0)
        out = np.full((self.num_layers, len(seqs), max(width, 1)), NULL_SLOT, dtype=np.int64)
        for i, t in enumerate(tables):
            out[:, i, : t.num_blocks] = t.active()
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests switch this on)."""
        owner = self.owner
        used = int((owner != _FREE).sum())
        assert owner[NULL_SLOT] == _FREE, "the null slot was handed out"
        free = [s for a in self.allocators for s in a._free]
        assert used + len(free) == len(owner) - 1, "free + used != capacity"
        assert len(set(free)) == len(free), "a slot is free twice"
        assert not (owner[free] != _FREE).any(), "a free slot has an owner"
        for layer, a in enumerate(self.allocators):
            first = 1 + layer * self.slots_per_layer
            assert all(first <= s < first + a.capacity for s in a._free), f"layer {layer}: slot outside its region"
        seen: set[int] = set()
        for seq, table in self._tables.items():
            active = table.active().reshape(-1)
            assert table.num_blocks == self.blocks_for(table.num_tokens), f"seq {seq}: block count off"
            assert not (set(active.tolist()) & seen), f"seq {seq}: a slot is owned twice"
            seen.update(active.tolist())
            assert (owner[active] == seq).all(), f"seq {seq}: table points at a slot it does not own"
            assert (table.slots[:, table.num_blocks :] == NULL_SLOT).all(), f"seq {seq}: stale slots"
            for layer in range(self.num_layers):
                first = 1 + layer * self.slots_per_layer
                row = table.slots[layer, : table.num_blocks]
                assert ((row >= first) & (row < first + self.slots_per_layer)).all(), f"seq {seq}: layer {layer}"
        assert len(seen) == used, "a used slot belongs to no table"
