"""Fair HBM: how the sessions that decode together share each layer's HBM region, and the moves
that bring the tiers there.

Without a rule the first session to arrive keeps every HBM slot it got and the later ones read
from DDR (on the H200, four 16K sessions ended with hit rates from 0.997 down to 0.0025). The rule:

- a pinned session keeps what it holds;
- the rest of a layer's region goes to the *active* sessions (a request in flight), each at most
  its *demand*: the blocks its policy reads in that layer every step (every block under `exact`
  and in the dense layers, sinks + the recent window + the window of HBF's picks in a sparse
  layer);
- first a floor, min(demand, rest / (2 x active)), then what is left in proportion to what each
  still wants (`shares`);
- an idle session has no share: its blocks go down first when an active one needs room.

`HbmShares.rebalance` moves toward the shares between steps, at most `budget` blocks a call: an
active session above its share gives up its least valuable blocks (HBF's rank: recency +
hotness; a DDR copy kept), then a session below its share gets its DDR-only blocks copied up into
the free slots, the most valuable first. `room` caps what `Promoter.fill_hbm` copies up for a
session at its share, so that what one call takes away the next step does not bring back.

Owner: the shares (recomputed when the active sessions change, or every `REFRESH_STEPS` steps as
contexts grow).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from h3d.kv.blocks import NONE, SeqId

if TYPE_CHECKING:
    from h3d.tiers.manager import TierManager
    from h3d.tiers.promotion import Promoter

REFRESH_STEPS = 64  # shares recomputed this often while the active sessions stay the same (contexts grow)
FLOOR_PART = 0.5  # of a layer's shared slots, this part is the floor split equally between active sessions


def shares(capacity: int, demands: np.ndarray, floor_part: float = FLOOR_PART) -> np.ndarray:
    """Each active session's slots of one layer region of `capacity` slots, for `demands` (blocks
    each reads per step): never above its demand, in all at most `capacity`; a floor of
    min(demand, floor_part x capacity / n) each, the rest in proportion to what each still wants.
    Everyone gets its demand where the demands fit."""
    demands = np.maximum(np.asarray(demands, dtype=np.int64), 0)
    n = len(demands)
    if n == 0 or capacity <= 0:
        return np.zeros(n, dtype=np.int64)
    if demands.sum() <= capacity:
        return demands.copy()
    floor = np.minimum(demands, int(floor_part * capacity) // n)
    want = demands - floor
    left = capacity - int(floor.sum())
    extra = want * left // max(1, int(want.sum()))  # floored: the total stays within capacity
    return floor + np.minimum(extra, want)


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
        out = np.stack([shares(int(max(c, 0)), demand[:, layer]) for layer, c in enumerate(caps)], axis=1)
        self.target = {s: out[i] for i, s in enumerate(unpinned)}
        # Where every demand fits, a share caps nothing (a session growing between two plans takes
        # free slots as before); it still says what each is owed (Stats, `rebalance`).
        self.contended = bool((demand.sum(axis=0) > caps).any())

    def held(self, seq: SeqId) -> np.ndarray:
        """`seq`'s blocks in HBM in each layer, [L]."""
        t = self.blocks.table(seq)
        return np.count_nonzero(t.hbm[:, : t.num_blocks] != NONE, axis=1)

    def room(self, seq: SeqId) -> np.ndarray | None:
        """How many more HBM blocks `seq` may take in each layer, [L]; None: no cap (HBM holds
        every active demand, or `seq` has no share: free slots are its to take)."""
        share = self.target.get(seq) if self.contended else None
        return None if share is None else np.maximum(share - self.held(seq), 0)

    def rebalance(self, budget: int, protect: dict[SeqId, int]) -> int:
        """At most `budget` blocks moved toward the shares; returns how many."""
        if not self.target or budget <= 0 or self._settled:
            return 0
        b, sessions = self.blocks, self.tiers.sessions
        under = {s: np.maximum(share - self.held(s), 0) for s, share in self.target.items()}
        wanted = sum(under.values(), np.zeros(b.num_layers, dtype=np.int64))  # [L]
        need = np.maximum(wanted - b.hbm_alloc.free, 0)  # [L] slots to free first
        moved = 0
        if need.any():
            # Idle unpinned sessions first, then active ones above their shares.
            givers = [(s, self.held(s)) for s in b.tables() if s not in self.target and not sessions[s].pinned]
            givers += [(s, np.maximum(self.held(s) - share, 0)) for s, share in self.target.items()]
            for seq, excess in givers:
                for layer in np.flatnonzero(np.minimum(excess, need) > 0).tolist():
                    count = min(int(excess[layer]), int(need[layer]), budget - moved)
                    if count <= 0:
                        break
                    done = self._demote(seq, layer, count, protect)
                    need[layer] -= done
                    moved += done
                if moved >= budget:
                    break
        for seq, room in under.items():
            if moved >= budget:
                break
            moved += self._fill(seq, np.minimum(room, b.hbm_alloc.free), budget - moved, protect)
        self.tiers.counters.hbm_rebalance_count += moved
        self._settled = moved == 0
        return moved

    def _demote(self, seq: SeqId, layer: int, count: int, protect: dict[SeqId, int]) -> int:
        """`seq`'s `count` least valuable full HBM blocks of `layer` down to DDR; how many went."""
        b = self.blocks
        t = b.table(seq)
        limit = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
        idx = np.flatnonzero(t.layer_hbm(layer)[:limit] != NONE)
        if not len(idx):
            return 0
        value = b.entries.hotness[t.ids[layer, idx]]
        idx = np.sort(idx[np.lexsort((-idx, value))[:count]])  # the lowest ranks; ties: the last blocks
        return self.tiers.demote_blocks(seq, layer, idx, list(self.target), protect, make_room=False)

    def _fill(self, seq: SeqId, room: np.ndarray, budget: int, protect: dict[SeqId, int]) -> int:
        """Copy `seq`'s most valuable DDR-only full blocks up into free HBM slots, at most `room[l]`
        in layer l and `budget` in all; how many went."""
        b = self.blocks
        t = b.table(seq)
        full = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
        layers = np.flatnonzero(room > 0)
        if not len(layers) or full <= 0:
            return 0
        ids = t.ids[layers, :full]
        li, blocks = np.nonzero((b.entries.hbm[ids] == NONE) & (b.entries.ddr[ids] != NONE))
        if not len(li):
            return 0
        value = b.entries.hotness[ids[li, blocks]]
        order = np.lexsort((blocks, -value, li))  # per layer, the most valuable first
        li, blocks = li[order], blocks[order]
        within = np.arange(len(li)) - np.searchsorted(li, li)  # rank within its layer
        ok = within < room[layers[li]]
        lay, blocks = layers[li[ok]][:budget], blocks[ok][:budget]
        if not len(lay):
            return 0
        keep = np.lexsort((blocks, lay))  # `add_hbm_many` takes layers ascending
        lay, blocks = lay[keep], blocks[keep]
        src = b.entries.ddr[t.ids[lay, blocks]]
        self.promoter.copy_up(src, b.add_hbm_many(seq, lay, blocks))
        return len(lay)
