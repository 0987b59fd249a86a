"""The tier manager: where each block lives, and the moves that keep every step's blocks readable.

Policy `exact` (lossless): every decode step reads every block of a session, layer after layer —
a cyclic pattern on which LRU evicts exactly the block needed next. So nothing is promoted: the
blocks that got HBM slots keep them (a fixed resident subset per layer), the others are read from
DDR in place, and a session larger than HBM + DDR has the blocks of each layer staged from the SSD
archive into DDR just before that layer runs, evicting the blocks whose next use is furthest away
(the layers just computed). Idle sessions are demoted first; DDR spills to the archive past
`ddr_high_watermark`. A DDR copy is dropped only once an archive copy is durable.

Owner: the counters, the archive keys of sessions, and every decision to move a block. The
`BlockManager` records the moves (it is the one writer of residency); the `Mover` copies bytes.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from h3d.errors import OutOfBlocks
from h3d.kv.blocks import NONE, BlockManager, SeqId
from h3d.kv.pool import KVPool
from h3d.tiers.archive import Archive, BlockKey
from h3d.tiers.mover import Mover, Transfer
from h3d.tiers.stats import TierCounters, TierStats

Pair = tuple[SeqId, int]  # (sequence, layer)
HOT_DECAY = 0.99  # per step: a use counts ~1/e after 100 steps
LATENCY_WINDOW = 4096


class TierManager:
    def __init__(
        self, blocks: BlockManager, hbm: KVPool, ddr: KVPool, archive: Archive | None, high_watermark: float
    ) -> None:
        self.blocks = blocks
        self.hbm = hbm
        self.ddr = ddr
        self.archive = archive
        self.mover = Mover(hbm, ddr, archive)
        self.high_watermark = high_watermark
        self.counters = TierCounters()
        self.names: dict[SeqId, str] = {}
        self._last_used: dict[SeqId, int] = {}
        self._step = 0
        self._spilling: dict[int, list[tuple[SeqId, int, np.ndarray]]] = {}  # transfer id -> blocks
        self._hotness: dict[SeqId, tuple[np.ndarray, np.ndarray]] = {}
        self.latencies_us: list[float] = []  # host-side HBF planning per step (promote)

    @property
    def block_bytes(self) -> int:
        return self.hbm.slot_bytes

    def register(self, seq: SeqId, name: str) -> None:
        self.names[seq] = name

    def release(self, seq: SeqId, purge_archive: bool = True) -> None:
        self._settle()
        self.blocks.free(seq)
        name = self.names.pop(seq, None)
        self._last_used.pop(seq, None)
        self._hotness.pop(seq, None)
        if purge_archive and name is not None and self.archive is not None:
            self.archive.delete_session(name)

    # ---- admission --------------------------------------------------------------------------

    def admit(self, seq: SeqId, n_tokens: int) -> None:
        """Refuse (OutOfBlocks) `n_tokens` more tokens of `seq` that the tiers cannot hold."""
        b = self.blocks
        table = b.table(seq)
        per_layer = b.blocks_for(table.num_tokens + n_tokens)
        if per_layer > b.slots_per_layer + b.ddr_alloc.capacity:
            raise OutOfBlocks(
                f"a session of {table.num_tokens + n_tokens} tokens needs {per_layer} blocks per layer readable at "
                f"once; HBM ({b.slots_per_layer} per layer) and DDR ({b.ddr_alloc.capacity}) hold fewer: "
                "raise hbm_mb or ddr_mb"
            )
        if self.archive is None:
            used = sum(t.num_blocks for t in b.tables().values()) * b.num_layers
            capacity = b.slots_per_layer * b.num_layers + b.ddr_alloc.capacity
            new = (per_layer - table.num_blocks) * b.num_layers
            if used + new > capacity:
                raise OutOfBlocks(
                    f"HBM and DDR are full ({used} of {capacity} blocks used, {new} more needed) and no "
                    "ssd_path is configured: close sessions, or configure an SSD archive"
                )

    def chunk_limit(self, seq: SeqId) -> int:
        """Most tokens of `seq` one step may write: their new blocks must fit beside the space
        needed to stage one whole layer of the session (blocks written this step cannot move)."""
        b = self.blocks
        if self.archive is None:
            return 1 << 30  # admission already checked that everything fits
        t = b.table(seq)
        room = b.ddr_alloc.capacity - t.num_blocks - len(b.tables())  # other sessions' partial blocks
        per_layer = min(a.num_free for a in b.hbm_alloc) + max(room, 0) // b.num_layers
        return max(1, per_layer * b.block_size - t.num_tokens % b.block_size)

    # ---- step hooks -------------------------------------------------------------------------

    def begin_step(self, batch: list[SeqId]) -> None:
        self._step += 1
        for seq in batch:
            self._last_used[seq] = self._step
        self._complete(self.mover.poll())

    def prepare_append(self, seq: SeqId, n_tokens: int, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Make room so that `blocks.append(seq, n_tokens)` succeeds."""
        b = self.blocks
        new = b.blocks_needed(seq, n_tokens)
        if new <= 0:
            return
        idle = [s for s in b.tables() if s not in batch]
        for layer, alloc in enumerate(b.hbm_alloc):
            if new > alloc.num_free and idle:
                self._demote_idle(layer, new - alloc.num_free, idle, batch, protect)
        short = sum(max(new - a.num_free, 0) for a in b.hbm_alloc) - b.ddr_free
        if short > 0:
            self._free_ddr(short, self._order(batch, None), protect)

    def stage(self, layer: int, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Make every block of `layer` of the batch's sequences readable (HBM or DDR)."""
        if self.archive is None:
            return  # without an archive every block is in HBM or DDR already
        b = self.blocks
        missing: list[tuple[SeqId, np.ndarray]] = []
        for seq in batch:
            t = b.table(seq)
            nb = t.num_blocks
            gone = np.flatnonzero((t.hbm[layer, :nb] == NONE) & (t.ddr[layer, :nb] == NONE))
            if len(gone):
                missing.append((seq, gone))
        staged = sum(len(g) for _, g in missing)
        if staged:
            short = staged - b.ddr_free
            if short > 0:
                order = [p for p in self._order(batch, layer) if not (p[1] == layer and p[0] in batch)]
                self._free_ddr(short, order, protect)
            for seq, gone in missing:
                slots = b.add_ddr(seq, layer, gone)
                keys = [BlockKey(self.names[seq], layer, int(j)) for j in gone]
                try:
                    self.mover.read(keys, slots)
                except BaseException:
                    b.drop_ddr(seq, layer, gone)  # never leave a table pointing at unread bytes
                    raise
            self.counters.ssd_read_count += staged
            self.counters.ddr_hits -= staged  # count_reads will find them in DDR: they came from SSD

    def count_reads(self, total: int, below: int) -> None:
        """Count the blocks a layer's attention reads: `total`, of which `below` HBM (in DDR)."""
        c = self.counters
        c.hbm_hits += total - below
        c.hbm_misses += below
        c.ddr_hits += below
        c.fetch_bytes += below * self.block_bytes

    def promote(
        self, selected: dict[tuple[SeqId, int], np.ndarray], protect: dict[SeqId, int], keep: dict[SeqId, np.ndarray]
    ) -> None:
        """HBF, between steps: bring the blocks just read from DDR into HBM for the next step (the
        selection is the prefetch guess), evicting the least valuable HBM blocks of the layer by
        recency + hotness; never the sinks, the recent window, blocks written this step or the
        selection itself. Times the decisions (`hbf_latency_us`), not the copies."""
        t0 = time.perf_counter()
        copy_s = 0.0
        b = self.blocks
        by_seq: dict[SeqId, list[tuple[int, np.ndarray]]] = {}
        for (seq, layer), sel in selected.items():
            by_seq.setdefault(seq, []).append((layer, sel))
        for seq, picks in by_seq.items():
            t = b.table(seq)
            heat = self._heat(seq, t.hbm.shape[1])
            # All layers at once: one fancy index over (layer, block) pairs.
            layers = np.concatenate([np.full(len(sel), layer) for layer, sel in picks])
            blocks = np.concatenate([sel for _, sel in picks])
            heat[0][layers, blocks] = heat[0][layers, blocks] * HOT_DECAY ** (self._step - heat[1][layers, blocks]) + 1
            heat[1][layers, blocks] = self._step
            # Only full blocks get a second copy: the partial one keeps its single home for writes.
            want = (t.hbm[layers, blocks] == NONE) & (blocks < t.num_tokens // b.block_size)
            for layer in np.unique(layers[want]).tolist():
                sel = selected[(seq, layer)]
                missing = blocks[want & (layers == layer)]
                free = b.hbm_alloc[layer].num_free
                if free < len(missing):
                    worth = float(heat[0][layer, missing].min())
                    free += self._evict_cold(seq, layer, len(missing) - free, sel, protect, keep[seq], heat, worth)
                missing = missing[:free]
                if len(missing):
                    slots = b.add_hbm(seq, layer, missing)
                    c0 = time.perf_counter()
                    self.mover.ddr_to_hbm(t.ddr[layer, missing].copy(), slots)
                    copy_s += time.perf_counter() - c0
        self.latencies_us.append((time.perf_counter() - t0 - copy_s) * 1e6)
        del self.latencies_us[:-LATENCY_WINDOW]

    def _heat(self, seq: SeqId, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(hotness, last step used) per block, [L, width] each: hotness is an exponential moving
        count of uses with a 100-step horizon."""
        heat = self._hotness.get(seq)
        if heat is None or heat[0].shape[1] < width:
            grown = (np.zeros((self.blocks.num_layers, width)), np.zeros((self.blocks.num_layers, width)))
            if heat is not None:
                grown[0][:, : heat[0].shape[1]] = heat[0]
                grown[1][:, : heat[1].shape[1]] = heat[1]
            self._hotness[seq] = heat = grown
        return heat

    def _evict_cold(
        self,
        seq: SeqId,
        layer: int,
        count: int,
        selected: np.ndarray,
        protect: dict[SeqId, int],
        keep: np.ndarray,
        heat: tuple[np.ndarray, np.ndarray],
        worth: float,
    ) -> int:
        """Drop up to `count` of the session's HBM blocks of `layer` with the lowest value, only
        those worth less than `worth` (so a selection larger than HBM does not churn it)."""
        b = self.blocks
        t = b.table(seq)
        limit = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
        hbm = t.hbm[layer, :limit] != NONE
        hbm[selected[selected < limit]] = False
        hbm[keep[keep < limit]] = False
        cand = np.flatnonzero(hbm)
        if not len(cand):
            return 0
        value = heat[0][layer, cand] * HOT_DECAY ** (self._step - heat[1][layer, cand])
        order = np.argsort(value, kind="stable")[:count]
        victims = cand[order[value[order] < worth]]
        if not len(victims):
            return 0
        copy = victims[t.ddr[layer, victims] == NONE]
        if len(copy):
            if len(copy) > b.ddr_free:
                return 0
            slots = b.add_ddr(seq, layer, copy)
            self.mover.hbm_to_ddr(t.hbm[layer, copy].copy(), slots)
        b.drop_hbm(seq, layer, victims)
        self.counters.hbm_evict_count += len(victims)
        return len(victims)

    def end_step(self, batch: list[SeqId]) -> None:
        """Spill DDR past the high watermark (asynchronously); track peak HBM."""
        b = self.blocks
        used_hbm = (b.slots_per_layer * b.num_layers - sum(a.num_free for a in b.hbm_alloc)) * self.block_bytes
        self.counters.peak_hbm_bytes = max(self.counters.peak_hbm_bytes, used_hbm)
        cap = b.ddr_alloc.capacity
        excess = (cap - b.ddr_free) - int(self.high_watermark * cap)
        if excess > 0 and self.archive is not None and not self.mover.in_flight:
            self._spill(excess, self._order(batch, None), {})

    # ---- moves ------------------------------------------------------------------------------

    def _order(self, batch: list[SeqId], layer: int | None) -> list[Pair]:
        """(sequence, layer) pairs, the best eviction candidates first: idle sessions by least recent
        use, then the batch's layers by next use, furthest first (the layers just computed)."""
        b = self.blocks
        idle = sorted((s for s in b.tables() if s not in batch), key=lambda s: self._last_used.get(s, 0))
        L = b.num_layers
        out = [(s, layer_) for s in idle for layer_ in reversed(range(L))]
        current = 0 if layer is None else layer
        out += [(s, (current - 1 - i) % L) for i in range(L) for s in batch]
        return out

    def _candidates(self, pair: Pair, protect: dict[SeqId, int]) -> tuple[np.ndarray, np.ndarray]:
        """Full, unprotected blocks of `pair` with a DDR copy: (droppable now, needing an archive write)."""
        seq, layer = pair
        t = self.blocks.table(seq)
        limit = min(t.num_tokens // self.blocks.block_size, protect.get(seq, t.num_blocks))
        ddr = t.ddr[layer, :limit] != NONE
        spare = (t.hbm[layer, :limit] != NONE) | t.archived[layer, :limit]
        return np.flatnonzero(ddr & spare), np.flatnonzero(ddr & ~spare)

    def _free_ddr(self, need: int, order: list[Pair], protect: dict[SeqId, int]) -> None:
        """Free `need` DDR slots now: drop redundant copies first, then archive and drop."""
        self._settle()
        freed = self._spill(need, order, protect, wait=True)
        if freed < need:
            raise OutOfBlocks(
                f"DDR is full: {need - freed} more blocks are needed and none can be evicted"
                + ("" if self.archive is not None else " (no ssd_path is configured)")
            )

    def _spill(self, need: int, order: list[Pair], protect: dict[SeqId, int], wait: bool = False) -> int:
        freed = 0
        plans = [(p, *self._candidates(p, protect)) for p in order]
        for (seq, layer), cheap, _ in plans:
            take = cheap[: need - freed]
            if len(take):
                self.blocks.drop_ddr(seq, layer, take)
                self.counters.ddr_evict_count += len(take)
                freed += len(take)
            if freed >= need:
                return freed
        if self.archive is None:
            return freed
        for (seq, layer), _, costly in plans:
            take = costly[: need - freed]
            if len(take):
                self._archive(seq, layer, take, wait)
                freed += len(take)
            if freed >= need:
                break
        if wait:
            self._settle()
        return freed

    def _archive(self, seq: SeqId, layer: int, idx: np.ndarray, wait: bool) -> None:
        t = self.blocks.table(seq)
        keys = [BlockKey(self.names[seq], layer, int(j)) for j in idx]
        tokens = [self.blocks.block_size] * len(idx)  # only full blocks are archived
        transfer = self.mover.submit_write(keys, self.ddr, t.ddr[layer, idx].copy(), tokens)
        self._spilling[transfer.id] = [(seq, layer, idx)]
        self.counters.ssd_write_count += len(idx)

    def _settle(self) -> None:
        """Wait for every archive write in flight and apply it."""
        self._complete(self.mover.poll(wait=True))

    def _complete(self, done: list[Transfer]) -> None:
        for transfer in done:
            blocks = self._spilling.pop(transfer.id, [])
            transfer.future.result()  # an archive error surfaces here, before any DDR copy is dropped
            for seq, layer, idx in blocks:
                if not self.blocks.has(seq):
                    continue
                self.blocks.set_archived(seq, layer, idx)
                self.blocks.drop_ddr(seq, layer, idx)
                self.counters.ddr_evict_count += len(idx)

    def _demote_idle(
        self, layer: int, count: int, idle: list[SeqId], batch: list[SeqId], protect: dict[SeqId, int]
    ) -> None:
        """Move up to `count` HBM blocks of `layer` from idle sessions down to DDR."""
        b = self.blocks
        for seq in sorted(idle, key=lambda s: self._last_used.get(s, 0)):
            t = b.table(seq)
            idx = np.flatnonzero(t.hbm[layer, : t.num_blocks] != NONE)[:count]
            if not len(idx):
                continue
            copy = idx[t.ddr[layer, idx] == NONE]
            if len(copy) > b.ddr_free:
                order = [p for p in self._order(batch, None) if p != (seq, layer)]
                self._free_ddr(len(copy) - b.ddr_free, order, protect)
            if len(copy):
                slots = b.add_ddr(seq, layer, copy)
                self.mover.hbm_to_ddr(t.hbm[layer, copy].copy(), slots)
            b.drop_hbm(seq, layer, idx)
            self.counters.hbm_evict_count += len(idx)
            count -= len(idx)
            if count <= 0:
                return

    def read_keys(self, seq: SeqId, layer: int) -> torch.Tensor:
        """All written keys of `seq`'s `layer`, from HBM, DDR or the archive: [Hkv, num_tokens, D]."""
        b = self.blocks
        t = b.table(seq)
        parts = []
        for j in range(t.num_blocks):
            if t.hbm[layer, j] != NONE:
                k = self.hbm.k[:, int(t.hbm[layer, j])]
            elif t.ddr[layer, j] != NONE:
                k = self.ddr.k[:, int(t.ddr[layer, j])]
            else:
                assert self.archive is not None
                k = self.archive.get(BlockKey(self.names[seq], layer, j))[0]
            parts.append(k.to(self.hbm.k.device)[:, : min(b.block_size, t.num_tokens - j * b.block_size)])
        return torch.cat(parts, dim=1)

    # ---- admin and inspection ---------------------------------------------------------------

    def flush(self) -> None:
        """Wait for archive writes in flight (shutdown, tests)."""
        self._settle()

    def stats(self) -> TierStats:
        b, c = self.blocks, self.counters
        hbm_cap = b.slots_per_layer * b.num_layers
        hbm_used = hbm_cap - sum(a.num_free for a in b.hbm_alloc)
        ddr_used = b.ddr_alloc.capacity - b.ddr_free
        ssd = self.archive.stats().stored_bytes if self.archive is not None else 0
        return TierStats(
            **asdict(c),
            hbm_hit_rate=c.hbm_hit_rate,
            hbm_used_bytes=hbm_used * self.block_bytes,
            hbm_capacity_bytes=hbm_cap * self.block_bytes,
            ddr_used_bytes=ddr_used * self.block_bytes,
            ddr_capacity_bytes=b.ddr_alloc.capacity * self.block_bytes,
            ssd_used_bytes=ssd,
        )

    def check(self) -> None:
        """Bookkeeping invariants, and every pair of copies of a block holding the same bytes."""
        self._settle()
        self.blocks.check_invariants()
        for seq, t in self.blocks.tables().items():
            full = t.num_tokens // self.blocks.block_size
            for layer in range(self.blocks.num_layers):
                both = np.flatnonzero((t.hbm[layer, :full] != NONE) & (t.ddr[layer, :full] != NONE))
                if len(both):
                    hk, hv = self.hbm.read(self._index(self.hbm, t.hbm[layer, both]))
                    dk, dv = self.ddr.read(self._index(self.ddr, t.ddr[layer, both]))
                    assert torch_equal(hk, dk) and torch_equal(hv, dv), f"seq {seq} layer {layer}: HBM != DDR"
                archived = np.flatnonzero(t.archived[layer, :full] & (t.ddr[layer, :full] != NONE))
                for j in archived[:4]:  # a sample: reading the archive is slow
                    assert self.archive is not None
                    ak, av = self.archive.get(BlockKey(self.names[seq], layer, int(j)))
                    dk, dv = self.ddr.read(self._index(self.ddr, t.ddr[layer, [j]]))
                    assert torch_equal(ak, dk[:, 0]) and torch_equal(av, dv[:, 0]), (
                        f"seq {seq} layer {layer}: SSD != DDR"
                    )

    @staticmethod
    def _index(pool: KVPool, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(pool.k.device)

    def close(self) -> None:
        self._settle()
        self.mover.close()


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 vs 0.0 and NaN payloads count)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
