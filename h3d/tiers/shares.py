"""Fair HBM: how the sessions that decode together share each layer's HBM region, and the moves
that bring the tiers there.

Without a rule the first session to arrive keeps every HBM slot it got and the later ones read
from DDR (on the H200, four 16K sessions ended with hit rates from 0.997 down to 0.0025). The rule,
per layer:

- a pinned session keeps what it holds;
- the rest of the region goes to the *active* sessions (a request in flight). First their
  *demands*, the blocks each one's policy reads in that layer every step (every block under
  `exact` and in the dense layers, sinks + the recent window + the window of HBF's picks in a
  sparse layer): a floor of min(demand, rest / (2 x active)) each, then in proportion to what each
  still wants (`shares`);
- what the demands leave levels the parts (water-filling: the smallest parts are raised first),
  each at most the blocks its session has: a session's picks move from step to step, and what it
  holds beyond this step's picks is what its next steps find in HBM;
- an idle session has no share: its blocks go down first when an active one needs room.

`HbmShares.rebalance` moves toward the shares between steps, at most `budget` blocks a call
(`rebalance_mb_per_step`): an active session above its share gives up its least valuable blocks
(HBF's rank: recency + hotness; a DDR copy kept), then every session below its share gets its
most valuable DDR-only blocks copied up into the free slots, each a part in proportion to what it
lacks (so the session that arrived last does not wait for all the others). `room` caps what
`Promoter.fill_hbm` copies up for a session at its share, so that what one call takes away the
next step does not bring back.

Owner: the shares (recomputed when the active sessions change, or every `REFRESH_STEPS` steps as
contexts grow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from h3d.kv.blocks import NONE, SeqId
from h3d.kv.entries import NULL_ENTRY
from h3d.tiers.promotion import sort_by_layer_and_rank

if TYPE_CHECKING:
    from h3d.tiers.manager import TierManager
    from h3d.tiers.promotion import Promoter

REFRESH_STEPS = 64  # shares recomputed this often while the active sessions stay the same (contexts grow)
FLOOR_PART = 0.5  # of a layer's shared slots, this part is the floor split equally between active sessions


def shares(
    capacity: int, demands: np.ndarray, sizes: np.ndarray | None = None, floor_part: float = FLOOR_PART
) -> np.ndarray:
    """Each active session's slots of one layer region of `capacity` slots, for `demands` (blocks
    each reads per step) and `sizes` (blocks each has; the demands where not given): first the
    demands, a floor of min(demand, floor_part x capacity / n) each and the rest in proportion to
    what each still wants; then what is left (rounding's crumbs included) levels the sessions'
    parts, each at most max(demand, size) (`_level`).
    In all at most `capacity`, each at most max(demand, size)."""
    demands = np.maximum(np.asarray(demands, dtype=np.int64), 0)
    n = len(demands)
    if n == 0 or capacity <= 0:
        return np.zeros(n, dtype=np.int64)
    if demands.sum() <= capacity:
        out = demands.copy()
    else:
        floor = np.minimum(demands, int(floor_part * capacity) // n)
        want = demands - floor
        left = capacity - int(floor.sum())
        extra = want * left // max(1, int(want.sum()))  # floored: the total stays within capacity
        out = floor + np.minimum(extra, want)
    if sizes is None:
        return out
    return _level(out, np.maximum(np.asarray(sizes, dtype=np.int64), demands), capacity)


def _level(low: np.ndarray, high: np.ndarray, capacity: int) -> np.ndarray:
    """Water-filling between `low` and `high` (sum(low) <= capacity): each gets
    clip(level, low, high) for the highest level that fits in `capacity`, and what rounding leaves
    goes one each to the first of those the next level would raise. All of `capacity` is given
    while anyone is below its `high`."""
    if int(high.sum()) <= capacity:
        return high.copy()
    lo, hi = 0, int(high.max())  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if int(np.clip(mid, low, high).sum()) <= capacity:
            lo = mid
        else:
            hi = mid
    out = np.clip(lo, low, high)
    more = np.flatnonzero((low <= lo) & (lo < high))[: capacity - int(out.sum())]
    out[more] += 1
    return out


class HbmShares:
    def __init__(self, tiers: TierManager, promoter: Promoter, demand: Callable[[SeqId], np.ndarray]) -> None:
        """`demand(seq)`: the blocks `seq`'s policy reads in each layer per step, [L]."""
        self.tiers = tiers
        self.blocks = tiers.blocks
        self.promoter = promoter
        self.demand = demand
        self.target: dict[SeqId, np.ndarray] = {}  # active session -> its share of each layer, [L]
        self._active: tuple[SeqId, ...] = ()
        self._planned_at = -REFRESH_STEPS
        self._settled = False  # the last rebalance had nothing to move (until the shares change)
        self.contended = False  # the active sessions' demands exceed HBM: `room` caps them

    def plan(self, active: list[SeqId]) -> None:
        """The shares of `active` (the sessions with a request in flight), if they changed or are
        due again."""
        key = tuple(sorted(active))
        step = self.tiers.step
        if key == self._active and step - self._planned_at < REFRESH_STEPS:
            return
        self._active, self._planned_at, self._settled = key, step, False
        b, sessions = self.blocks, self.tiers.sessions
        unpinned = [s for s in key if b.has(s) and not sessions[s].pinned]
        if not unpinned:
            self.target, self.contended = {}, False
            return
        caps = b.hbm_alloc.capacities.copy()  # [L]
        for seq in (s for s in b.tables() if sessions[s].pinned):
            caps -= self.held(seq)
        demand = np.stack([self.demand(s) for s in unpinned])  # [n, L]
        size = np.array([self._size(s) for s in unpinned], dtype=np.int64)  # [n], every layer
        demand = np.minimum(demand, size[:, None])  # (a shared block: its part of it, as `size` counts)
        caps = np.maximum(caps, 0)
        out = np.stack([shares(int(c), demand[:, layer], size) for layer, c in enumerate(caps)], axis=1)
        self.target = {s: out[i] for i, s in enumerate(unpinned)}
        # Where every active session's blocks fit, a share caps nothing (a session growing between
        # two plans takes free slots as before); it still says what each is owed (Stats).
        self.contended = bool((int(size.sum()) > caps).any())

    def _size(self, seq: SeqId) -> int:
        """`seq`'s blocks per layer; a block it shares with others counts as its part of it (1/n
        for n sessions), so that sharing sessions together count it once."""
        t = self.blocks.table(seq)
        if not self.blocks.peers(seq):
            return t.num_blocks
        ids = t.ids[:, : t.num_blocks]
        part = 1.0 / np.maximum(self.blocks.entries.refs[ids], 1)
        return int(np.ceil(part[ids != NULL_ENTRY].sum() / self.blocks.num_layers))

    def held(self, seq: SeqId) -> np.ndarray:
        """`seq`'s blocks in HBM in each layer, [L]; a block it shares counts as its part of it."""
        t = self.blocks.table(seq)
        ids = t.ids[:, : t.num_blocks]
        in_hbm = self.blocks.entries.hbm[ids] != NONE
        if not self.blocks.peers(seq):
            return np.count_nonzero(in_hbm, axis=1)
        part = 1.0 / np.maximum(self.blocks.entries.refs[ids], 1)
        return np.rint((part * in_hbm).sum(axis=1)).astype(np.int64)

    def room(self, seq: SeqId) -> np.ndarray | None:
        """How many more HBM blocks `seq` may take in each layer, [L]; None: no cap (HBM holds
        every active demand, or `seq` has no share: free slots are its to take)."""
        share = self.target.get(seq) if self.contended else None
        return None if share is None else np.maximum(share - self.held(seq), 0)

    def rebalance(self, budget: int, protect: dict[SeqId, int]) -> int:
        """At most `budget` blocks moved toward the shares; returns how many."""
        if not self.target or budget <= 0 or self._settled:
            return 0
        # Every session's copies in two launches, all those down (givers' blocks out of their
        # slots), then all those up (fills into free slots, some just freed).
        with self.tiers.mover.batched():
            moved = self._rebalance(budget, protect)
        self.tiers.counters.hbm_rebalance_count += moved
        self._settled = moved == 0
        return moved

    def _rebalance(self, budget: int, protect: dict[SeqId, int]) -> int:
        b, sessions = self.blocks, self.tiers.sessions
        held = _Held(self)
        under = {s: np.maximum(share - held[s], 0) for s, share in self.target.items()}
        wanted = sum(under.values(), np.zeros(b.num_layers, dtype=np.int64))  # [L]
        need = np.maximum(wanted - b.hbm_alloc.free, 0)  # [L] slots to free first
        moved = 0
        if need.any():
            # Idle unpinned sessions first, then active ones above their shares; at most half the
            # budget, so that the slots freed are filled in the same call.
            half = max(1, budget // 2)
            givers = [s for s in b.tables() if s not in self.target and not sessions[s].pinned]
            givers += list(self.target)
            for seq in givers:
                if moved >= half or not need.any():
                    break
                share = self.target.get(seq)
                excess = held[seq] if share is None else np.maximum(held[seq] - share, 0)
                count = np.minimum(excess, need)
                if count.any():
                    gone = self._demote(seq, _within(count, half - moved), protect)
                    held.lose(seq, gone)
                    need -= gone
                    moved += int(gone.sum())
        if moved < budget and wanted.any():
            # Each session below its share a part of the free slots in proportion to what it
            # lacks, then what is left in turn (a part rounds down; some blocks may be archive-only).
            free = b.hbm_alloc.free
            scale = (
                np.minimum(wanted, free)
                / np.maximum(wanted, 1)
                * min(1.0, (budget - moved) / max(1, int(np.minimum(wanted, free).sum())))
            )
            for seq, lack in under.items():
                moved += held.gain(seq, self._fill(seq, (lack * scale).astype(np.int64), budget - moved, protect))
            for seq, share in self.target.items():
                if moved >= budget:
                    break
                lack = np.maximum(share - held[seq], 0)
                moved += held.gain(seq, self._fill(seq, np.minimum(lack, b.hbm_alloc.free), budget - moved, protect))
        return moved

    def _demote(self, seq: SeqId, count: np.ndarray, protect: dict[SeqId, int]) -> np.ndarray:
        """`seq`'s `count[l]` least valuable full HBM blocks of each layer l down to DDR, a DDR copy
        made where there is none (only as many as DDR has room for: nothing is spilled for them);
        how many went from each layer, [L]."""
        b, e = self.blocks, self.blocks.entries
        t = b.table(seq)
        limit = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
        gone = np.zeros(b.num_layers, dtype=np.int64)
        if limit <= 0:
            return gone
        ids = t.ids[:, :limit]
        unshared = e.refs.take(ids) <= 1  # a block shared with other sessions stays put
        layers, blocks = np.nonzero((e.hbm.take(ids) != NONE) & unshared & (count > 0)[:, None])
        if not len(layers):
            return gone
        value = e.hotness.take(ids[layers, blocks])
        # per layer the lowest ranks; ties: the last blocks
        layers, last = sort_by_layer_and_rank(layers, value, limit - 1 - blocks)
        blocks = limit - 1 - last
        per = np.bincount(layers, minlength=b.num_layers)
        take = np.arange(len(layers)) - (np.cumsum(per) - per).take(layers) < count.take(layers)
        layers, blocks = layers[take], blocks[take]
        copy = e.ddr.take(ids[layers, blocks]) == NONE
        if np.count_nonzero(copy) > b.ddr_free:
            fits = ~copy | (np.cumsum(copy) <= b.ddr_free)
            layers, blocks, copy = layers[fits], blocks[fits], copy[fits]
        if not len(layers):
            return gone
        keep = np.lexsort((blocks, layers))  # layers ascending (the allocators' batched calls)
        layers, blocks, copy = layers[keep], blocks[keep], copy[keep]
        if copy.any():
            src = e.hbm.take(ids[layers[copy], blocks[copy]])
            self.tiers.mover.hbm_to_ddr(src, b.add_ddr_many(seq, layers[copy], blocks[copy]))
        b.drop_hbm_many(seq, layers, blocks)
        self.tiers.counters.hbm_evict_count += len(layers)
        return np.bincount(layers, minlength=b.num_layers)

    def _fill(self, seq: SeqId, room: np.ndarray, budget: int, protect: dict[SeqId, int]) -> np.ndarray:
        """Copy `seq`'s most valuable DDR-only full blocks up into free HBM slots, at most `room[l]`
        in layer l and `budget` in all; the layers of those that went."""
        return self.promoter.copy_up_ddr_only(seq, room, budget, protect)


class _Held:
    """`HbmShares.held` of each session, read once in a `rebalance` and kept up to date with its
    moves: a demotion moves only blocks a session has alone (each counts 1), a fill may copy up
    blocks it shares (each counts a part for each of its sessions: theirs are read again)."""

    def __init__(self, shares: HbmShares) -> None:
        self._shares = shares
        self._held: dict[SeqId, np.ndarray] = {}

    def __getitem__(self, seq: SeqId) -> np.ndarray:
        held = self._held.get(seq)
        if held is None:
            held = self._held[seq] = self._shares.held(seq)
        return held

    def lose(self, seq: SeqId, gone: np.ndarray) -> None:
        self._held[seq] = self[seq] - gone

    def gain(self, seq: SeqId, layers: np.ndarray) -> int:
        """`seq`'s blocks copied up into `layers`; how many."""
        if not len(layers):
            return 0
        peers = self._shares.blocks.peers(seq)
        if peers:
            for s in peers | {seq}:
                self._held.pop(s, None)
        else:
            self._held[seq] = self[seq] + np.bincount(layers, minlength=len(self[seq]))
        return len(layers)


def _within(count: np.ndarray, budget: int) -> np.ndarray:
    """`count` [L] cut to `budget` in all, the first layers first."""
    if int(count.sum()) <= budget:
        return count
    return np.diff(np.minimum(np.cumsum(count), budget), prepend=0)
