"""Free lists over the slots of a KV pool: one stack for DDR (`SlotAllocator`), one per layer
region for HBM as rows of one array (`LayeredAllocator`), so that a step's promotions and
evictions over all layers are a few vectorized operations.

Owner: `h3d.kv.blocks.BlockManager` is the only caller. What must stay true: a slot is either
free (on exactly one stack, its owner `FREE`), owned (by a session, or `SHARED`), or released
while held (`HELD`: a DDR slot that an archive write still reads, free again once it is let go);
the null slot (0) is never handed out; a lone session gets ascending, contiguous slots.

Sessions that decode side by side take their blocks' slots by turns, and give them back in any
order: a prompt that takes them next lies in dozens of runs of the pool (63 for a 32K-token
prompt on an H100, after the warm-up's sessions), and a chunk that reads it attends run by run
or gathers it (`h3d.kv.attention.MAX_RUNS`). So slots given back together go on their stack
lowest on top, and before a long append (`BlockManager.append`, `TIDY_BLOCKS` blocks a layer or
more) the stacks that took slots back since are sorted, `tidy`: the lowest free slots are handed
out first, ascending, contiguous where they are; DDR's stack only where the append spills that
many there. (Not at every allocation: a decode step's demotions give slots back and its fills
take them, and a sort of each layer's stack would cost more than it saves there. A sort costs
about 2 ms for 32 layers of 11,600 slots and 5 ms for 800,000 DDR slots, 100 GB of an 8B
model's blocks, with numpy on one core.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NewType

import numpy as np

from h3d.errors import OutOfBlocks

SeqId = NewType("SeqId", int)  # a session's KV, as the engine numbers them
NULL_SLOT = 0
FREE = -1
HELD = -2  # released by its owner while an archive write still reads it: free once let go
SHARED = -3  # a block's that several sessions share (or did): owned by every session pointing at it


class SlotAllocator:
    """Free list over the slots [first, first + capacity) of one pool. Owner: BlockManager.

    `owner` is shared by every allocator of a pool (indexed by slot id).
    """

    def __init__(self, first: int, capacity: int, owner: np.ndarray, usable: int | None = None) -> None:
        """Slots [first, first + capacity); of them only the first `usable` (all: None) until
        `grow` (a pool still being registered, `h3d.kv.pool.Pinning`)."""
        self.first = first
        self.size = capacity  # every slot it will hand out
        self.capacity = capacity if usable is None else max(0, min(usable, capacity))  # those it may now
        # A stack of free slots, lowest on top: a lone session gets ascending, contiguous slots.
        self._stack = np.empty(capacity, dtype=np.int64)
        self._stack[: self.capacity] = np.arange(first + self.capacity - 1, first - 1, -1, dtype=np.int64)
        self._top = self.capacity
        self.owner = owner
        self._holds = np.zeros(len(owner), dtype=np.int32)  # readers of each slot (`hold`)
        self._untidy = False  # slots came back since the last `tidy`

    def tidy(self) -> None:
        """The free slots in order, the lowest on top (the module's docstring)."""
        if self._untidy:
            self._stack[: self._top] = np.sort(self._stack[: self._top])[::-1]
            self._untidy = False

    @property
    def num_free(self) -> int:
        return self._top

    def grow(self, capacity: int) -> int:
        """Slots up to `capacity` (at most `size`) may be handed out now; they go under the free
        ones (handed out last, highest last). Returns how many came."""
        n = min(capacity, self.size) - self.capacity
        if n <= 0:
            return 0
        self._stack[n : n + self._top] = self._stack[: self._top].copy()
        end = self.first + self.capacity + n
        self._stack[:n] = np.arange(end - 1, end - n - 1, -1, dtype=np.int64)
        self.capacity += n
        self._top += n
        return n

    @property
    def num_held(self) -> int:
        """Slots released while held: neither free nor owned until let go."""
        return int(np.count_nonzero(self.owner[self.first : self.first + self.capacity] == HELD))

    def hold(self, slots: np.ndarray) -> None:
        """Keep `slots`' bytes where they are while a reader (an archive write on its own thread)
        copies them: a slot released meanwhile goes back to the free list only at `let_go`."""
        np.add.at(self._holds, slots, 1)

    def let_go(self, slots: np.ndarray) -> None:
        """The reader of `slots` is done: those released meanwhile are free again."""
        np.subtract.at(self._holds, slots, 1)
        done = np.unique(slots[(self._holds[slots] == 0) & (self.owner[slots] == HELD)])
        self.owner[done] = FREE
        self._stack[self._top : self._top + len(done)] = done[::-1]
        self._top += len(done)
        self._untidy |= len(done) > 0

    def take(self, n: int) -> np.ndarray:
        """`n` slots for a reader that fills them before they belong to anyone (an archive read
        ahead): released while held (`HELD`) until `claim`ed, or free again once let go."""
        slots = self.allocate(n, SeqId(HELD))
        self._holds[slots] += 1
        return slots

    def claim(self, slots: np.ndarray, owner: SeqId) -> None:
        """`take`n slots, filled: now `owner`'s."""
        self._holds[slots] -= 1
        self.owner[slots] = owner

    def allocate(self, n: int, owner: SeqId) -> np.ndarray:
        if n > self._top:
            raise OutOfBlocks(f"KV pool exhausted: need {n} blocks, {self._top} free")
        slots = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self.owner[slots] = owner
        return slots

    def release(self, slots: np.ndarray) -> None:
        slots = np.sort(slots[slots > NULL_SLOT])  # the lowest on top (the module's docstring)
        held = self._holds[slots] > 0
        if held.any():
            self.owner[slots[held]] = HELD
            slots = slots[~held]
        self.owner[slots] = FREE
        self._stack[self._top : self._top + len(slots)] = slots[::-1]
        self._top += len(slots)
        self._untidy |= len(slots) > 0

    def free_slots(self) -> np.ndarray:
        return self._stack[: self._top]


class LayeredAllocator:
    """One free-list stack per layer region of the HBM pool, as rows of one array, so that a step's
    promotions and evictions over all layers are a few vectorized operations (no per-layer loop).
    `self[layer]` is a `SlotAllocator`-like view of one region. Regions are consecutive: layer l's
    holds `capacities[l]` slots from `first[l]`."""

    def __init__(self, capacities: np.ndarray, owner: np.ndarray) -> None:
        capacities = np.asarray(capacities, dtype=np.int64)
        self.capacities = capacities
        first = 1 + np.cumsum(capacities) - capacities  # [L]
        # Row l is layer l's stack, lowest slot on top (the highest index in use); past its
        # capacity a row is padding, never reached.
        width = int(capacities.max(initial=0))
        below = np.arange(width - 1, -1, -1, dtype=np.int64)[None, :] - (width - capacities)[:, None]
        self._stack = first[:, None] + np.maximum(below, 0)
        self._top = capacities.copy()
        self.first = first
        self.owner = owner
        self._untidy = np.zeros(len(capacities), dtype=bool)  # per layer: slots came back since `tidy`
        self._views = [_LayerView(self, layer) for layer in range(len(capacities))]

    def tidy(self) -> None:
        """Each layer's free slots in order, the lowest on top (the module's docstring)."""
        for layer in np.flatnonzero(self._untidy).tolist():
            top = int(self._top[layer])
            self._stack[layer, :top] = np.sort(self._stack[layer, :top])[::-1]
        self._untidy[:] = False

    def __getitem__(self, layer: int) -> _LayerView:
        return self._views[layer]

    def __iter__(self) -> Iterator[_LayerView]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    @property
    def free(self) -> np.ndarray:
        """Free slots per layer, [L] (a copy)."""
        return self._top.copy()

    def allocate_many(self, layers: np.ndarray, owner: SeqId) -> np.ndarray:
        """One slot in each listed layer's region (`layers` sorted ascending); returns them."""
        if not len(layers):
            return np.empty(0, dtype=np.int64)
        counts = np.bincount(layers, minlength=len(self._top))
        short = np.flatnonzero(counts > self._top)
        if len(short):
            layer = int(short[0])
            raise OutOfBlocks(f"KV pool exhausted: layer {layer} needs {counts[layer]} blocks, {self._top[layer]} free")
        rank = np.arange(len(layers)) - (np.cumsum(counts) - counts)[layers]  # position within its layer
        slots = self._stack[layers, self._top[layers] - 1 - rank]
        self._top -= counts
        self.owner[slots] = owner
        return slots

    def release_many(self, layers: np.ndarray, slots: np.ndarray) -> None:
        """Give back `slots` (`layers` sorted ascending, each slot in its layer's region)."""
        real = slots > NULL_SLOT
        layers, slots = layers[real], slots[real]
        if not len(slots):
            return
        order = np.lexsort((slots, layers))  # in each layer the lowest on top (the module's docstring)
        layers, slots = layers[order], slots[order]
        counts = np.bincount(layers, minlength=len(self._top))
        rank = np.arange(len(layers)) - (np.cumsum(counts) - counts)[layers]
        self._stack[layers, self._top[layers] + counts[layers] - 1 - rank] = slots
        self._top += counts
        self.owner[slots] = FREE
        self._untidy |= counts > 0


class _LayerView:
    """One layer's region of a `LayeredAllocator`, with `SlotAllocator`'s interface."""

    def __init__(self, parent: LayeredAllocator, layer: int) -> None:
        self._parent = parent
        self._layer = layer
        self.first = int(parent.first[layer])
        self.capacity = int(parent.capacities[layer])

    @property
    def num_free(self) -> int:
        return int(self._parent._top[self._layer])

    def allocate(self, n: int, owner: SeqId) -> np.ndarray:
        return self._parent.allocate_many(np.full(n, self._layer, dtype=np.int64), owner)

    def release(self, slots: np.ndarray) -> None:
        self._parent.release_many(np.full(len(slots), self._layer, dtype=np.int64), slots)

    def free_slots(self) -> np.ndarray:
        return self._parent._stack[self._layer, : self._parent._top[self._layer]]
