"""Block bookkeeping and residency: which tier and slot hold each block of each session and layer.

Pure Python/NumPy, no torch: the tier and scheduler logic built on it is unit-testable on any host.
A *block* is `block_size` tokens of one layer's K and V; its bytes live in a slot of the HBM pool,
of the DDR pool, in the SSD archive, or in several of them (`h3d.kv.pool.KVPool` holds the bytes).

- HBM has one region of slots per layer, each with its own free list: a layer's budget is fixed and
  a session's blocks of one layer tend to sit in consecutive slots, which attention reads in place.
  Regions may differ in size (`h3d.kv.sizing`): HBF's dense layers read every block every step, so
  they may be given a larger share than the layers that read a window.
- DDR is one region shared by all layers, so that every block of one layer can be staged there at
  once when a session's KV is larger than HBM + DDR.
- Slot 0 of each pool (`NULL_SLOT`) is reserved and never handed out: it stays zero and pads tables.

A block's *location* as seen by attention is one int: its HBM slot (>= 0) when it has one, else
`-(ddr_slot + 1)` (see `hbm_loc` / `ddr_loc`). Only full blocks may have several copies; the last,
partially filled block of a session has exactly one home (HBM or DDR), where new tokens are written.

Owner: `BlockManager` is the only writer of free lists, slot owners and residency; the tier manager
(`h3d.tiers.manager`) decides what moves and calls it once the bytes have moved.
What must stay true (checked by `BlockManager.check_invariants`):
- no slot is owned twice, and free + used = capacity, per pool;
- a table points only at slots owned by its session, each HBM slot in its layer's region;
- every block is in at least one tier; the last partial block is in HBM or DDR.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from h3d.errors import OutOfBlocks
from h3d.kv.slots import FREE, NULL_SLOT, LayeredAllocator, SeqId, SlotAllocator

NONE = -1


class Tier(enum.IntEnum):
    HBM = 0
    DDR = 1
    SSD = 2


Runs = list[tuple[int, int, int]]  # (tier, first slot, number of consecutive slots)


def hbm_loc(slot: np.ndarray) -> np.ndarray:
    return slot


def ddr_loc(slot: np.ndarray) -> np.ndarray:
    return -(slot + 1)


def runs_of(loc: np.ndarray) -> Runs:
    """Locations ([n], see the module docstring) as maximal runs of consecutive slots of one pool."""
    runs: Runs = []
    if len(loc):
        step = np.where(loc[:-1] >= 0, 1, -1)
        breaks = (np.diff(loc) != step) | ((loc[:-1] >= 0) != (loc[1:] >= 0))
        starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        ends = np.concatenate((starts[1:], [len(loc)]))
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            first = int(loc[s])
            runs.append((Tier.HBM, first, e - s) if first >= 0 else (Tier.DDR, -first - 1, e - s))
    return runs


def first_blocks(runs: Runs, n: int) -> Runs:
    """The runs of the first `n` blocks of `runs`."""
    out: Runs = []
    for tier, first, count in runs:
        if n <= 0:
            break
        out.append((tier, first, min(count, n)))
        n -= count
    return out


@dataclass(slots=True)
class BlockTable:
    """One session's blocks per layer: block j holds tokens [j*bs, (j+1)*bs).

    `num_tokens` is the number of tokens whose KV is written; the last block may be partly filled.
    `version` changes with every residency change (it keys the runs cache).
    """

    hbm: np.ndarray  # [L, capacity] int64 HBM slot or NONE
    ddr: np.ndarray  # [L, capacity] int64 DDR slot or NONE
    archived: np.ndarray  # [L, capacity] bool: a durable archive copy exists
    num_blocks: int = 0
    num_tokens: int = 0
    version: int = 0
    runs_cache: dict[int, tuple[int, Runs]] | None = None  # layer -> (version, runs)

    @property
    def capacity(self) -> int:
        """Blocks per layer the table has room for; a (layer, block) pair's key is
        `layer * capacity + block` (`TierManager.promote`)."""
        return self.hbm.shape[1]

    def locations(self, layer: int) -> np.ndarray:
        """Where attention reads each block of `layer`: [num_blocks] (see module docstring)."""
        hbm = self.hbm[layer, : self.num_blocks]
        return np.where(hbm >= 0, hbm, ddr_loc(self.ddr[layer, : self.num_blocks]))

    def all_locations(self) -> np.ndarray:
        """`locations` of every layer: [L, num_blocks]."""
        hbm = self.hbm[:, : self.num_blocks]
        return np.where(hbm >= 0, hbm, ddr_loc(self.ddr[:, : self.num_blocks]))

    def archive_only(self, layer: int | None = None, upto: int | None = None) -> np.ndarray:
        """Blocks in neither HBM nor DDR (the archive holds them): [L, n] bool, or [n] for one
        layer; the first `upto` blocks (all of them by default)."""
        n = self.num_blocks if upto is None else min(upto, self.num_blocks)
        rows = slice(None) if layer is None else layer
        return (self.hbm[rows, :n] == NONE) & (self.ddr[rows, :n] == NONE)

    def copies(self) -> tuple[int, int, int]:
        """Block copies over all layers: (in HBM, in DDR, archived)."""
        nb = self.num_blocks
        return (
            int((self.hbm[:, :nb] != NONE).sum()),
            int((self.ddr[:, :nb] != NONE).sum()),
            int(self.archived[:, :nb].sum()),
        )


class BlockManager:
    """Allocates blocks for sessions' tokens and records where their bytes are."""

    def __init__(
        self, hbm_slots_per_layer: int | Sequence[int], ddr_slots: int, num_layers: int, block_size: int
    ) -> None:
        """`hbm_slots_per_layer`: every layer's HBM region size, or one per layer (`h3d.kv.sizing`)."""
        regions = np.broadcast_to(np.asarray(hbm_slots_per_layer, dtype=np.int64), (num_layers,)).copy()
        if (regions < 1).any():
            raise ValueError("the HBM pool needs at least one slot per layer")
        self.hbm_regions = regions  # [L] slots of each layer's region
        self.hbm_owner = np.full(1 + int(regions.sum()), FREE, dtype=np.int64)
        self.hbm_alloc = LayeredAllocator(regions, self.hbm_owner)
        self.hbm_block = np.zeros_like(self.hbm_owner)  # block index held by each owned HBM slot
        self.hbm_layer = np.repeat(np.arange(num_layers, dtype=np.int64), regions)  # layer of slot s + 1
        self.hbm_layer = np.concatenate(([0], self.hbm_layer))  # indexed by slot (the null slot: 0)
        self.ddr_owner = np.full(1 + max(ddr_slots, 0), FREE, dtype=np.int64)
        self.ddr_alloc = SlotAllocator(1, max(ddr_slots, 0), self.ddr_owner)
        self.num_layers = num_layers
        self.block_size = block_size
        self._tables: dict[SeqId, BlockTable] = {}

    # ---- queries ----------------------------------------------------------------------------

    @property
    def slots_per_layer(self) -> int:
        """The smallest layer region (all of them when the regions are equal)."""
        return int(self.hbm_regions.min())

    @property
    def hbm_capacity(self) -> int:
        """HBM slots of all regions (the null slot not counted)."""
        return len(self.hbm_owner) - 1

    @property
    def num_slots(self) -> int:
        """Slots of the HBM pool, the null slot included."""
        return len(self.hbm_owner)

    @property
    def num_free(self) -> int:
        """Free HBM slots per layer (the smallest over layers)."""
        return min(a.num_free for a in self.hbm_alloc)

    @property
    def ddr_free(self) -> int:
        return self.ddr_alloc.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq: SeqId) -> bool:
        return seq in self._tables

    def table(self, seq: SeqId) -> BlockTable:
        return self._tables[seq]

    def tables(self) -> dict[SeqId, BlockTable]:
        return self._tables

    def blocks_needed(self, seq: SeqId, n_tokens: int) -> int:
        """New blocks per layer that `n_tokens` more tokens of `seq` take."""
        table = self._tables[seq]
        return self.blocks_for(table.num_tokens + n_tokens) - table.num_blocks

    def can_append(self, seq: SeqId, n_tokens: int) -> bool:
        need = self.blocks_needed(seq, n_tokens)
        short = sum(max(need - a.num_free, 0) for a in self.hbm_alloc)
        return short <= self.ddr_free

    def runs(self, seq: SeqId, layer: int) -> Runs:
        """The session's blocks of `layer` as maximal runs of consecutive slots of one pool."""
        table = self._tables[seq]
        cache = table.runs_cache if table.runs_cache is not None else {}
        hit = cache.get(layer)
        if hit is not None and hit[0] == table.version:
            return hit[1]
        if table.archive_only(layer).any():
            raise RuntimeError(f"seq {seq} layer {layer}: a block is in neither HBM nor DDR")
        runs = runs_of(table.locations(layer))
        cache[layer] = (table.version, runs)
        table.runs_cache = cache
        return runs

    # ---- allocation -------------------------------------------------------------------------

    def allocate(self, seq: SeqId) -> BlockTable:
        """Open an empty table for `seq`."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq} already has a block table")
        shape = (self.num_layers, 4)
        table = BlockTable(
            hbm=np.full(shape, NONE, dtype=np.int64),
            ddr=np.full(shape, NONE, dtype=np.int64),
            archived=np.zeros(shape, dtype=bool),
        )
        self._tables[seq] = table
        return table

    def append(self, seq: SeqId, n_tokens: int) -> np.ndarray:
        """Reserve room for `n_tokens` more tokens; returns their rows, [L, n_tokens].

        New blocks go to the layer's HBM region while it has free slots, else to DDR. A row is
        `slot * block_size + offset` in the pool holding the block: >= 0 in HBM, else
        `-(row + 1)` in DDR. The caller makes room first (`can_append`).
        """
        table = self._tables[seq]
        start, end = table.num_tokens, table.num_tokens + n_tokens
        new = self.blocks_for(end) - table.num_blocks
        if new > 0:
            if not self.can_append(seq, n_tokens):
                raise OutOfBlocks(f"KV pools exhausted: need {new} blocks per layer")
            self._grow(table, table.num_blocks + new)
            cols = slice(table.num_blocks, table.num_blocks + new)
            for layer, alloc in enumerate(self.hbm_alloc):
                in_hbm = min(new, alloc.num_free)
                slots = alloc.allocate(in_hbm, seq)
                table.hbm[layer, cols][:in_hbm] = slots
                self.hbm_block[slots] = np.arange(cols.start, cols.start + in_hbm)
                table.ddr[layer, cols][in_hbm:] = self.ddr_alloc.allocate(new - in_hbm, seq)
            table.num_blocks += new
            table.version += 1
        if start % self.block_size:
            last = start // self.block_size
            if ((table.hbm[:, last] == NONE) & (table.ddr[:, last] == NONE)).any():
                raise RuntimeError(f"seq {seq}: the partial block {last} has no HBM or DDR home to write to")
        table.num_tokens = end
        positions = np.arange(start, end, dtype=np.int64)  # [n]
        blocks = positions // self.block_size
        offsets = positions % self.block_size
        hbm = table.hbm[:, blocks]  # [L, n]
        ddr = table.ddr[:, blocks]  # [L, n]
        return np.where(hbm >= 0, hbm * self.block_size + offsets, -(ddr * self.block_size + offsets) - 1)

    def adopt_archived(self, seq: SeqId, num_tokens: int) -> None:
        """Open `seq`'s table over `num_tokens` tokens whose blocks are all in the archive only (a
        restart): no slot is taken; the blocks are staged from the archive when first read."""
        table = self._tables[seq]
        if table.num_tokens:
            raise ValueError(f"sequence {seq} already holds tokens")
        nb = self.blocks_for(num_tokens)
        self._grow(table, nb)
        table.archived[:, :nb] = True
        table.num_blocks, table.num_tokens = nb, num_tokens
        table.version += 1

    def rewrite(self, seq: SeqId, block: int) -> np.ndarray:
        """Give `block` of `seq` one writable home in every layer, to be written again (its
        archive record was damaged): an HBM copy is kept, else a DDR copy, else a new DDR slot is
        taken (the caller makes room: `homeless(seq, block)` of them); other copies are dropped
        and the block no longer counts as archived. Returns the rows of its tokens, [L, n], as
        `append` does."""
        table = self._tables[seq]
        for layer in range(self.num_layers):
            if table.hbm[layer, block] != NONE and table.ddr[layer, block] != NONE:
                self.ddr_alloc.release(table.ddr[layer, block : block + 1])
                table.ddr[layer, block] = NONE
            if table.hbm[layer, block] == NONE and table.ddr[layer, block] == NONE:
                table.ddr[layer, block] = self.ddr_alloc.allocate(1, seq)[0]
        table.archived[:, block] = False
        table.version += 1
        positions = np.arange(block * self.block_size, min((block + 1) * self.block_size, table.num_tokens))
        offsets = positions % self.block_size
        hbm = table.hbm[:, block, None]  # [L, 1]
        ddr = table.ddr[:, block, None]
        return np.where(hbm >= 0, hbm * self.block_size + offsets, -(ddr * self.block_size + offsets) - 1)

    def homeless(self, seq: SeqId, block: int) -> int:
        """Layers in which `block` of `seq` is in neither HBM nor DDR."""
        table = self._tables[seq]
        return int(((table.hbm[:, block] == NONE) & (table.ddr[:, block] == NONE)).sum())

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Forget tokens past `num_tokens` (a step that failed midway): their blocks are released."""
        table = self._tables[seq]
        if num_tokens >= table.num_tokens:
            return
        keep = self.blocks_for(num_tokens)
        for layer, alloc in enumerate(self.hbm_alloc):
            alloc.release(table.hbm[layer, keep : table.num_blocks])
            self.ddr_alloc.release(table.ddr[layer, keep : table.num_blocks])
        table.hbm[:, keep:] = NONE
        table.ddr[:, keep:] = NONE
        table.archived[:, keep:] = False
        table.num_blocks, table.num_tokens = keep, num_tokens
        table.version += 1

    def free(self, seq: SeqId) -> BlockTable | None:
        table = self._tables.pop(seq, None)
        if table is not None:
            for layer, alloc in enumerate(self.hbm_alloc):
                alloc.release(table.hbm[layer, : table.num_blocks])
                self.ddr_alloc.release(table.ddr[layer, : table.num_blocks])
        return table

    def _grow(self, table: BlockTable, blocks: int) -> None:
        cap = table.hbm.shape[1]
        if blocks <= cap:
            return
        width = max(blocks, 2 * cap)
        for name, fill in (("hbm", NONE), ("ddr", NONE), ("archived", False)):
            old = getattr(table, name)
            grown = np.full((self.num_layers, width), fill, dtype=old.dtype)
            grown[:, :cap] = old
            setattr(table, name, grown)

    # ---- residency changes (called by the tier manager once bytes have moved) ---------------

    def add_hbm(self, seq: SeqId, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Give `blocks` of `layer` HBM slots (their bytes are to be copied there); returns them."""
        table = self._tables[seq]
        assert (table.hbm[layer, blocks] == NONE).all(), "block already in HBM"
        slots = self.hbm_alloc[layer].allocate(len(blocks), seq)
        table.hbm[layer, blocks] = slots
        self.hbm_block[slots] = blocks
        table.version += 1
        return slots

    def add_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> np.ndarray:
        table = self._tables[seq]
        assert (table.ddr[layer, blocks] == NONE).all(), "block already in DDR"
        slots = self.ddr_alloc.allocate(len(blocks), seq)
        table.ddr[layer, blocks] = slots
        table.version += 1
        return slots

    def drop_hbm(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        table = self._tables[seq]
        full = blocks < table.num_tokens // self.block_size
        other = (table.ddr[layer, blocks] != NONE) | (table.archived[layer, blocks] & full)
        self._check_other_copy(table, layer, blocks, other, "HBM")
        self.hbm_alloc[layer].release(table.hbm[layer, blocks])
        table.hbm[layer, blocks] = NONE
        table.version += 1

    def add_hbm_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`add_hbm` for (layer, block) pairs of several layers at once, `layers` sorted; the
        caller has checked that none is in HBM (`check_invariants` catches a slip)."""
        table = self._tables[seq]
        slots = self.hbm_alloc.allocate_many(layers, seq)
        table.hbm[layers, blocks] = slots
        self.hbm_block[slots] = blocks
        table.version += 1
        return slots

    def add_ddr_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`add_ddr` for (layer, block) pairs of several layers at once."""
        table = self._tables[seq]
        assert (table.ddr[layers, blocks] == NONE).all(), "block already in DDR"
        slots = self.ddr_alloc.allocate(len(blocks), seq)
        table.ddr[layers, blocks] = slots
        table.version += 1
        return slots

    def move_hbm_many(
        self, seq: SeqId, layers: np.ndarray, old: np.ndarray, new: np.ndarray, slots: np.ndarray
    ) -> None:
        """Hand the HBM slots of blocks `old` over to blocks `new` of the same layers (an eviction
        and a promotion in one): `slots` are the old blocks' slots, which must have a DDR copy;
        the new blocks are not in HBM (the caller checked). Their bytes are to be copied in."""
        table = self._tables[seq]
        width = table.hbm.shape[1]
        was, now = layers * width + old, layers * width + new
        other = table.ddr.ravel().take(was) != NONE
        if not other.all():
            i = int(np.flatnonzero(~other)[0])
            raise RuntimeError(f"dropping the only usable copy of block {old[i]} of layer {layers[i]} from HBM")
        hbm = table.hbm.ravel()
        hbm[was] = NONE
        hbm[now] = slots
        self.hbm_block[slots] = new
        table.version += 1

    def drop_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        table = self._tables[seq]
        full = blocks < table.num_tokens // self.block_size
        other = (table.hbm[layer, blocks] != NONE) | (table.archived[layer, blocks] & full)
        self._check_other_copy(table, layer, blocks, other, "DDR")
        self.ddr_alloc.release(table.ddr[layer, blocks])
        table.ddr[layer, blocks] = NONE
        table.version += 1

    def drop_to_archive(self, seq: SeqId) -> None:
        """Drop every HBM and DDR copy of `seq`'s blocks, all of which the archive holds (its
        partial last block too, written as it is now): a closed session, like after a restart."""
        table = self._tables[seq]
        nb = table.num_blocks
        if not table.archived[:, :nb].all():
            raise RuntimeError(f"seq {seq}: dropping every copy of blocks the archive lacks")
        for layer, alloc in enumerate(self.hbm_alloc):
            alloc.release(table.hbm[layer, :nb])
            self.ddr_alloc.release(table.ddr[layer, :nb])
        table.hbm[:, :nb] = NONE
        table.ddr[:, :nb] = NONE
        table.version += 1

    def unadd_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        """Give back the DDR slots `add_ddr` just took for `blocks` when their bytes never arrived
        (a failed archive read): the blocks stay where they were, in the archive."""
        table = self._tables[seq]
        self.ddr_alloc.release(table.ddr[layer, blocks])
        table.ddr[layer, blocks] = NONE
        table.version += 1

    def set_archived(self, seq: SeqId, layer: int, blocks: np.ndarray, value: bool = True) -> None:
        table = self._tables[seq]
        if not value:
            other = (table.hbm[layer, blocks] != NONE) | (table.ddr[layer, blocks] != NONE)
            self._check_other_copy(table, layer, blocks, other, "the archive")
        table.archived[layer, blocks] = value
        table.version += 1

    def _check_other_copy(
        self, table: BlockTable, layer: int, blocks: np.ndarray, other: np.ndarray, tier: str
    ) -> None:
        if not other.all():
            bad = int(blocks[~other][0])
            raise RuntimeError(f"dropping the only usable copy of block {bad} of layer {layer} from {tier}")

    # ---- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests switch this on)."""
        for name, owner, allocs in (
            ("HBM", self.hbm_owner, self.hbm_alloc),
            ("DDR", self.ddr_owner, [self.ddr_alloc]),
        ):
            used = int((owner != FREE).sum())
            free = np.concatenate([a.free_slots() for a in allocs])
            assert owner[NULL_SLOT] == FREE, f"{name}: the null slot was handed out"
            assert used + len(free) == len(owner) - 1, f"{name}: free + used != capacity"
            assert np.bincount(free, minlength=len(owner)).max(initial=0) <= 1, f"{name}: a slot is free twice"
            assert not (owner[free] != FREE).any(), f"{name}: a free slot has an owner"
            for a in allocs:
                mine = a.free_slots()
                assert ((mine >= a.first) & (mine < a.first + a.capacity)).all(), f"{name}: slot out of region"
        seen_hbm: set[int] = set()
        seen_ddr: set[int] = set()
        for seq, table in self._tables.items():
            self._check_table(seq, table, seen_hbm, seen_ddr)
        assert len(seen_hbm) == int((self.hbm_owner != FREE).sum()), "a used HBM slot belongs to no table"
        assert len(seen_ddr) == int((self.ddr_owner != FREE).sum()), "a used DDR slot belongs to no table"

    def _check_table(self, seq: SeqId, table: BlockTable, seen_hbm: set[int], seen_ddr: set[int]) -> None:
        nb = table.num_blocks
        assert nb == self.blocks_for(table.num_tokens), f"seq {seq}: block count off"
        hbm, ddr, arch = table.hbm[:, :nb], table.ddr[:, :nb], table.archived[:, :nb]
        for slots, seen, owner, name in (
            (hbm, seen_hbm, self.hbm_owner, "HBM"),
            (ddr, seen_ddr, self.ddr_owner, "DDR"),
        ):
            used = slots[slots != NONE].tolist()
            assert len(set(used)) == len(used) and not (set(used) & seen), f"seq {seq}: {name} slot owned twice"
            seen.update(used)
            assert (owner[used] == seq).all(), f"seq {seq}: {name} table points at a slot it does not own"
        for layer, alloc in enumerate(self.hbm_alloc):
            row = hbm[layer][hbm[layer] != NONE]
            inside = (row >= alloc.first) & (row < alloc.first + alloc.capacity)
            assert inside.all(), f"seq {seq}: layer {layer} region"
        assert ((hbm != NONE) | (ddr != NONE) | arch).all(), f"seq {seq}: a block is in no tier"
        if table.num_tokens % self.block_size:  # the archive holds it only in the state a restart leaves
            last = (hbm[:, -1] != NONE) | (ddr[:, -1] != NONE)
            assert last.all() or (~last & arch[:, -1]).all(), f"seq {seq}: partial block not in HBM/DDR"
        assert (table.hbm[:, nb:] == NONE).all() and (table.ddr[:, nb:] == NONE).all(), f"seq {seq}: stale slots"
