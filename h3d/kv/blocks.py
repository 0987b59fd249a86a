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

Each block of one layer is an entry (`h3d.kv.entries`): its residency is kept there, and a
session's `BlockTable` points to its entries by id. Sessions whose contexts begin alike share
their leading full blocks (`share`: a fork, a prefix reused): their tables point to the same
entries, at the same block indices. While an entry is shared:
- none of its copies is dropped or moved (a drop raises): it stays where it was, readable by every
  session that points to it; a copy may be added (a promotion to HBM through any of them), and
  then every one of their tables changes version; only a DDR copy beside an HBM one may go
  (where they read it does not change);
- its slots' owner is `SHARED`;
- its archive record is its `home` session's (the one that archived it); a session that releases
  an entry it is home to while others keep it takes that record's standing with it, unless the
  tier manager made one of them its home first (the record linked to it: `TierManager._hand_over`).

A sliding-window layer's blocks older than its window are never read again: `drop_behind` frees
them (every copy, in every tier) as the context moves on, and the table points at the null entry
below that layer's `floor` (its first live block). They are in no tier, and counted nowhere.

Owner: `BlockManager` is the only writer of free lists, slot owners, entries and residency; the
tier manager (`h3d.tiers.manager`) decides what moves and calls it once the bytes have moved.
What must stay true (checked by `BlockManager.check_invariants`):
- no slot is owned twice, and free + used = capacity, per pool;
- a table points only at slots owned by its session or `SHARED`, each HBM slot in its layer's region;
- every live block (at or past its layer's floor) is in at least one tier; the last partial block
  is in HBM or DDR; a full-attention layer's floor is 0;
- an entry is free exactly when no table points to it; its count is the cells that point to it;
  an archived entry has a home;
- a table's version changes with every change of its blocks' copies that moves where attention
  reads one, or leaves one in the archive only (what is cached by version stays true).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from h3d.errors import OutOfBlocks
from h3d.kv.entries import NONE, NULL_ENTRY, Entries
from h3d.kv.slots import FREE, HELD, NULL_SLOT, SHARED, LayeredAllocator, SeqId, SlotAllocator


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


TIDY_BLOCKS = 16  # `append`: this many new blocks a layer or more take the lowest free slots in order (`h3d.kv.slots`)
MOVES_KEPT = 64  # versions a table's log of moved blocks spans at most (`BlockTable.moved`)


@dataclass(slots=True)
class BlockTable:
    """One session's blocks per layer: block j holds tokens [j*bs, (j+1)*bs).

    `ids[layer, j]` is the block's entry (`h3d.kv.entries`), where its residency is kept; past
    `num_blocks` the null entry. `num_tokens` is the number of tokens whose KV is written; the
    last block may be partly filled. `version` changes with every change of where attention reads
    a block (`locations`; it keys the runs cache and the decode graphs' tables).
    """

    entries: Entries
    ids: np.ndarray  # [L, capacity] int64 entry ids
    floor: np.ndarray  # [L] each layer's first live block (a window layer's older ones are freed)
    num_blocks: int = 0
    num_tokens: int = 0
    version: int = 0
    runs_cache: dict[int, tuple[int, Runs]] | None = None  # layer -> (version, runs)
    homeless_at: tuple[int, bool] | None = None  # (version, whether a block is in the archive only)
    ddr_only_at: tuple[int, int] | None = None  # (version, n): none of the first n blocks was in DDR only
    # The (layers, blocks) each version from `moves_from` on changed the locations of (`moved`);
    # a change made otherwise (`version` set alone) ends the log.
    moves_from: int = -1
    moves: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        """Blocks per layer the table has room for; a (layer, block) pair's key is
        `layer * capacity + block` (`Promoter.promote`)."""
        return self.ids.shape[1]

    @property
    def hbm(self) -> np.ndarray:
        """[L, capacity] HBM slot of each block or NONE (a copy: residency changes go through
        `BlockManager`)."""
        return self.entries.hbm[self.ids]

    @property
    def ddr(self) -> np.ndarray:
        """[L, capacity] DDR slot of each block or NONE (a copy)."""
        return self.entries.ddr[self.ids]

    @property
    def archived(self) -> np.ndarray:
        """[L, capacity] whether a durable archive copy of each block exists (a copy)."""
        return self.entries.archived[self.ids]

    def layer_hbm(self, layer: int) -> np.ndarray:
        """[num_blocks] HBM slot of each block of `layer` or NONE (a copy)."""
        return self.entries.hbm[self.ids[layer, : self.num_blocks]]

    def layer_ddr(self, layer: int) -> np.ndarray:
        """[num_blocks] DDR slot of each block of `layer` or NONE (a copy)."""
        return self.entries.ddr[self.ids[layer, : self.num_blocks]]

    def layer_archived(self, layer: int) -> np.ndarray:
        """[num_blocks] whether each block of `layer` has a durable archive copy (a copy)."""
        return self.entries.archived[self.ids[layer, : self.num_blocks]]

    def take(self, field: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """`field` (an entry array: `entries.hbm`, `.ddr`, ...) of the blocks at `keys`
        (`layer * capacity + block`): what a step's selections read, without a whole-table copy."""
        return field.take(self.ids.ravel().take(keys))

    def locations(self, layer: int) -> np.ndarray:
        """Where attention reads each block of `layer`: [num_blocks] (see module docstring)."""
        return self._located(self.ids[layer, : self.num_blocks])

    def locations_at(self, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`locations` of the blocks `blocks` of `layers` (one each): [n]."""
        return self._located(self.ids[layers, blocks])

    def all_locations(self, first: int = 0) -> np.ndarray:
        """`locations` of every layer: [L, num_blocks], or of the blocks from `first` on."""
        return self._located(self.ids[:, first : self.num_blocks])

    def _located(self, ids: np.ndarray) -> np.ndarray:
        """Where attention reads the entries `ids`: the HBM slot, else the DDR slot as `ddr_loc`."""
        hbm = self.entries.hbm[ids]
        return np.where(hbm >= 0, hbm, ddr_loc(self.entries.ddr[ids]))

    def archive_only(self, layer: int | None = None, upto: int | None = None) -> np.ndarray:
        """Blocks in neither HBM nor DDR (the archive holds them): [L, n] bool, or [n] for one
        layer; the first `upto` blocks (all of them by default). Blocks freed behind a window are not."""
        n = self.num_blocks if upto is None else min(upto, self.num_blocks)
        ids = self.ids[:, :n] if layer is None else self.ids[layer, :n]
        return (self.entries.hbm[ids] == NONE) & (self.entries.ddr[ids] == NONE) & (ids != NULL_ENTRY)

    def moved(self, layers: np.ndarray | int, blocks: np.ndarray) -> None:
        """A change of where attention reads the blocks `blocks` of `layers` (one layer, or one
        each) and of no other: a new version, the blocks kept for `moves_since`."""
        blocks = np.array(blocks, dtype=np.int64).ravel()
        if self.moves_from < 0 or self.moves_from + len(self.moves) != self.version:
            self.moves_from, self.moves = self.version, []  # (a change outside the log came between)
        elif len(self.moves) >= MOVES_KEPT:
            del self.moves[: MOVES_KEPT // 2]
            self.moves_from += MOVES_KEPT // 2
        if np.ndim(layers) == 0:
            layers = np.full(len(blocks), layers, dtype=np.int64)
        self.moves.append((np.array(layers, dtype=np.int64).ravel(), blocks))
        self.version += 1

    def moves_since(self, version: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The (layers, blocks) whose locations may have changed since `version` (some perhaps
        more than once), or None where that is not known: read the whole table then."""
        first = self.moves_from
        if first < 0 or first + len(self.moves) != self.version or not first <= version <= self.version:
            return None
        since = self.moves[version - first :]
        if not since:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate([m[0] for m in since]), np.concatenate([m[1] for m in since])

    def bump(self, appended_from: int | None = None) -> None:
        """A change of where attention reads a block: a new version. `appended_from`: blocks were
        only added, each with a home, from that block on, so that what is cached of the older
        blocks' copies still holds (carried to the new version; `moves_since` lists the new ones)."""
        was = self.version
        if appended_from is None:
            self.version += 1
        else:
            L, new = self.ids.shape[0], np.arange(appended_from, self.num_blocks, dtype=np.int64)
            self.moved(np.repeat(np.arange(L, dtype=np.int64), len(new)), np.tile(new, L))
            if self.homeless_at is not None and self.homeless_at[0] == was:
                self.homeless_at = (self.version, self.homeless_at[1])
            if self.ddr_only_at is not None and self.ddr_only_at[0] == was:
                self.ddr_only_at = (self.version, self.ddr_only_at[1])

    def any_archive_only(self) -> bool:
        """Whether some block is in neither HBM nor DDR (`archive_only().any()`), kept for the
        table's version: every change of a block's copies that can leave it in the archive only
        changes the version, so that a step asks this of a long session without a scan of its
        whole table (every block of it is archived once written behind)."""
        at = self.homeless_at
        if at is None or at[0] != self.version:
            at = self.homeless_at = (self.version, bool(self.archive_only().any()))
        return at[1]

    def live(self) -> np.ndarray:
        """[L, num_blocks] whether each block is kept (False: freed behind its layer's window)."""
        return self.ids[:, : self.num_blocks] != NULL_ENTRY

    def copies(self) -> tuple[int, int, int]:
        """Block copies over all layers: (in HBM, in DDR, archived)."""
        ids = self.ids[:, : self.num_blocks]
        e = self.entries
        return int((e.hbm[ids] != NONE).sum()), int((e.ddr[ids] != NONE).sum()), int(e.archived[ids].sum())


class BlockManager:
    """Allocates blocks for sessions' tokens and records where their bytes are."""

    def __init__(
        self,
        hbm_slots_per_layer: int | Sequence[int],
        ddr_slots: int,
        num_layers: int,
        block_size: int,
        windows: Sequence[int | None] | None = None,
        keep_tokens: int = 0,
    ) -> None:
        """`hbm_slots_per_layer`: every layer's HBM region size, or one per layer (`h3d.kv.sizing`);
        `windows`: each layer's sliding window in tokens, None for full attention (all full by
        default; `ModelConfig.windows`); `keep_tokens`: how far past its window a sliding layer's
        blocks are kept (`window_keep_tokens`: a rewind that short keeps the KV)."""
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} layer windows for {num_layers} layers")
        # The sliding-window layers and their windows, and the full-attention layers (the tiered ones).
        self.window_layers = np.array([i for i, w in enumerate(self.windows) if w is not None], dtype=np.int64)
        self._window_sizes = np.array([w for w in self.windows if w is not None], dtype=np.int64)
        self.full_layers = np.array([i for i, w in enumerate(self.windows) if w is None], dtype=np.int64)
        self.window_freed = 0  # blocks freed behind windows (all layers), ever
        self.keep_tokens = keep_tokens
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
        self.entries = Entries(1 + (int(regions.sum()) + max(ddr_slots, 0)))  # what the pools hold, at first
        self._tables: dict[SeqId, BlockTable] = {}
        # Sessions that share entries, as groups (one set object per group, each member's key
        # pointing at it): a change of a shared entry's copies changes every member's version.
        self._groups: dict[SeqId, set[SeqId]] = {}

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

    def peers(self, seq: SeqId) -> set[SeqId]:
        """The sessions `seq` shares (or shared) blocks with."""
        group = self._groups.get(seq)
        return set() if group is None else group - {seq}

    @property
    def sharing(self) -> bool:
        """Whether any sessions share (or shared) blocks now."""
        return bool(self._groups)

    def shared(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of the entries `ids` has several tables pointing to it (a bool array of
        `ids`' shape)."""
        return self.entries.refs[ids] > 1

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
        if table.any_archive_only() and table.archive_only(layer).any():
            raise RuntimeError(f"seq {seq} layer {layer}: a block is in neither HBM nor DDR")
        runs = runs_of(table.locations(layer))
        cache[layer] = (table.version, runs)
        table.runs_cache = cache
        return runs

    def floors(self, num_tokens: int, keep: int | None = None) -> np.ndarray:
        """[L] the first block each layer keeps once `num_tokens` tokens are written: a query at
        position p of a sliding-window layer reads keys p - window < j <= p, so from the next token
        (position `num_tokens`) on the blocks before (num_tokens - window + 1) // bs are never read
        again; they are kept `keep` tokens longer (`keep_tokens` by default, 0: what is read); a
        full-attention layer keeps every block."""
        keep = self.keep_tokens if keep is None else keep
        out = np.zeros(self.num_layers, dtype=np.int64)
        if len(self.window_layers):
            out[self.window_layers] = np.maximum(num_tokens - self._window_sizes + 1 - keep, 0) // self.block_size
        return out

    def decode_reads(self, seq: SeqId) -> np.ndarray:
        """[L, num_blocks] the blocks a decode token at `seq`'s last position reads where a layer
        reads without selecting: every block, or a sliding layer's window's."""
        table = self._tables[seq]
        first = self.floors(max(table.num_tokens - 1, 0), keep=0)
        return np.arange(table.num_blocks)[None, :] >= first[:, None]

    def keepable(self, seq: SeqId, num_tokens: int) -> int:
        """The tokens a cut of `seq`'s KV back to `num_tokens` keeps: all of them, unless a
        window layer would then read a block it has freed. Then none: a window layer's KV at a
        position depends, through the layers below, on a cone of earlier positions, so only a
        prefill from the start computes it again exactly."""
        table = self._tables[seq]
        return num_tokens if (table.floor <= self.floors(num_tokens, keep=0)).all() else 0

    def drop_behind(self, seq: SeqId, num_tokens: int) -> int:
        """Free the blocks of `seq`'s sliding-window layers that no token from position
        `num_tokens` on reads (`floors`): every copy, in every tier (a block shared with other
        sessions: this session's reference to it). Returns the blocks freed."""
        if not len(self.window_layers):
            return 0
        table = self._tables[seq]
        want = np.minimum(self.floors(num_tokens), table.num_blocks)
        layers = np.flatnonzero(want > table.floor)
        if not len(layers):
            return 0
        freed = 0
        for layer in layers.tolist():
            ids = table.ids[layer, table.floor[layer] : want[layer]]
            self._unref(seq, np.full(len(ids), layer, dtype=np.int64), ids)
            table.ids[layer, table.floor[layer] : want[layer]] = NULL_ENTRY
            freed += len(ids)
        table.floor[layers] = want[layers]
        table.version += 1
        self.window_freed += freed
        return freed

    # ---- allocation -------------------------------------------------------------------------

    def allocate(self, seq: SeqId) -> BlockTable:
        """Open an empty table for `seq`."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq} already has a block table")
        table = BlockTable(
            self.entries, np.full((self.num_layers, 4), NULL_ENTRY, dtype=np.int64), np.zeros(self.num_layers, np.int64)
        )
        self._tables[seq] = table
        return table

    def share(self, parent: SeqId, child: SeqId, n: int) -> None:
        """Point `child`'s table (open, empty) at `parent`'s first `n` blocks, which must be full
        and each in HBM or DDR: the child's context begins with the parent's first `n * block_size`
        tokens (a fork, a prefix reused). No slot is taken; the shared entries stay where they are
        while shared (see the module docstring). A window layer's blocks are those the parent
        keeps (the caller checked that the child reads no block it freed, `keepable`)."""
        src, dst = self._tables[parent], self._tables[child]
        if dst.num_tokens:
            raise ValueError(f"sequence {child} already holds tokens")
        if n > src.num_tokens // self.block_size:
            raise ValueError(f"seq {parent}: only whole blocks are shared ({n} asked)")
        if src.archive_only(upto=n).any():
            raise RuntimeError(f"seq {parent}: a block to share is in the archive only")
        if not n:
            return
        self._grow(dst, n)
        ids = src.ids[:, :n]
        dst.ids[:, :n] = ids
        live = ids[ids != NULL_ENTRY]
        e = self.entries
        e.refs[live] += 1  # (a table's cells point at distinct entries)
        dst.floor = np.minimum(src.floor, n)
        dst.num_blocks, dst.num_tokens = n, n * self.block_size
        dst.version += 1
        group = self._groups.get(parent, {parent}) | self._groups.get(child, {child})
        for seq in group:
            self._groups[seq] = group
        self._touched(child, live)

    def rebase(self, donor: SeqId, seq: SeqId, n: int) -> int:
        """Point `seq`'s first `n` blocks at `donor`'s (the same tokens: a session resumed from the
        archive whose prefix another holds in HBM or DDR): `seq`'s own entries there are let go
        (their archive records stay), the donor's shared. Both must hold `n` full blocks, the
        donor's each in HBM or DDR, and no window layer of `seq` may need a block the donor freed.
        Returns the blocks (one layer's each) that now point at the donor's."""
        src, dst = self._tables[donor], self._tables[seq]
        if n > min(src.num_tokens, dst.num_tokens) // self.block_size:
            raise ValueError(f"seq {seq}: only whole blocks both sessions hold are shared ({n} asked)")
        if src.archive_only(upto=n).any():
            raise RuntimeError(f"seq {donor}: a block to share is in the archive only")
        floor = np.minimum(dst.floor, n)
        if (src.floor > floor).any():
            raise ValueError(f"seq {donor}: a window layer freed blocks seq {seq} reads")
        cols = np.arange(n)[None, :] >= floor[:, None]  # [L, n] the cells seq keeps
        old, new = dst.ids[:, :n], src.ids[:, :n]
        swap = cols & (old != new)
        if not swap.any():
            return 0
        layers = np.nonzero(swap)[0]  # ascending
        self._unref(seq, layers, old[swap])
        ids = new[swap]
        self.entries.refs[ids] += 1
        dst.ids[:, :n][swap] = ids
        dst.version += 1
        group = self._groups.get(donor, {donor}) | self._groups.get(seq, {seq})
        for member in group:
            self._groups[member] = group
        self._touched(seq, ids)
        return len(ids)

    def _touched(self, seq: SeqId, ids: np.ndarray) -> None:
        """`seq`'s entries `ids` gained copies: those shared get `SHARED` owners for their slots,
        and the other sessions of `seq`'s group a new version (where attention reads may move)."""
        group = self._groups.get(seq)
        if group is None:
            return
        ids = ids[self.entries.refs[ids] > 1]
        if not len(ids):
            return
        hbm, ddr = self.entries.hbm[ids], self.entries.ddr[ids]
        self.hbm_owner[hbm[hbm != NONE]] = SHARED
        self.ddr_owner[ddr[ddr != NONE]] = SHARED
        for other in group:
            if other != seq:
                self._tables[other].version += 1

    def _unshared(self, ids: np.ndarray, what: str) -> None:
        """Raise if one of `ids` is shared: its copies stay where they are while it is."""
        if (self.entries.refs[ids] > 1).any():
            raise RuntimeError(f"{what}: a block several sessions share cannot be moved")

    def _unref(self, seq: SeqId, layers: np.ndarray, ids: np.ndarray) -> None:
        """`seq` no longer points to `ids` (of `layers`, ascending; the null entry ignored): the
        slots of the entries no other table points to go back; an entry kept by others loses
        its archive copy if its record was `seq`'s (it may be deleted with `seq`'s records)."""
        e = self.entries
        refs = e.refs[ids]
        last = refs == 1
        self.hbm_alloc.release_many(layers[last], e.hbm[ids[last]])
        self.ddr_alloc.release(e.ddr[ids[last]])
        kept = ids[refs > 1]
        if len(kept):
            mine = kept[e.archived[kept] & (e.home[kept] == seq)]
            e.archived[mine] = False
            e.home[mine] = NONE
            e.num_archived -= len(mine)
        e.release(ids)

    def _rows(self, table: BlockTable, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Pool rows of the tokens at `offsets` of `blocks` ([n] each), in every layer: [L, n]:
        `slot * block_size + offset`, >= 0 in HBM, else `-(row + 1)` in DDR."""
        ids = table.ids[:, blocks]  # [L, n]
        hbm, ddr = self.entries.hbm[ids], self.entries.ddr[ids]
        return np.where(hbm >= 0, hbm * self.block_size + offsets, -(ddr * self.block_size + offsets) - 1)

    def append(self, seq: SeqId, n_tokens: int) -> np.ndarray:
        """Reserve room for `n_tokens` more tokens; returns their rows, [L, n_tokens].

        New blocks go to the layer's HBM region while it has free slots, else to DDR. A row is
        `slot * block_size + offset` in the pool holding the block: >= 0 in HBM, else
        `-(row + 1)` in DDR. The caller makes room first (`can_append`).
        """
        table = self._tables[seq]
        e = self.entries
        start, end = table.num_tokens, table.num_tokens + n_tokens
        new = self.blocks_for(end) - table.num_blocks
        if new > 0:
            if not self.can_append(seq, n_tokens):
                raise OutOfBlocks(f"KV pools exhausted: need {new} blocks per layer")
            self._grow(table, table.num_blocks + new)
            if new >= TIDY_BLOCKS:  # the free slots in order first: the new blocks in few runs
                self.hbm_alloc.tidy()
                if new - int(self.hbm_alloc.free.min()) >= TIDY_BLOCKS:  # (DDR's only where they spill there)
                    self.ddr_alloc.tidy()
            first = table.num_blocks
            ids = e.allocate(self.num_layers * new).reshape(self.num_layers, new)
            table.ids[:, first : first + new] = ids
            for layer, alloc in enumerate(self.hbm_alloc):
                in_hbm = min(new, alloc.num_free)
                slots = alloc.allocate(in_hbm, seq)
                e.hbm[ids[layer, :in_hbm]] = slots
                self.hbm_block[slots] = np.arange(first, first + in_hbm)
                e.ddr[ids[layer, in_hbm:]] = self.ddr_alloc.allocate(new - in_hbm, seq)
            table.num_blocks += new
            table.bump(appended_from=first)  # new blocks, each with a home: the others are as they were
        if start % self.block_size:
            last = start // self.block_size
            if self.homeless(seq, last):
                raise RuntimeError(f"seq {seq}: the partial block {last} has no HBM or DDR home to write to")
        table.num_tokens = end
        positions = np.arange(start, end, dtype=np.int64)  # [n]
        return self._rows(table, positions // self.block_size, positions % self.block_size)

    def adopt_archived(self, seq: SeqId, num_tokens: int) -> None:
        """Open `seq`'s table over `num_tokens` tokens whose blocks are all in the archive only (a
        restart): no slot is taken; the blocks are staged from the archive when first read. A
        window layer's blocks are those from its floor on (`floors`)."""
        table = self._tables[seq]
        if table.num_tokens:
            raise ValueError(f"sequence {seq} already holds tokens")
        nb = self.blocks_for(num_tokens)
        self._grow(table, nb)
        floor = np.minimum(self.floors(num_tokens), nb)
        live = np.arange(nb)[None, :] >= floor[:, None]  # [L, nb]
        ids = self.entries.allocate(int(live.sum()))
        table.ids[:, :nb][live] = ids
        self.entries.archived[ids] = True
        self.entries.home[ids] = seq
        self.entries.num_archived += ids.size
        table.floor = floor
        table.num_blocks, table.num_tokens = nb, num_tokens
        table.version += 1

    def rewrite(self, seq: SeqId, block: int) -> np.ndarray:
        """Give `block` of `seq` one writable home in every layer, to be written again (its
        archive record was damaged): an HBM copy is kept, else a DDR copy, else a new DDR slot is
        taken (the caller makes room: `homeless(seq, block)` of them); other copies are dropped
        and the block no longer counts as archived. Returns the rows of its tokens, [L, n], as
        `append` does."""
        table = self._tables[seq]
        e = self.entries
        if (table.ids[:, block] == NULL_ENTRY).any():
            raise ValueError(f"seq {seq}: block {block} was freed behind a window")
        self._unshared(table.ids[:, block], f"seq {seq} block {block}")
        for i in table.ids[:, block].tolist():
            if e.hbm[i] != NONE and e.ddr[i] != NONE:
                self.ddr_alloc.release(e.ddr[i : i + 1])
                e.ddr[i] = NONE
            if e.hbm[i] == NONE and e.ddr[i] == NONE:
                e.ddr[i] = self.ddr_alloc.allocate(1, seq)[0]
        e.num_archived -= int(np.count_nonzero(e.archived[table.ids[:, block]]))
        e.archived[table.ids[:, block]] = False
        table.version += 1
        positions = np.arange(block * self.block_size, min((block + 1) * self.block_size, table.num_tokens))
        return self._rows(table, np.full(len(positions), block), positions % self.block_size)

    def homeless(self, seq: SeqId, block: int) -> int:
        """Layers in which `block` of `seq` is in neither HBM nor DDR."""
        ids = self._tables[seq].ids[:, block]
        return int(((self.entries.hbm[ids] == NONE) & (self.entries.ddr[ids] == NONE) & (ids != NULL_ENTRY)).sum())

    def _release(self, seq: SeqId, table: BlockTable, first: int, end: int) -> None:
        """Give back the entries of blocks [first, end) of every layer, and the slots of those
        no other table points to."""
        ids = table.ids[:, first:end]  # [L, n]
        layers = np.repeat(np.arange(self.num_layers, dtype=np.int64), ids.shape[1])
        self._unref(seq, layers, ids.ravel())
        table.ids[:, first:end] = NULL_ENTRY

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Forget tokens past `num_tokens` (a step that failed midway): their blocks are released."""
        table = self._tables[seq]
        if num_tokens >= table.num_tokens:
            return
        keep = self.blocks_for(num_tokens)
        if (table.floor > self.floors(num_tokens, keep=0)).any() and num_tokens:
            raise ValueError(f"seq {seq}: a cut to {num_tokens} tokens needs blocks freed behind a window (`keepable`)")
        if num_tokens % self.block_size:
            self._unshared(table.ids[:, keep - 1], f"seq {seq}: a cut inside a shared block")
        self._release(seq, table, keep, table.num_blocks)
        table.floor = np.minimum(table.floor, keep)
        table.num_blocks, table.num_tokens = keep, num_tokens
        if num_tokens % self.block_size:
            # The last block is partial again and new tokens go to one copy of it (HBM's where it
            # has one): its DDR copy beside an HBM one goes, and its archive record is no longer
            # its copy (unless it is the only one: staged back before it is written, as after a restart).
            e, ids = self.entries, table.ids[:, keep - 1]
            both = ids[(e.hbm[ids] != NONE) & (e.ddr[ids] != NONE)]
            self.ddr_alloc.release(e.ddr[both])
            e.ddr[both] = NONE
            stale = ids[e.archived[ids] & ((e.hbm[ids] != NONE) | (e.ddr[ids] != NONE))]
            e.num_archived -= len(stale)
            e.archived[stale] = False
        table.version += 1

    def free(self, seq: SeqId) -> BlockTable | None:
        table = self._tables.get(seq)
        if table is not None:
            self._release(seq, table, 0, table.num_blocks)
            del self._tables[seq]
        group = self._groups.pop(seq, None)
        if group is not None:
            group.discard(seq)
            if len(group) == 1:  # alone again
                self._groups.pop(next(iter(group)), None)
        return table

    def _grow(self, table: BlockTable, blocks: int) -> None:
        cap = table.ids.shape[1]
        if blocks <= cap:
            return
        grown = np.full((self.num_layers, max(blocks, 2 * cap)), NULL_ENTRY, dtype=np.int64)
        grown[:, :cap] = table.ids
        table.ids = grown

    # ---- residency changes (called by the tier manager once bytes have moved) ---------------

    def add_hbm(self, seq: SeqId, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Give `blocks` of `layer` HBM slots (their bytes are to be copied there); returns them."""
        table = self._tables[seq]
        ids = table.ids[layer, blocks]
        assert (self.entries.hbm[ids] == NONE).all(), "block already in HBM"
        slots = self.hbm_alloc[layer].allocate(len(blocks), seq)
        self.entries.hbm[ids] = slots
        self.hbm_block[slots] = blocks
        table.moved(layer, blocks)
        self._touched(seq, ids)
        return slots

    def add_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> np.ndarray:
        return self.add_ddr_many(seq, np.full(len(blocks), layer, dtype=np.int64), blocks)

    def drop_hbm(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        table = self._tables[seq]
        e, ids = self.entries, table.ids[layer, blocks]
        self._unshared(ids, f"seq {seq} layer {layer}: an HBM copy dropped")
        full = blocks < table.num_tokens // self.block_size
        self._check_other_copy(layer, blocks, (e.ddr[ids] != NONE) | (e.archived[ids] & full), "HBM")
        self.hbm_alloc[layer].release(e.hbm[ids])
        e.hbm[ids] = NONE
        table.moved(layer, blocks)

    def drop_hbm_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> None:
        """`drop_hbm` for (layer, block) pairs of several layers at once, `layers` sorted."""
        table = self._tables[seq]
        e, ids = self.entries, table.ids[layers, blocks]
        self._unshared(ids, f"seq {seq}: HBM copies dropped")
        other = (e.ddr[ids] != NONE) | (e.archived[ids] & (blocks < table.num_tokens // self.block_size))
        if not other.all():
            i = int(np.flatnonzero(~other)[0])
            raise RuntimeError(f"dropping the only usable copy of block {blocks[i]} of layer {layers[i]} from HBM")
        self.hbm_alloc.release_many(layers, e.hbm[ids])
        e.hbm[ids] = NONE
        table.moved(layers, blocks)

    def add_hbm_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`add_hbm` for (layer, block) pairs of several layers at once, `layers` sorted; the
        caller has checked that none is in HBM (`check_invariants` catches a slip)."""
        table = self._tables[seq]
        slots = self.hbm_alloc.allocate_many(layers, seq)
        ids = table.ids[layers, blocks]
        self.entries.hbm[ids] = slots
        self.hbm_block[slots] = blocks
        table.moved(layers, blocks)
        self._touched(seq, ids)
        return slots

    def add_ddr_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """`add_ddr` for (layer, block) pairs of several layers at once."""
        table = self._tables[seq]
        ids = table.ids[layers, blocks]
        assert (self.entries.ddr[ids] == NONE).all(), "block already in DDR"
        slots = self.ddr_alloc.allocate(len(blocks), seq)
        ddr_only = self.entries.hbm[ids] == NONE  # (a DDR copy beside an HBM one changes no location)
        if ddr_only.any():
            table.moved(layers[ddr_only], blocks[ddr_only])
        self.entries.ddr[ids] = slots
        self._touched(seq, ids)
        return slots

    def place_ddr_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray, slots: np.ndarray) -> None:
        """Blocks in neither HBM nor DDR take the DDR slots read ahead for them
        (`SlotAllocator.take`, filled from the archive)."""
        table = self._tables[seq]
        ids = table.ids[layers, blocks]
        assert ((self.entries.ddr[ids] == NONE) & (self.entries.hbm[ids] == NONE)).all(), "block has a copy"
        self.ddr_alloc.claim(slots, seq)
        self.entries.ddr[ids] = slots
        table.moved(layers, blocks)
        self._touched(seq, ids)

    def move_hbm_many(
        self, seq: SeqId, layers: np.ndarray, old: np.ndarray, new: np.ndarray, slots: np.ndarray
    ) -> None:
        """Hand the HBM slots of blocks `old` over to blocks `new` of the same layers (an eviction
        and a promotion in one): `slots` are the old blocks' slots, which must have a DDR copy;
        the new blocks are not in HBM (the caller checked). Their bytes are to be copied in."""
        table = self._tables[seq]
        e, flat, width = self.entries, table.ids.ravel(), table.capacity
        was, now = flat.take(layers * width + old), flat.take(layers * width + new)
        self._unshared(was, f"seq {seq}: HBM copies handed over")
        other = e.ddr.take(was) != NONE
        if not other.all():
            i = int(np.flatnonzero(~other)[0])
            raise RuntimeError(f"dropping the only usable copy of block {old[i]} of layer {layers[i]} from HBM")
        e.hbm[was] = NONE
        e.hbm[now] = slots
        self.hbm_block[slots] = new
        table.moved(np.concatenate([layers, layers]), np.concatenate([old, new]))
        self._touched(seq, now)

    def drop_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        table = self._tables[seq]
        e, ids = self.entries, table.ids[layer, blocks]
        # (A shared block's DDR copy beside its HBM one may go: where its sessions read it stays.)
        self._unshared(ids[e.hbm[ids] == NONE], f"seq {seq} layer {layer}: a DDR copy dropped")
        full = blocks < table.num_tokens // self.block_size
        self._check_other_copy(layer, blocks, (e.hbm[ids] != NONE) | (e.archived[ids] & full), "DDR")
        self.ddr_alloc.release(e.ddr[ids])
        e.ddr[ids] = NONE
        table.moved(layer, blocks)

    def drop_to_archive(self, seq: SeqId) -> None:
        """Drop every HBM and DDR copy of `seq`'s blocks, all of which the archive holds (its
        partial last block too, written as it is now): a closed session, like after a restart.
        Blocks it shares with other sessions keep their copies (they stay where they are)."""
        table = self._tables[seq]
        e, ids = self.entries, table.ids[:, : table.num_blocks]
        mine = e.refs[ids] == 1  # [L, n] (the null entry's count is 0)
        if not (e.archived[ids] | ~mine).all():
            raise RuntimeError(f"seq {seq}: dropping every copy of blocks the archive lacks")
        ids = ids[mine]
        layers = np.nonzero(mine)[0]  # ascending
        self.hbm_alloc.release_many(layers, e.hbm[ids])
        self.ddr_alloc.release(e.ddr[ids])
        e.hbm[ids] = NONE
        e.ddr[ids] = NONE
        table.version += 1

    def unadd_ddr(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        """Give back the DDR slots `add_ddr` just took for `blocks` when their bytes never arrived
        (a failed archive read): the blocks stay where they were, in the archive."""
        table = self._tables[seq]
        ids = table.ids[layer, blocks]
        self.ddr_alloc.release(self.entries.ddr[ids])
        self.entries.ddr[ids] = NONE
        table.moved(layer, blocks)

    def set_archived(self, seq: SeqId, layer: int, blocks: np.ndarray, value: bool = True) -> None:
        table = self._tables[seq]
        e, ids = self.entries, table.ids[layer, blocks]
        if not value:
            self._unshared(ids, f"seq {seq} layer {layer}: an archive copy dropped")
            self._check_other_copy(layer, blocks, (e.hbm[ids] != NONE) | (e.ddr[ids] != NONE), "the archive")
        e.num_archived += len(ids) * value - int(np.count_nonzero(e.archived[ids]))
        e.archived[ids] = value
        e.home[ids] = seq if value else NONE
        table.moved(layer, blocks[:0])  # (where attention reads them does not change)

    def set_archived_many(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray) -> None:
        """(layer, block) pairs of `seq` have a durable archive copy now (write-behind): where
        attention reads them does not change."""
        e, ids = self.entries, self._tables[seq].ids[layers, blocks]
        e.num_archived += len(np.unique(ids)) - int(np.count_nonzero(e.archived[np.unique(ids)]))
        e.archived[ids] = True
        e.home[ids] = seq

    def _check_other_copy(self, layer: int, blocks: np.ndarray, other: np.ndarray, tier: str) -> None:
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
            used = int(((owner >= 0) | (owner == SHARED)).sum())
            held = int((owner == HELD).sum())  # released while an archive write reads them
            free = np.concatenate([a.free_slots() for a in allocs])
            assert owner[NULL_SLOT] == FREE, f"{name}: the null slot was handed out"
            later = self.ddr_alloc.size - self.ddr_alloc.capacity if name == "DDR" else 0  # not usable yet
            assert (owner[len(owner) - later :] == FREE).all(), f"{name}: a slot not usable yet was handed out"
            assert used + held + len(free) + later == len(owner) - 1, f"{name}: free + held + used != capacity"
            assert np.bincount(free, minlength=len(owner)).max(initial=0) <= 1, f"{name}: a slot is free twice"
            assert not (owner[free] != FREE).any(), f"{name}: a free slot has an owner"
            for a in allocs:
                mine = a.free_slots()
                assert ((mine >= a.first) & (mine < a.first + a.capacity)).all(), f"{name}: slot out of region"
        for seq, table in self._tables.items():
            self._check_table(seq, table)
        e = self.entries
        cells = [t.ids[t.ids != NULL_ENTRY] for t in self._tables.values()]
        live = np.unique(np.concatenate([np.empty(0, np.int64), *cells]))
        for name, slots, owner in (("HBM", e.hbm[live], self.hbm_owner), ("DDR", e.ddr[live], self.ddr_owner)):
            slots = slots[slots != NONE]
            assert len(np.unique(slots)) == len(slots), f"a {name} slot is held by two blocks"
            used = int(((owner >= 0) | (owner == SHARED)).sum())
            assert len(slots) == used, f"a used {name} slot belongs to no table"
        shared = live[e.refs[live] > 1]
        assert (self.hbm_owner[e.hbm[shared][e.hbm[shared] != NONE]] == SHARED).all(), "a shared HBM slot has one owner"
        assert (self.ddr_owner[e.ddr[shared][e.ddr[shared] != NONE]] == SHARED).all(), "a shared DDR slot has one owner"
        for seq, group in self._groups.items():
            assert seq in group and len(group) > 1 and all(self._groups.get(o) is group for o in group), "share groups"
            assert all(o in self._tables for o in group), "a share group holds a freed session"
        # Every table pointing at a shared entry is in one group (a change of its copies reaches them all).
        cells = [(seq, t.ids[t.ids != NULL_ENTRY]) for seq, t in self._tables.items()]
        pairs = [(c[e.refs[c] > 1], seq) for seq, c in cells]
        ent = np.concatenate([np.empty(0, np.int64), *(c for c, _ in pairs)])
        who = np.concatenate([np.empty(0, np.int64), *(np.full(len(c), s, np.int64) for c, s in pairs)])
        group_of = {seq: min(self._groups.get(seq, {seq})) for seq in self._tables}  # a group's least member
        key = np.array([group_of[SeqId(s)] for s in who.tolist()], dtype=np.int64)
        uniq, inverse = np.unique(ent, return_inverse=True)
        lo = np.full(len(uniq), np.iinfo(np.int64).max)
        hi = np.full(len(uniq), np.iinfo(np.int64).min)
        np.minimum.at(lo, inverse, key)
        np.maximum.at(hi, inverse, key)
        assert (lo == hi).all(), "a shared entry's tables in two groups"
        # An archived entry's record is its home's, a session that points at it.
        homed = sum(int((e.archived[t.ids] & (e.home[t.ids] == seq)).sum()) for seq, t in self._tables.items())
        assert homed == int(np.count_nonzero(e.archived)), "an archived entry's home does not point at it"
        self._check_entries()

    def _check_entries(self) -> None:
        e = self.entries
        cells = [t.ids[:, : t.num_blocks][t.live()] for t in self._tables.values()]
        pointed = np.bincount(np.concatenate([np.empty(0, dtype=np.int64), *cells]), minlength=e.capacity)
        assert pointed[NULL_ENTRY] == 0, "a table points at the null entry inside its blocks"
        assert (pointed == e.refs).all(), "an entry's reference count is not the number of cells pointing to it"
        free = e.free_ids()
        assert len(free) + e.num_used == e.capacity - 1 and not (pointed[free] > 0).any(), "a free entry is in use"
        for name, column, empty in (("hbm", e.hbm, NONE), ("ddr", e.ddr, NONE), ("archived", e.archived, False)):
            assert (column[free] == empty).all() and column[NULL_ENTRY] == empty, f"a free entry has a {name} copy"
        for table in self._tables.values():
            assert (table.ids[:, table.num_blocks :] == NULL_ENTRY).all(), "a table points past its blocks"
        assert e.num_archived == int(np.count_nonzero(e.archived)), "the count of archived entries is off"
        assert (e.home[e.archived] != NONE).all(), "an archived entry has no home"

    def _check_table(self, seq: SeqId, table: BlockTable) -> None:
        nb = table.num_blocks
        assert nb == self.blocks_for(table.num_tokens), f"seq {seq}: block count off"
        below = np.arange(nb)[None, :] < table.floor[:, None]
        assert (table.live() == ~below).all(), f"seq {seq}: a block freed above its layer's floor, or kept below it"
        assert not table.floor[self.full_layers].any() and (table.floor <= nb).all(), f"seq {seq}: floor off"
        hbm, ddr, arch = table.hbm[:, :nb], table.ddr[:, :nb], table.archived[:, :nb]
        for slots, owner, name in ((hbm, self.hbm_owner, "HBM"), (ddr, self.ddr_owner, "DDR")):
            used = slots[slots != NONE]
            mine = (owner[used] == seq) | (owner[used] == SHARED)
            assert mine.all(), f"seq {seq}: {name} table points at a slot it does not own"
        for layer, alloc in enumerate(self.hbm_alloc):
            row = hbm[layer][hbm[layer] != NONE]
            inside = (row >= alloc.first) & (row < alloc.first + alloc.capacity)
            assert inside.all(), f"seq {seq}: layer {layer} region"
        assert ((hbm != NONE) | (ddr != NONE) | arch | below).all(), f"seq {seq}: a block is in no tier"
        if table.num_tokens % self.block_size:  # where the archive holds it only, staged before it is written
            last = (hbm[:, -1] != NONE) | (ddr[:, -1] != NONE)
            assert (last | arch[:, -1]).all(), f"seq {seq}: partial block not in HBM/DDR"
        assert (table.hbm[:, nb:] == NONE).all() and (table.ddr[:, nb:] == NONE).all(), f"seq {seq}: stale slots"
        only = table.ddr_only_at
        if only is not None and only[0] == table.version:
            ids = table.ids[:, : only[1]]
            in_ddr_only = (self.entries.hbm[ids] == NONE) & (self.entries.ddr[ids] != NONE)
            assert not in_ddr_only.any(), f"seq {seq}: a block came to DDR only, version unchanged"
        at = table.homeless_at
        if at is not None and at[0] == table.version:  # a change of copies without a version change
            assert at[1] == bool(table.archive_only().any()), f"seq {seq}: archive-only blocks, version unchanged"
