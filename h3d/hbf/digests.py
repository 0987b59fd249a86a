"""Block digests: per block and KV head, the element-wise min and max of its keys (post-RoPE).

Quest's bound: for a query q, `sum_d max(q_d * min_d, q_d * max_d)` is >= q . k for every key k of
the block, so ranking blocks by it never ranks a block below its true best key's score.

A block's digest is kept per `digest_tokens` tokens (config key, default `DIGEST_TOKENS` = 8: four
parts of a 32-token block) and its bound is the larger of its parts': the bound of a narrower range
is tighter, so a block holding one relevant token stands out more (Quest found 16-token pages
better than larger ones; on the 8K retrieval benchmark 8-token parts found more needles than
16-token ones: docs/BENCHMARKS.md, "Retrieval quality per HBF policy and budget").

Digests live on the compute device for every block of every session in the layers that select
(not the first `dense_layers`, which read every block, nor a sliding-window layer, which reads its
window), in one *arena* [Ls, Hkv, rows, 2, D] in the KV dtype, Ls those layers (`layers`; `index`
gives a layer's place): each session's digests are
one extent of it, a run of rows (`base(seq)` onwards, one row per part), grown by a quarter. A
decode step captured as a CUDA graph reads the arena by its address and each batch slot's extent by
its base row, a static input (`h3d.engine.graphs`): the graph does not depend on which sessions
fill its slots. Rows [0, parts) are the null extent, no session's: a slot without a selecting
session folds its key there. Cost: 2 * head_dim * element size per part and KV head, i.e.
1 / digest_tokens of the selecting layers' KV (1/8 by default): 3 KV heads x 64 dims x fp32 x 4
parts = 6 KiB per 32-token block of all heads, 168 MiB for a 32K-token session of the embedded
model (28 of its 30 layers select); 1/16 with `digest_tokens = 16`.

A block shared by several sessions (a fork, a prefix reused: `KVCache.fork`) shares its digests
too: a session's first `shared` parts may be another session's (its *source*) first rows, read
where they lie, and its own extent holds its parts from `shared` on (`share`). Its rows are then
two runs: the source's [0, shared) and its own; `base(seq)` is virtual (its own start less
`shared`, so that part p >= shared lies at base + p) and `source(seq)` gives the source's start
and `shared` (the selection kernels read part p < shared at the source's start + p). A source is a
session whose rows are all its own (a fork of a fork shares the first one's source, or copies
where it shares past it). Shared parts are of whole blocks: no key is ever folded into them again
but the same ones (a repair, a rebuild). Before a source's shared parts change (dropped, cut,
loaded again) its readers take their own copies of them (`_own`), as does a reader before it
writes or cuts below `shared`.

Owner: `DigestStore`, updated by the model runner as K rows are written (the partial last block's
digest is kept current token by token). What must stay true: extents never overlap, and a
session's rows past its written keys hold the empty sentinels (+max as the min, -max as the max);
an extent moves only between steps (`ensure`, `drop`), and the arena tensor is replaced only when
it must grow or may shrink (never below the rows reserved at start: on CUDA, every block the
tiers hold), which bumps `generation` (a graph captured before reads the old address: it is
captured again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h3d.errors import OutOfBlocks
from h3d.kv.blocks import SeqId

DIGEST_TOKENS = 8  # tokens per digest by default: a block of block_size tokens has block_size / 8 parts
# `DigestStore.update`: a chunk of this many keys or fewer folds them all by scatter (a chat's next
# turn: launches, not the device, set its time, docs/BENCHMARKS.md)
SCATTER_KEYS = 256
# A session's digests of its first blocks, [Hkv, nb, parts, 2, D]: one view of the arena, or two
# (its source's rows, then its own: `DigestStore.share`), read as one by `block_scores`
Digests = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


DIGEST_ROOM_ADVICE = (
    "close or release sessions, set digest_tokens to 16 (half the digests), or lower hbm_mb to leave the device "
    "more room"
)


def _cuda_free(device: torch.device) -> Callable[[], int]:
    def free() -> int:
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0] + cached)

    return free


def digest_layers(full_layers: Sequence[int], dense_layers: int) -> list[int]:
    """The layers that keep digests: the full-attention ones past the dense ones (the others never
    select)."""
    return [layer for layer in full_layers if layer >= dense_layers]


@dataclass(slots=True)
class _Incoming:
    layer: Callable[[int], torch.Tensor]  # i -> layer i's rows, once they came
    rows: int
    left: set[int]  # the layers not copied in yet


@dataclass(slots=True)
class _Extent:
    """A session's rows of the arena: [start, start + rows), of which the first `used` hold (or
    were asked for) its parts; the rest is slack for growth, which a full arena takes back."""

    start: int
    rows: int
    used: int = 0
    src: SeqId | None = None  # parts [0, shared) are this session's first rows (`share`)
    shared: int = 0  # parts read from `src`: the rows above hold parts shared, shared + 1, ...


class DigestStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        part_tokens: int = DIGEST_TOKENS,
        blocks: int = 0,
        layers: Sequence[int] | None = None,
    ) -> None:
        """`blocks`: per layer, the blocks whose digests the arena holds from the start (the
        tiers' blocks: it grows past them only for sessions whose blocks lie in the archive;
        each growth replaces the arena, and captured steps are captured again). `layers`: those
        whose digests are kept (all by default; the layers that never select keep none: a
        sliding-window layer, a dense one). The arena holds the kept layers only: its first
        dimension is their rank in `layers` (`index`)."""
        self.layers = tuple(range(num_layers)) if layers is None else tuple(sorted(layers))
        self.shape = (len(self.layers), num_kv_heads)
        self._index = [-1] * num_layers
        for i, layer in enumerate(self.layers):
            self._index[layer] = i
        self.head_dim = head_dim
        self.block_size = block_size
        self.parts = max(1, block_size // part_tokens)
        self.part_tokens = block_size // self.parts
        self.dtype = dtype
        self.device = device
        self._extents: dict[SeqId, _Extent] = {}
        self._readers: dict[SeqId, set[SeqId]] = {}  # a source -> the sessions sharing its first rows
        self._reserved = self.parts * (1 + blocks)  # the arena never shrinks below this
        self._arena = self._empty(self._reserved)  # [L, Hkv, rows, 2, D]: the null extent first
        self._top = self.parts  # rows past here are free (holes below it are reclaimed by `_compact`)
        self.generation = 0  # bumped whenever `_arena` is replaced (captured steps read it by address)
        self.compactions = 0  # extents packed (`_compact`): each copies the extents above a hole
        # Sessions whose first rows still arrive (`load_later`): their source and the layers left
        self._incoming: dict[SeqId, _Incoming] = {}
        self.failed: list[tuple[SeqId, int]] = []  # (session, layer) whose rows could not come
        self.rebuild: Callable[[SeqId, int], None] | None = None  # makes them (the KV cache's)
        self.layers_rebuilt = 0  # by `rebuild`, since start
        # The device memory a larger arena may take (bytes; None: no limit, a CPU host's). Growing
        # the arena allocates the new one beside the old: `missing` checks that before a request.
        self.free_bytes: Callable[[], int] | None = _cuda_free(device) if device.type == "cuda" else None

    def _empty(self, rows: int) -> torch.Tensor:
        d = torch.empty((*self.shape, rows, 2, self.head_dim), dtype=self.dtype, device=self.device)
        self._clear(d)
        return d

    def _clear(self, d: torch.Tensor) -> None:
        """The empty sentinels: a part with no key bounds nothing."""
        d[..., 0, :] = torch.finfo(self.dtype).max  # running min
        d[..., 1, :] = torch.finfo(self.dtype).min  # running max

    # ---- the arena's extents -------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return self._arena.shape[2]

    def ensure(self, seq: SeqId, num_parts: int) -> torch.Tensor:
        """Room for `num_parts` parts of `seq`: its own rows [L, Hkv, capacity, 2, D] (from part
        `shared` on, where it shares its first parts: `share`). May move extents (between steps
        only: a captured step reads each slot's base as an input)."""
        ext = self._extents.get(seq)
        if ext is not None:
            num_parts = max(1, num_parts - ext.shared)
        if ext is not None and ext.rows >= num_parts:
            ext.used = max(ext.used, num_parts)
            return self._arena[:, :, ext.start : ext.start + ext.rows]
        old = ext.rows if ext is not None else 0
        # Grown by a quarter (not doubled): a long prompt's digests are large, and doubling them
        # at its first decode step would take twice their memory at once. Within what the arena
        # holds (the tiers' blocks, reserved at start) the slack is at most an equal share of
        # what is left, so that sessions filling the tiers never make the arena grow (a second
        # arena beside the first: on a GPU that is tens of GiB), and no one session takes all
        # that is left (the others would then move, and compact the arena, at each new part).
        rows = max(num_parts, 5 * (old or 4) // 4)
        left = self.rows - self.parts - (sum(e.rows for e in self._extents.values()) - old)
        if rows > num_parts and rows > left:
            share = (left - num_parts) // (len(self._extents) + (ext is None))
            rows = max(num_parts, min(rows, num_parts + share))
        if ext is not None and ext.start + ext.rows == self._top and ext.start + rows <= self.rows:
            self._clear(self._arena[:, :, ext.start + old : ext.start + rows])  # the last extent grows in place
            self._top = ext.start + rows
            ext.rows = rows
            ext.used = num_parts
        else:
            # Its rows leave the arena while the others are packed (they need no room twice).
            saved = None
            if ext is not None:
                saved = self._arena[:, :, ext.start : ext.start + old].clone()
                del self._extents[seq]
            try:
                start = self._claim(rows)
            except OutOfBlocks:  # no room to grow: its rows back as they were (the arena held them)
                if ext is not None and saved is not None:
                    back = self._claim(old)
                    self._arena[:, :, back : back + old] = saved
                    ext.start = back
                    self._extents[seq] = ext
                raise
            view = self._arena[:, :, start : start + rows]
            self._clear(view[:, :, old:])
            if saved is not None:
                view[:, :, :old] = saved
            src, shared = (ext.src, ext.shared) if ext is not None else (None, 0)
            self._extents[seq] = _Extent(start, rows, num_parts, src, shared)
        ext = self._extents[seq]
        return self._arena[:, :, ext.start : ext.start + ext.rows]

    def _claim(self, rows: int) -> int:
        """The first of `rows` free rows at the top, compacting or growing the arena if needed."""
        if self._top + rows > self.rows:
            self._compact()
        if self._top + rows > self.rows:
            self._compact(spread=rows)  # the others' slack shared out anew before the arena grows
        if self._top + rows > self.rows:  # room for these rows, and a quarter more of what the others hold
            self._resize(self._top + rows + (self._top - self.parts) // 4)
        start = self._top
        self._top += rows
        return start

    def _compact(self, spread: int | None = None) -> None:
        """Pack the extents down from the null extent, in order (holes of dropped or moved ones
        are reclaimed). With `spread` (rows about to be claimed), each extent's slack is given
        anew: its used rows and an equal share of what those rows leave free, so that sessions
        growing side by side do not each need another compaction at their next part."""
        self.compactions += 1
        extents = sorted(self._extents.values(), key=lambda e: e.start)
        if spread is not None:
            for ext in extents:  # rows past `used` hold no keys (cleared when they were given)
                ext.rows = max(1, ext.used)
        at = self.parts
        for ext in extents:
            if ext.start != at:
                self._move(ext, at)
            at += ext.rows
        self._top = at
        if spread is None or not extents:
            return
        share = max(0, self.rows - self._top - spread) // len(extents)
        if not share:
            return
        # Then each extent moves up by the shares of those below it, the last first (its rows
        # above are free), and its share is cleared.
        for i in range(len(extents) - 1, -1, -1):
            ext = extents[i]
            self._move(ext, ext.start + i * share)
            self._clear(self._arena[:, :, ext.start + ext.rows : ext.start + ext.rows + share])
            ext.rows += share
        self._top += len(extents) * share

    def _move(self, ext: _Extent, start: int) -> None:
        """An extent's rows copied to `start` (its ranges may overlap)."""
        if start == ext.start:
            return
        src = self._arena[:, :, ext.start : ext.start + ext.rows]
        if abs(start - ext.start) < ext.rows:  # overlapping ranges: copy through a temporary
            src = src.clone()
        self._arena[:, :, start : start + ext.rows] = src
        ext.start = start

    def holds(self, parts: int) -> bool:
        """Whether the arena as it is holds `parts` more parts beside every session's (no growth)."""
        return self.parts + sum(e.used for e in self._extents.values()) + parts <= self.rows

    def missing(self, parts: int) -> int:
        """The device memory (bytes) the arena lacks to hold `parts` more parts beside every
        session's (0: it holds them, or may grow to); a request that would make it grow past the
        device's free memory is refused (`KVCache.admit`) rather than failing inside a step."""
        need = self.parts + sum(e.used for e in self._extents.values()) + parts
        if need <= self.rows or self.free_bytes is None:
            return 0
        grown = (need + need // 4) * self.row_bytes  # (`_claim` grows it by a quarter more)
        return max(0, grown - self.free_bytes())

    def _resize(self, rows: int) -> None:
        """A new arena of `rows` rows holding the extents packed (captured steps are invalidated)."""
        try:
            arena = self._empty(max(rows, self.parts))
        except torch.OutOfMemoryError as e:
            raise OutOfBlocks(
                f"the device cannot hold the digests of every open session's blocks ({rows * self.row_bytes >> 20} "
                f"MiB beside {self._arena.nbytes >> 20} MiB now): {DIGEST_ROOM_ADVICE}"
            ) from e
        at = self.parts
        for ext in sorted(self._extents.values(), key=lambda e: e.start):
            arena[:, :, at : at + ext.rows] = self._arena[:, :, ext.start : ext.start + ext.rows]
            ext.start = at
            at += ext.rows
        self._arena, self._top = arena, at
        self.generation += 1

    def has(self, seq: SeqId) -> bool:
        return seq in self._extents

    def base(self, seq: SeqId) -> int:
        """The arena row of `seq`'s first part (it moves only in `ensure` and `drop`); where its
        first `shared` parts are another session's (`source`), the row its part p >= shared lies
        at is base + p."""
        ext = self._extents[seq]
        return ext.start - ext.shared

    def source(self, seq: SeqId) -> tuple[int, int]:
        """(the arena row of the source's first part, the parts shared): (0, 0) where `seq`'s
        rows are all its own."""
        ext = self._extents[seq]
        if ext.src is None:
            return 0, 0
        return self._extents[ext.src].start, ext.shared

    def extent_rows(self, seq: SeqId) -> int:
        """The arena rows `seq` holds as its own (its slack included; rows it shares not)."""
        ext = self._extents.get(seq)
        return 0 if ext is None else ext.rows

    def lends(self, seq: SeqId) -> bool:
        """Other sessions read `seq`'s first rows (`share`): dropping them would copy them for each."""
        return seq in self._readers

    def shared_parts(self) -> int:
        """The parts read from another session's rows, over all sessions (the rows sharing saves)."""
        return sum(e.shared for e in self._extents.values())

    # ---- shared rows ---------------------------------------------------------------------------

    def share(self, seq: SeqId, parent: SeqId, num_blocks: int, copied: int = 0) -> None:
        """`seq`'s digests of its first `num_blocks` blocks (whole blocks of `parent`'s: the same
        keys) are read from `parent`'s rows, or from its source's where `parent` shares them too;
        the next `copied` blocks' (a partial block copied on write) are copied into `seq`'s own
        rows, empty past them. Where `parent` shares fewer blocks than that, all are copied
        (one source per session)."""
        with torch.inference_mode(self._arena.is_inference()):  # (an arena made in it is changed only in it)
            self._share(seq, parent, num_blocks, copied)

    def _share(self, seq: SeqId, parent: SeqId, num_blocks: int, copied: int) -> None:
        self.drop(seq)
        if self._incoming:
            self.settle(parent)
        pext, parts = self._extents[parent], self.parts
        shared = num_blocks * parts
        if pext.src is not None and shared > pext.shared:
            self.load(seq, self.head(parent, num_blocks + copied).clone())  # (a view: `load` may move it)
            return
        root = pext.src if pext.src is not None else parent
        rows = max(1, copied) * parts
        start = self._claim(rows)
        view = self._arena[:, :, start : start + rows]
        self._clear(view)
        if copied:
            view[:, :, : copied * parts] = self._rows(parent, self._arena, shared + copied * parts)[:, :, shared:]
        self._extents[seq] = _Extent(start, rows, copied * parts, root, shared)
        self._readers.setdefault(root, set()).add(seq)

    def _own(self, seq: SeqId) -> None:
        """`seq`'s shared parts copied into rows of its own (before they may change, or it writes
        below them): its rows one run again."""
        if self._extents[seq].src is not None:
            with torch.inference_mode(self._arena.is_inference()):
                self._copy_shared(seq)

    def _copy_shared(self, seq: SeqId) -> None:
        ext = self._extents[seq]
        assert ext.src is not None
        src, shared = self._extents[ext.src], ext.shared
        head = self._arena[:, :, src.start : src.start + shared].clone()
        mine = self._arena[:, :, ext.start : ext.start + ext.rows].clone()
        self._unlink(seq)
        del self._extents[seq]
        if ext.start + ext.rows == self._top:
            self._top = ext.start
        rows = shared + ext.rows
        start = self._claim(rows)
        self._arena[:, :, start : start + shared] = head
        self._arena[:, :, start + shared : start + rows] = mine
        self._extents[seq] = _Extent(start, rows, shared + ext.used)

    def _unlink(self, seq: SeqId) -> None:
        ext = self._extents[seq]
        if ext.src is not None:
            readers = self._readers[ext.src]
            readers.discard(seq)
            if not readers:
                del self._readers[ext.src]
            ext.src, ext.shared = None, 0

    def _free_readers(self, seq: SeqId, first: int = 0) -> None:
        """The sessions sharing `seq`'s parts from `first` on take their own copies (`seq`'s rows
        there are about to change)."""
        for reader in [r for r in self._readers.get(seq, ()) if self._extents[r].shared > first]:
            self._own(reader)

    def arena(self, layer: int) -> torch.Tensor:
        """One layer of the arena: [Hkv, rows, 2, D] (min, max); a session's parts from its base."""
        return self._arena[self.index(layer)]

    def keeps(self, layer: int) -> bool:
        """Whether `layer` keeps digests (it selects)."""
        return self._index[layer] >= 0

    def index(self, layer: int) -> int:
        """`layer`'s place in the arena's first dimension (in `layers`); KeyError if it keeps none."""
        i = self._index[layer]
        if i < 0:
            raise KeyError(f"layer {layer} keeps no digests")
        return i

    def reserve(self, seq: SeqId, num_blocks: int) -> None:
        """Room for `num_blocks` blocks of `seq` now (a session whose length is known: no growth,
        and no copy of the old digests beside the new ones, later)."""
        self.ensure(seq, num_blocks * self.parts)

    # ---- rows that arrive later ----------------------------------------------------------------

    def load_later(self, seq: SeqId, num_rows: int, layer: Callable[[int], torch.Tensor]) -> None:
        """`load` of rows that arrive one layer at a time: `layer(i)` waits for the rows of
        `layers[i]` ([Hkv, num_rows, 2, D]) and returns them, or raises ValueError (they cannot come). Each
        layer is copied in when first read (`get`: a resumed session's first step selects in a
        layer while the next layers' rows are still read), every layer before anything else
        touches the session's rows (`settle`). `rebuild(seq, layer)` (`failed`) makes a layer's
        rows where they cannot come."""
        self.drop(seq)
        self.ensure(seq, num_rows)
        self._incoming[seq] = _Incoming(layer, num_rows, set(range(self.shape[0])))  # (arena indices)

    def settle(self, seq: SeqId | None = None, layer: int | None = None) -> None:
        """Copy in the rows still to arrive (`load_later`): `seq`'s (everyone's: None), one layer
        or all of them."""
        at = None if layer is None else self._index[layer]
        for s in [seq] if seq is not None else list(self._incoming):
            incoming = self._incoming.get(s)
            if incoming is None:
                continue
            indices = sorted(incoming.left) if at is None else [at] if at in incoming.left else []
            for i in indices:
                incoming.left.discard(i)
                try:
                    rows = incoming.layer(i)
                except ValueError:  # its rows keep the empty sentinels: rebuilt by the owner
                    self.failed.append((s, self.layers[i]))
                    continue
                ext = self._extents[s]
                self._arena[i, :, ext.start : ext.start + incoming.rows].copy_(rows)
            if not incoming.left:
                del self._incoming[s]
        if self.failed and self.rebuild is not None:
            failed, self.failed = self.failed, []
            for s, i in failed:
                self.rebuild(s, i)
                self.layers_rebuilt += 1

    # ---- reading and writing a session's digests -------------------------------------------------

    def get(self, seq: SeqId, layer: int, num_blocks: int) -> Digests:
        """[Hkv, num_blocks, parts, 2, D]: (min, max) of the keys of each part of each block, a view
        of the arena; where `seq` reads its first blocks' from its source's rows and has own ones
        past them, two views (those blocks', then the rest), nothing copied (`block_scores` reads
        them as one; `joined` makes one tensor of them)."""
        if self._incoming:
            self.settle(seq, layer)
        ext, arena, p = self._extents[seq], self._arena[self.index(layer)], self.parts
        hkv, d = arena.shape[0], self.head_dim
        n = num_blocks * p
        if ext.src is None or n <= ext.shared:
            start = ext.start if ext.src is None else self._extents[ext.src].start
            return arena[:, start : start + n].view(hkv, num_blocks, p, 2, d)
        src = self._extents[ext.src].start
        head = arena[:, src : src + ext.shared].view(hkv, ext.shared // p, p, 2, d)
        return head, arena[:, ext.start : ext.start + n - ext.shared].view(hkv, num_blocks - ext.shared // p, p, 2, d)

    def _rows(self, seq: SeqId, arena: torch.Tensor, n: int) -> torch.Tensor:
        """`seq`'s first n parts of `arena` (the whole arena, or one layer's: parts are its
        second-to-last dimension but two)."""
        ext = self._extents[seq]
        if ext.src is None:
            return arena[..., ext.start : ext.start + n, :, :]
        src = self._extents[ext.src].start
        if n <= ext.shared:
            return arena[..., src : src + n, :, :]
        head = arena[..., src : src + ext.shared, :, :]
        return torch.cat([head, arena[..., ext.start : ext.start + n - ext.shared, :, :]], dim=-3)

    def update(self, seq: SeqId, layer: int, start: int, k: torch.Tensor) -> None:
        """Fold the keys of positions start, start + 1, ... into their parts' digests. k: [n, Hkv, D].

        Whole parts (a long chunk's) take one min/max reduction each; the partial parts at either
        end fold their keys in by scatter, so a partial part grows token by token; a short chunk's
        keys (`SCATTER_KEYS` or fewer) all go by scatter. No host sync."""
        n = k.shape[0]
        if not n:
            return
        incoming = self._incoming.get(seq)
        if incoming is not None and start // self.part_tokens < incoming.rows:  # (past them: no need to wait)
            self.settle(seq, layer)
        pt = self.part_tokens
        ext = self._extents.get(seq)
        if ext is not None and start // pt < ext.shared:  # (keys written again below its shared parts)
            self._own(seq)
        last = (start + n - 1) // self.block_size + 1
        d = self.ensure(seq, last * self.parts)[self.index(layer)]  # [Hkv, cap, 2, D]
        shift = self._extents[seq].shared  # its own rows begin at that part
        start -= shift * pt
        kt = k.transpose(0, 1).to(self.dtype)  # [Hkv, n, D]
        a = min(n, -start % pt)  # keys before the first part boundary
        b = a + (n - a) // pt * pt  # the end of the whole parts
        if n <= SCATTER_KEYS:
            a = b = n  # every key by scatter: four launches, where whole parts and their ends took ten
        if b > a:
            first, whole = (start + a) // pt, kt[:, a:b].unflatten(1, (-1, pt))  # [Hkv, m, pt, D]
            span = slice(first, first + whole.shape[1])
            d[:, span, 0] = torch.minimum(d[:, span, 0], whole.amin(dim=2))
            d[:, span, 1] = torch.maximum(d[:, span, 1], whole.amax(dim=2))
        for lo, hi in ((0, a), (b, n)):
            if hi > lo:
                parts = torch.arange(start + lo, start + hi, device=self.device) // pt  # [m]: each key's part
                idx = parts[None, :, None].expand(kt.shape[0], -1, self.head_dim)  # [Hkv, m, D]
                d[:, :, 0].scatter_reduce_(1, idx, kt[:, lo:hi], reduce="amin", include_self=True)
                d[:, :, 1].scatter_reduce_(1, idx, kt[:, lo:hi], reduce="amax", include_self=True)

    def head(self, seq: SeqId, num_blocks: int) -> torch.Tensor:
        """The kept layers' digests of `seq`'s first `num_blocks` blocks: [len(layers), Hkv, num_blocks * parts, 2, D]
        (a view of the arena, or a copy where it shares its first parts: a snapshot copies it,
        `h3d.tiers.digestfile`)."""
        if self._incoming:
            self.settle(seq)
        return self._rows(seq, self._arena, num_blocks * self.parts)

    def load(self, seq: SeqId, rows: torch.Tensor) -> None:
        """Take `rows` ([L, Hkv, blocks * parts, 2, D], as `head` gives them) as the digests of
        `seq`'s first blocks; the parts past them keep the empty sentinels."""
        self._incoming.pop(seq, None)
        if seq in self._extents:
            self._free_readers(seq)
            if self._extents[seq].src is not None:
                self.drop(seq)
        n = rows.shape[2]
        d = self.ensure(seq, n)
        for layer in range(rows.shape[0]):  # a layer at a time: a copy's staging is a layer's size
            d[layer, :, :n].copy_(rows[layer])

    def layer(self, seq: SeqId, layer: int) -> torch.Tensor:
        """One layer of the session's own rows: [Hkv, capacity * parts, 2, D] (min, max), from part
        `shared` on where it shares its first parts."""
        ext = self._extents[seq]
        return self._arena[self.index(layer), :, ext.start : ext.start + ext.rows]

    def fold(self, layer: int, rows: torch.Tensor, k: torch.Tensor) -> None:
        """`update` of one new key per batch slot whose arena row is in a tensor (a decode step
        captured in a CUDA graph: no host value is read). k: [B, Hkv, D]; rows: [B] int64 on the
        device, each slot's part (its base + position // part_tokens; the null extent's row 0 for
        a slot that keeps no digests). The extents must already hold their parts (`ensure`)."""
        d = self._arena[self.index(layer)]  # [Hkv, rows, 2, D]
        idx = rows.view(1, -1, 1).expand(d.shape[0], -1, self.head_dim)  # [Hkv, B, D]
        kt = k.transpose(0, 1).to(self.dtype)  # [Hkv, B, D]
        d[:, :, 0].scatter_reduce_(1, idx, kt, reduce="amin", include_self=True)
        d[:, :, 1].scatter_reduce_(1, idx, kt, reduce="amax", include_self=True)

    def truncate(self, seq: SeqId, num_tokens: int, tail: Callable[[int, int], torch.Tensor]) -> None:
        """Forget the keys past `num_tokens`: the parts after it start over, and the part it ends in
        is folded again from `tail(layer, start)`, its kept keys ([n, Hkv, D] from position start)."""
        if seq not in self._extents:
            return
        if self._incoming:
            self.settle(seq)
        first = num_tokens // self.part_tokens  # the first part that held a cut key
        self._free_readers(seq, first)
        if first < self._extents[seq].shared:
            self._own(seq)
        ext = self._extents[seq]
        if first - ext.shared < ext.rows:
            self._clear(self._arena[:, :, ext.start + first - ext.shared : ext.start + ext.rows])
        if num_tokens % self.part_tokens:
            start = first * self.part_tokens
            for layer in self.layers:
                self.update(seq, layer, start, tail(layer, start))

    def drop(self, seq: SeqId) -> None:
        """Forget `seq`'s digests; its rows are reclaimed by the next compaction, and the arena
        shrinks once a quarter of it is in use."""
        self._incoming.pop(seq, None)
        if seq not in self._extents:
            return
        self._free_readers(seq)
        self._unlink(seq)
        ext = self._extents.pop(seq)
        if ext.start + ext.rows == self._top:
            self._top = ext.start
        live = sum(e.rows for e in self._extents.values())
        if self.rows > max(self._reserved, 4 * (live + self.parts), 64 * self.parts):
            with contextlib.suppress(OutOfBlocks):  # (no memory for the smaller copy: the arena stays)
                self._resize(max(self._reserved, 5 * (live + self.parts) // 4))

    @property
    def row_bytes(self) -> int:
        """The bytes of one part's digests, every layer that keeps them and KV head."""
        return self.shape[0] * self.shape[1] * 2 * self.head_dim * self._arena.element_size()

    def nbytes(self) -> int:
        """The bytes the sessions' extents hold (the arena may hold more; rows shared count once)."""
        return self.row_bytes * sum(e.rows for e in self._extents.values())


def joined(digests: Digests) -> torch.Tensor:
    """`DigestStore.get`'s digests as one tensor (a copy where they are two views)."""
    return torch.cat(digests, dim=1) if isinstance(digests, tuple) else digests


def block_scores(q: torch.Tensor, digests: Digests, per_head: bool = False) -> torch.Tensor:
    """Quest upper bound per block, max over all query heads (or over each KV head's group).

    q: [H, D] (one token's queries); digests: [Hkv, nb, 2, D], or [Hkv, nb, parts, 2, D] (a block's
    bound is its parts' largest), or two such of consecutive blocks (`DigestStore.get`) -> [nb]
    fp32 ([Hkv, nb] `per_head`). Each query head is scored against its KV head's digest (GQA groups
    of H / Hkv heads).
    """
    if isinstance(digests, tuple):
        scores = torch.cat([block_scores(q, run, per_head=True) for run in digests], dim=1)
        return scores if per_head else scores.amax(dim=0)
    if digests.dim() == 5:
        hkv, nb, parts = digests.shape[:3]
        flat = block_scores(q, digests.reshape(hkv, nb * parts, 2, -1), per_head=True)  # [Hkv, nb * parts]
        per_block = flat.view(hkv, nb, parts).amax(dim=2)
        return per_block if per_head else per_block.amax(dim=0)
    h, d = q.shape
    hkv = digests.shape[0]
    # sum_d max(q_d lo_d, q_d hi_d) = hi . max(q, 0) + lo . min(q, 0): two small matrix products
    # in the digests' dtype instead of an elementwise [Hkv, G, nb, D] tensor.
    qg = q.to(digests.dtype).view(hkv, h // hkv, d).transpose(1, 2)  # [Hkv, D, G]
    lo, hi = digests[:, :, 0], digests[:, :, 1]  # [Hkv, nb, D]
    bound = (torch.bmm(hi, qg.clamp(min=0)) + torch.bmm(lo, qg.clamp(max=0))).float()  # [Hkv, nb, G]
    return bound.amax(dim=2) if per_head else bound.amax(dim=(0, 2))  # [Hkv, nb] or [nb]
