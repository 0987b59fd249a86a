"""BlockManager bookkeeping under random allocate / append / move / free sequences (hypothesis, stateful).

Besides `BlockManager.check_invariants`, the state machine keeps its own model of every sequence
(its token count and, per layer and block, its HBM slot, its DDR slot and whether an archive copy
exists) and checks independently, per pool (HBM, DDR): no slot owned twice, free + used =
capacity, tables point only at slots their sequence owns (HBM slots in the layer's own region),
the null slot is never handed out. Per block: every block is in at least one tier (HBM, DDR, or
the archive for a full block); the last, partial block has exactly one home, in HBM or DDR.
`append` places new blocks in the layer's HBM region while it has room, then in DDR, and returns
rows that follow from the table (HBM slot * bs + offset, or -(DDR slot * bs + offset) - 1);
`locations` and `runs` describe the tables exactly; a refused call (OutOfBlocks, or dropping the
only copy of a block) changes nothing.

The moves respect the tier manager's contract: only full blocks get a second copy or an archive
copy; the partial last block moves between HBM and DDR as a whole (copy, then drop the old home).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from h3d.errors import OutOfBlocks
from h3d.kv.blocks import NONE, NULL_SLOT, BlockManager, SeqId, Tier
from h3d.kv.pool import KVPool


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def _snapshot(bm: BlockManager) -> tuple:
    tables = {}
    for seq, t in bm.tables().items():
        nb = t.num_blocks
        tables[seq] = (t.num_tokens, nb, t.hbm[:, :nb].tobytes(), t.ddr[:, :nb].tobytes(), t.archived[:, :nb].tobytes())
    frees = [sorted(a.free_slots()) for a in [*bm.hbm_alloc, bm.ddr_alloc]]
    return bm.hbm_owner.tobytes(), bm.ddr_owner.tobytes(), frees, tables


@dataclass
class SeqModel:
    tokens: int
    hbm: np.ndarray  # [L, nb]
    ddr: np.ndarray  # [L, nb]
    arch: np.ndarray  # [L, nb] bool

    @property
    def num_blocks(self) -> int:
        return self.hbm.shape[1]


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.model: dict[int, SeqModel] = {}

    @initialize(
        spl=st.lists(st.integers(1, 8), min_size=1, max_size=3),
        uneven=st.booleans(),
        ddr=st.integers(0, 16),
        bs=st.sampled_from([1, 2, 3, 4, 16]),
    )
    def setup(self, spl: list[int], uneven: bool, ddr: int, bs: int) -> None:
        # Layer regions of one size, or of one size each (`region_sizes`: dense layers larger).
        regions = spl if uneven else [spl[0]] * len(spl)
        self.spl, self.ddr_cap, self.layers, self.bs = regions, ddr, len(spl), bs
        self.bm = BlockManager(regions if uneven else regions[0], ddr, len(spl), bs)
        for seq in (0, 1):
            self.open(seq)

    # ---- helpers -----------------------------------------------------------------------------

    def _pick(self, data: st.DataObject) -> tuple[int, int, SeqModel] | None:
        if not self.model:
            return None
        seq = data.draw(st.sampled_from(sorted(self.model)), label="seq")
        layer = data.draw(st.integers(0, self.layers - 1), label="layer")
        return seq, layer, self.model[seq]

    def _subset(self, data: st.DataObject, candidates: np.ndarray) -> np.ndarray | None:
        if not len(candidates):
            return None
        chosen = data.draw(st.lists(st.sampled_from(candidates.tolist()), min_size=1, unique=True), label="blocks")
        return np.array(sorted(chosen), dtype=np.int64)

    def _full(self, m: SeqModel) -> int:
        return m.tokens // self.bs

    def _refused(self, exc: type[Exception], call: object, *args: object) -> None:
        before = _snapshot(self.bm)
        with pytest.raises(exc):
            call(*args)  # type: ignore[operator]
        assert _snapshot(self.bm) == before, "a refused call changed the bookkeeping"

    # ---- rules -------------------------------------------------------------------------------

    @rule(seq=st.integers(0, 5))
    def open(self, seq: int) -> None:
        if seq in self.model:
            self._refused(ValueError, self.bm.allocate, SeqId(seq))
            return
        table = self.bm.allocate(SeqId(seq))
        assert table.num_tokens == 0 and table.num_blocks == 0
        empty = np.zeros((self.layers, 0), dtype=np.int64)
        self.model[seq] = SeqModel(0, empty, empty.copy(), np.zeros((self.layers, 0), dtype=bool))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 40))
    def append(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)), label="seq")
        m, bs, bm = self.model[seq], self.bs, self.bm
        need = _blocks(m.tokens + n, bs) - m.num_blocks
        free = [a.num_free for a in bm.hbm_alloc]
        ddr_free = bm.ddr_free
        short = [max(need - f, 0) for f in free]
        fits = sum(short) <= ddr_free
        assert bm.blocks_needed(SeqId(seq), n) == need
        assert bm.can_append(SeqId(seq), n) == fits
        if not fits:
            self._refused(OutOfBlocks, bm.append, SeqId(seq), n)
            return
        rows = bm.append(SeqId(seq), n)
        assert rows.shape == (self.layers, n) and rows.dtype == np.int64
        # Each layer filled its own HBM region first, the rest went to DDR.
        assert [a.num_free for a in bm.hbm_alloc] == [f - min(need, f) for f in free]
        assert bm.ddr_free == ddr_free - sum(short)
        start = m.tokens
        new_hbm = np.full((self.layers, need), NONE, dtype=np.int64)
        new_ddr = np.full((self.layers, need), NONE, dtype=np.int64)
        for layer in range(self.layers):
            for i in range(need):
                row = int(rows[layer, (m.num_blocks + i) * bs - start])  # the new block's first token
                if i < min(need, free[layer]):
                    assert row >= 0 and row % bs == 0, "a new block should have gone to HBM"
                    new_hbm[layer, i] = row // bs
                else:
                    assert row < 0 and (-row - 1) % bs == 0, "a new block should have gone to DDR"
                    new_ddr[layer, i] = (-row - 1) // bs
        m.hbm = np.concatenate([m.hbm, new_hbm], axis=1)
        m.ddr = np.concatenate([m.ddr, new_ddr], axis=1)
        m.arch = np.concatenate([m.arch, np.zeros((self.layers, need), dtype=bool)], axis=1)
        m.tokens += n
        # Every new token's row is in its block's one home (the partial block has one).
        pos = np.arange(start, start + n)
        b, off = pos // bs, pos % bs
        home = np.where(m.hbm[:, b] != NONE, m.hbm[:, b] * bs + off, -(m.ddr[:, b] * bs + off) - 1)
        assert np.array_equal(rows, home), "append's rows do not follow from the table"

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def add_hbm(self, data: st.DataObject) -> None:
        self._add(data, Tier.HBM)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def add_ddr(self, data: st.DataObject) -> None:
        self._add(data, Tier.DDR)

    def _add(self, data: st.DataObject, tier: Tier) -> None:
        """A second copy of full blocks (promotion to HBM, or a DDR copy of an HBM block)."""
        picked = self._pick(data)
        if picked is None:
            return
        seq, layer, m = picked
        mine = m.hbm if tier is Tier.HBM else m.ddr
        full = self._full(m)
        blocks = self._subset(data, np.flatnonzero(mine[layer, :full] == NONE))
        if blocks is None:
            return
        bm = self.bm
        alloc = bm.hbm_alloc[layer] if tier is Tier.HBM else bm.ddr_alloc
        add = bm.add_hbm if tier is Tier.HBM else bm.add_ddr
        if len(blocks) > alloc.num_free:
            self._refused(OutOfBlocks, add, SeqId(seq), layer, blocks)
            return
        free_before = set(alloc.free_slots())
        slots = add(SeqId(seq), layer, blocks)
        assert len(slots) == len(blocks) and set(slots.tolist()) <= free_before, "handed out a slot that was not free"
        mine[layer, blocks] = slots

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop_hbm(self, data: st.DataObject) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        seq, layer, m = picked
        blocks = self._subset(data, np.flatnonzero(m.hbm[layer] != NONE))
        if blocks is None:
            return
        in_ddr = m.ddr[layer, blocks] != NONE
        archived = m.arch[layer, blocks] & (blocks < self._full(m))
        if not (in_ddr | archived).all():  # the only copy of some block
            self._refused(RuntimeError, self.bm.drop_hbm, SeqId(seq), layer, blocks)
            return
        if not in_ddr.all():
            # Only an archive copy would remain: the manager never does this (it demotes to DDR),
            # and BlockManager may refuse it. Either way the bookkeeping must stay consistent.
            before = _snapshot(self.bm)
            try:
                self.bm.drop_hbm(SeqId(seq), layer, blocks)
            except RuntimeError:
                assert _snapshot(self.bm) == before
                return
        else:
            self.bm.drop_hbm(SeqId(seq), layer, blocks)
        m.hbm[layer, blocks] = NONE

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop_ddr(self, data: st.DataObject) -> None:
        picked = self._pick(data)
        if picked is None:
            return
        seq, layer, m = picked
        blocks = self._subset(data, np.flatnonzero(m.ddr[layer] != NONE))
        if blocks is None:
            return
        other = (m.hbm[layer, blocks] != NONE) | (m.arch[layer, blocks] & (blocks < self._full(m)))
        if not other.all():
            self._refused(RuntimeError, self.bm.drop_ddr, SeqId(seq), layer, blocks)
            return
        self.bm.drop_ddr(SeqId(seq), layer, blocks)
        m.ddr[layer, blocks] = NONE

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def set_archived(self, data: st.DataObject) -> None:
        """Archive full blocks, or forget the archive copy of full blocks that have another copy."""
        picked = self._pick(data)
        if picked is None:
            return
        seq, layer, m = picked
        full = self._full(m)
        value = data.draw(st.booleans(), label="value")
        if value:
            candidates = np.arange(full)
        else:
            candidates = np.flatnonzero((m.hbm[layer, :full] != NONE) | (m.ddr[layer, :full] != NONE))
        blocks = self._subset(data, candidates)
        if blocks is None:
            return
        self.bm.set_archived(SeqId(seq), layer, blocks, value)
        m.arch[layer, blocks] = value

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def move(self, data: st.DataObject) -> None:
        """Move blocks (the partial last one included) to the other pool: copy, then drop the old home,
        as the tier manager demotes an idle session's blocks or stages them back."""
        picked = self._pick(data)
        if picked is None:
            return
        seq, layer, m = picked
        down = data.draw(st.booleans(), label="down")
        src, dst = (m.hbm, m.ddr) if down else (m.ddr, m.hbm)
        blocks = self._subset(data, np.flatnonzero(src[layer] != NONE))
        if blocks is None:
            return
        bm = self.bm
        copy = blocks[dst[layer, blocks] == NONE]
        alloc = bm.ddr_alloc if down else bm.hbm_alloc[layer]
        if len(copy) > alloc.num_free:
            return
        add, drop = (bm.add_ddr, bm.drop_hbm) if down else (bm.add_hbm, bm.drop_ddr)
        if len(copy):
            dst[layer, copy] = add(SeqId(seq), layer, copy)
        drop(SeqId(seq), layer, blocks)
        src[layer, blocks] = NONE

    @rule(seq=st.integers(0, 6))
    def free(self, seq: int) -> None:
        self.bm.free(SeqId(seq))  # unknown sequences: a no-op
        self.model.pop(seq, None)
        assert not self.bm.has(SeqId(seq))

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def builtin_invariants(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    @invariant()
    def tables_match_the_model(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        assert sorted(int(s) for s in bm.tables()) == sorted(self.model)
        for seq, m in self.model.items():
            t = bm.table(SeqId(seq))
            nb = m.num_blocks
            assert t.num_tokens == m.tokens and t.num_blocks == nb == _blocks(m.tokens, self.bs)
            assert np.array_equal(t.hbm[:, :nb], m.hbm), f"seq {seq}: HBM slots differ from the model"
            assert np.array_equal(t.ddr[:, :nb], m.ddr), f"seq {seq}: DDR slots differ from the model"
            assert np.array_equal(t.archived[:, :nb], m.arch), f"seq {seq}: archive flags differ from the model"
            assert (t.hbm[:, nb:] == NONE).all() and (t.ddr[:, nb:] == NONE).all()
            # Kept per version (`any_archive_only`, `ddr_only_at`): asked here, so that the steps
            # between two checks must keep what was cached true, or change the version.
            homeless = (m.hbm == NONE) & (m.ddr == NONE)
            assert t.any_archive_only() == bool(homeless.any()), f"seq {seq}: archive-only answer is stale"
            ddr_only = (m.hbm == NONE) & (m.ddr != NONE)
            if not ddr_only.any():
                t.ddr_only_at = (t.version, nb)
            elif t.ddr_only_at is not None and t.ddr_only_at[0] == t.version:
                assert not ddr_only[:, : t.ddr_only_at[1]].any(), f"seq {seq}: DDR-only answer is stale"

    @invariant()
    def pools_are_consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm, spl, layers = self.bm, self.spl, self.layers
        assert len(bm.hbm_owner) == 1 + sum(spl) == bm.num_slots
        firsts = np.cumsum([1, *spl])
        assert len(bm.ddr_owner) == 1 + self.ddr_cap
        for name, owner in (("HBM", bm.hbm_owner), ("DDR", bm.ddr_owner)):
            assert owner[NULL_SLOT] == -1, f"{name}: the null slot was handed out"
        used_hbm = [0] * layers
        seen: dict[str, set[int]] = {"HBM": set(), "DDR": set()}
        for seq, m in self.model.items():
            for name, slots, owner in (("HBM", m.hbm, bm.hbm_owner), ("DDR", m.ddr, bm.ddr_owner)):
                flat = slots[slots != NONE].tolist()
                assert NULL_SLOT not in flat, f"{name}: a block sits in the null slot"
                assert len(set(flat)) == len(flat) and not (seen[name] & set(flat)), f"{name}: a slot owned twice"
                seen[name].update(flat)
                assert (owner[flat] == seq).all(), f"{name}: a table points at a slot its sequence does not own"
            for layer in range(layers):
                row = m.hbm[layer][m.hbm[layer] != NONE]
                first = firsts[layer]
                assert ((row >= first) & (row < first + spl[layer])).all(), "an HBM slot outside its layer's region"
                used_hbm[layer] += len(row)
        for layer, alloc in enumerate(bm.hbm_alloc):
            assert alloc.num_free + used_hbm[layer] == spl[layer], f"HBM layer {layer}: free + used != capacity"
        assert int((bm.hbm_owner != -1).sum()) == len(seen["HBM"]), "HBM: a used slot belongs to no table"
        assert int((bm.ddr_owner != -1).sum()) == len(seen["DDR"]), "DDR: a used slot belongs to no table"
        assert bm.ddr_free + len(seen["DDR"]) == self.ddr_cap, "DDR: free + used != capacity"
        assert bm.num_free == min(a.num_free for a in bm.hbm_alloc)

    @invariant()
    def every_block_is_somewhere(self) -> None:
        for seq, m in self.model.items():
            full = self._full(m)
            in_hbm, in_ddr = m.hbm != NONE, m.ddr != NONE
            assert (in_hbm[:, :full] | in_ddr[:, :full] | m.arch[:, :full]).all(), f"seq {seq}: a block in no tier"
            if m.tokens % self.bs:
                last = m.num_blocks - 1
                assert (in_hbm[:, last] ^ in_ddr[:, last]).all(), f"seq {seq}: the partial block needs one home"
                assert not m.arch[:, last].any()

    @invariant()
    def locations_and_runs(self) -> None:
        for seq, m in self.model.items():
            t = self.bm.table(SeqId(seq))
            for layer in range(self.layers):
                want = np.where(m.hbm[layer] != NONE, m.hbm[layer], -(m.ddr[layer] + 1))
                readable = ((m.hbm[layer] != NONE) | (m.ddr[layer] != NONE)).all()
                if not readable:  # some block is only in the archive: staging must come first
                    with pytest.raises(RuntimeError):
                        self.bm.runs(SeqId(seq), layer)
                    continue
                assert np.array_equal(t.locations(layer), want)
                runs = self.bm.runs(SeqId(seq), layer)
                expanded = [s + i if tier == Tier.HBM else -(s + i) - 1 for tier, s, c in runs for i in range(c)]
                assert expanded == want.tolist(), "runs do not expand back to the locations"
                assert all(c >= 1 for _, _, c in runs)
                for (t0, s0, c0), (t1, s1, _) in itertools.pairwise(runs):
                    assert not (t0 == t1 and s1 == s0 + c0), "two runs should have been one"


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_append_rows_are_slot_times_block_size_plus_offset() -> None:
    bm = BlockManager(hbm_slots_per_layer=8, ddr_slots=0, num_layers=2, block_size=4)
    bm.allocate(SeqId(7))
    first = bm.append(SeqId(7), 5)  # tokens 0..4: two blocks per layer
    assert first.shape == (2, 5)
    table = bm.table(SeqId(7))
    assert table.num_blocks == 2 and table.num_tokens == 5
    # A fresh pool hands each layer its lowest slots, in order: layer l's region starts at 1 + 8l.
    assert table.hbm[:, :2].tolist() == [[1, 2], [9, 10]]
    assert (table.ddr[:, :2] == NONE).all()
    assert first.tolist() == [[4, 5, 6, 7, 8], [36, 37, 38, 39, 40]]
    second = bm.append(SeqId(7), 6)  # tokens 5..10: fills block 1, opens block 2
    assert table.num_blocks == 3 and table.num_tokens == 11
    for layer in range(2):
        for j, p in enumerate(range(5, 11)):
            assert second[layer, j] == table.hbm[layer, p // 4] * 4 + p % 4
    assert bm.runs(SeqId(7), 0) == [(Tier.HBM, 1, 3)] and bm.runs(SeqId(7), 1) == [(Tier.HBM, 9, 3)]
    empty = bm.append(SeqId(7), 0)
    assert empty.shape == (2, 0) and table.num_tokens == 11 and table.num_blocks == 3
    bm.check_invariants()


def test_append_spills_to_ddr_when_the_layer_region_is_full() -> None:
    bm = BlockManager(hbm_slots_per_layer=2, ddr_slots=6, num_layers=2, block_size=4)
    bm.allocate(SeqId(1))
    rows = bm.append(SeqId(1), 13)  # 4 blocks per layer: 2 in HBM, 2 in DDR
    t = bm.table(SeqId(1))
    assert t.hbm[:, :4].tolist() == [[1, 2, NONE, NONE], [3, 4, NONE, NONE]]
    assert t.ddr[:, :4].tolist() == [[NONE, NONE, 1, 2], [NONE, NONE, 3, 4]]
    assert t.locations(0).tolist() == [1, 2, -2, -3]
    assert bm.runs(SeqId(1), 0) == [(Tier.HBM, 1, 2), (Tier.DDR, 1, 2)]
    assert bm.runs(SeqId(1), 1) == [(Tier.HBM, 3, 2), (Tier.DDR, 3, 2)]
    assert rows[0, :8].tolist() == list(range(4, 12))  # HBM rows
    assert rows[0, 8:].tolist() == [-(4 * 1 + i) - 1 for i in range(4)] + [-(4 * 2) - 1]  # DDR rows
    assert bm.num_free == 0 and bm.ddr_free == 2
    assert bm.can_append(SeqId(1), 7) and not bm.can_append(SeqId(1), 8)  # 1 new block per layer fits, 2 do not
    bm.check_invariants()


def test_out_of_blocks_changes_nothing_and_free_restores_capacity() -> None:
    bm = BlockManager(hbm_slots_per_layer=3, ddr_slots=2, num_layers=2, block_size=4)
    bm.allocate(SeqId(1))
    bm.allocate(SeqId(2))
    bm.append(SeqId(1), 8)  # 2 blocks per layer
    bm.append(SeqId(2), 8)  # 2 blocks per layer: 1 in HBM, 1 in DDR, for each layer
    assert bm.num_free == 0 and bm.ddr_free == 0
    assert not bm.can_append(SeqId(2), 1)
    assert bm.can_append(SeqId(2), 0)
    before = _snapshot(bm)
    with pytest.raises(OutOfBlocks):
        bm.append(SeqId(2), 1)
    with pytest.raises(OutOfBlocks):
        bm.append(SeqId(1), 100)
    assert _snapshot(bm) == before
    bm.check_invariants()
    bm.free(SeqId(1))
    assert bm.num_free == 2
    rows = bm.append(SeqId(2), 8)  # now fits: two more blocks per layer, in HBM
    assert rows.shape == (2, 8) and (rows >= 0).all()
    bm.free(SeqId(2))
    assert bm.num_free == 3 and all(a.num_free == 3 for a in bm.hbm_alloc) and bm.ddr_free == 2
    assert (bm.hbm_owner == -1).all() and (bm.ddr_owner == -1).all()
    bm.check_invariants()


def test_dropping_the_only_copy_raises() -> None:
    bm = BlockManager(hbm_slots_per_layer=4, ddr_slots=4, num_layers=1, block_size=4)
    seq = SeqId(1)
    bm.allocate(seq)
    bm.append(seq, 6)  # block 0 full, block 1 partial; both in HBM
    b0, b1 = np.array([0]), np.array([1])
    with pytest.raises(RuntimeError, match="block 0"):
        bm.drop_hbm(seq, 0, b0)
    bm.add_ddr(seq, 0, b0)
    bm.drop_hbm(seq, 0, b0)  # the DDR copy remains
    with pytest.raises(RuntimeError, match="block 0"):
        bm.drop_ddr(seq, 0, b0)
    bm.set_archived(seq, 0, b0)
    bm.drop_ddr(seq, 0, b0)  # a full block may live in the archive only
    bm.check_invariants()
    with pytest.raises(RuntimeError):
        bm.runs(seq, 0)  # ... but it is not readable until staged back
    bm.add_ddr(seq, 0, b0)
    assert bm.runs(seq, 0) == [(Tier.DDR, 1, 1), (Tier.HBM, 2, 1)]
    # The partial block: moved whole to DDR, its archive flag never counts as a copy.
    bm.add_ddr(seq, 0, b1)
    bm.drop_hbm(seq, 0, b1)
    bm.set_archived(seq, 0, b1)
    with pytest.raises(RuntimeError, match="block 1"):
        bm.drop_ddr(seq, 0, b1)
    bm.check_invariants()


def test_unarchiving_the_only_copy_raises() -> None:
    """set_archived(..., False) forgets the archive copy: like the drops, it must refuse to forget the
    only copy of a block.

    (h3d bug: BlockManager.set_archived does not check, so a block can end up in no tier and only
    check_invariants notices, later.)
    """
    bm = BlockManager(hbm_slots_per_layer=4, ddr_slots=4, num_layers=1, block_size=4)
    seq = SeqId(1)
    bm.allocate(seq)
    bm.append(seq, 4)
    b0 = np.array([0])
    bm.add_ddr(seq, 0, b0)
    bm.drop_hbm(seq, 0, b0)
    bm.set_archived(seq, 0, b0)
    bm.drop_ddr(seq, 0, b0)  # archive only
    with pytest.raises(RuntimeError, match="block 0"):
        bm.set_archived(seq, 0, b0, False)
    bm.check_invariants()


def test_rows_give_every_token_its_own_pool_storage() -> None:
    """K/V written through KVPool.write at append's rows (HBM rows >= 0, DDR rows < 0) all survive:
    no two tokens share storage, in either pool.

    (Layout-agnostic: the values are compared as a multiset; attention and model tests check that
    the right values are read back at the right positions.)
    """
    bs, hkv, d = 4, 2, 3
    bm = BlockManager(hbm_slots_per_layer=3, ddr_slots=8, num_layers=2, block_size=bs)
    pools = [KVPool(n, bs, hkv, d, torch.float32, torch.device("cpu")) for n in (bm.num_slots, len(bm.ddr_owner))]
    for p in pools:
        p.k.zero_()
        p.v.zero_()
    for seq in (1, 2):
        bm.allocate(SeqId(seq))
    written_k, written_v = [], []
    g = torch.Generator().manual_seed(0)
    saw_ddr = False
    for seq, n in ((1, 3), (2, 6), (1, 5), (2, 1), (1, 4), (2, 9)):
        rows = bm.append(SeqId(seq), n)
        saw_ddr |= bool((rows < 0).any())
        for layer in range(2):
            k = torch.rand(n, hkv, d, generator=g) + 1.0  # nonzero, distinct
            v = -k - 1.0
            r = torch.from_numpy(rows[layer])
            hbm = r >= 0
            pools[0].write(r[hbm], k[hbm], v[hbm])
            pools[1].write(-r[~hbm] - 1, k[~hbm], v[~hbm])
            written_k.append(k.reshape(-1))
            written_v.append(v.reshape(-1))
    assert saw_ddr
    got_k = torch.cat([p.k[p.k != 0] for p in pools]).sort().values
    got_v = torch.cat([p.v[p.v != 0] for p in pools]).sort().values
    assert torch.equal(got_k, torch.cat(written_k).sort().values)
    assert torch.equal(got_v, torch.cat(written_v).sort().values)
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), max_size=12)), max_size=30))
def test_layered_allocator_matches_one_stack_per_layer(ops: list[tuple[bool, list[int]]]) -> None:
    """`allocate_many` / `release_many` over several layers (regions of different sizes) hand out
    and take back exactly the slots that one `SlotAllocator` per layer would, in the same order."""
    from h3d.kv.blocks import LayeredAllocator, SlotAllocator

    caps = [5, 2, 7, 1]  # regions of several sizes (`region_sizes`)
    layers = len(caps)
    owner_a = np.full(1 + sum(caps), -1, dtype=np.int64)
    owner_b = owner_a.copy()
    many = LayeredAllocator(np.array(caps), owner_a)
    firsts = np.cumsum([1, *caps])
    single = [SlotAllocator(int(firsts[layer]), cap, owner_b) for layer, cap in enumerate(caps)]
    held: list[list[int]] = [[] for _ in range(layers)]
    for alloc, wanted in ops:
        ls = np.sort(np.array(wanted, dtype=np.int64))
        if alloc:
            counts = np.bincount(ls, minlength=layers)
            if (counts > [a.num_free for a in single]).any():
                with pytest.raises(OutOfBlocks):
                    many.allocate_many(ls, SeqId(7))
                continue
            got = many.allocate_many(ls, SeqId(7))
            want = np.concatenate([single[layer].allocate(int(c), SeqId(7)) for layer, c in enumerate(counts)])
            assert got.tolist() == want.tolist()
            for layer, slot in zip(ls.tolist(), got.tolist(), strict=True):
                held[layer].append(slot)
        else:
            pairs = sorted((layer, held[layer].pop(0)) for layer in ls.tolist() if held[layer])
            if not pairs:
                continue
            many.release_many(np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
            for layer in range(layers):
                mine = np.array([slot for lay, slot in pairs if lay == layer], dtype=np.int64)
                if len(mine):
                    single[layer].release(mine)
        assert [v.free_slots().tolist() for v in many] == [a.free_slots().tolist() for a in single]
        assert owner_a.tolist() == owner_b.tolist()


def test_region_sizes_give_the_dense_layers_their_share() -> None:
    """Equal regions by default; with `dense_share` the first layers split that share of the pool
    and the others the rest; never an empty region; a BlockManager over them places each layer's
    new blocks in its own region."""
    from h3d.kv.sizing import region_sizes

    assert region_sizes(100, 4, 2, None) == [25] * 4
    assert region_sizes(100, 4, 2, 0.6) == [30, 30, 20, 20]
    assert region_sizes(100, 4, 0, 0.6) == [25] * 4  # no dense layers: equal
    assert region_sizes(10, 4, 1, 0.99) == [9, 1, 1, 1]  # the sparse layers keep a slot each
    bm = BlockManager([6, 6, 2, 2], 8, 4, 4)
    bm.allocate(SeqId(1))
    bm.append(SeqId(1), 5 * 4)  # 5 blocks a layer: all in HBM in the big regions, 2 there in the small
    t = bm.table(SeqId(1))
    assert (t.hbm[:2, :5] != NONE).all() and (t.hbm[2:, :2] != NONE).all() and (t.ddr[2:, 2:5] != NONE).all()
    assert bm.hbm_layer[t.hbm[3, :2]].tolist() == [3, 3] and bm.slots_per_layer == 2 and bm.hbm_capacity == 16
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=40))
def test_entries_are_free_exactly_when_nothing_points_to_them(ops: list[tuple[bool, int]]) -> None:
    """Entries allocated and released in any order (growing past their first capacity): ids are
    never handed out twice while held, a released entry comes back reset, the counts add up."""
    from h3d.kv.entries import NONE as NO_SLOT
    from h3d.kv.entries import NULL_ENTRY, Entries

    e = Entries(capacity=8)
    held: list[np.ndarray] = []
    for take, n in ops:
        if take or not held:
            ids = e.allocate(n)
            assert NULL_ENTRY not in ids.tolist() and (e.refs[ids] == 1).all()
            assert not set(ids.tolist()) & {i for h in held for i in h.tolist()}, "an entry handed out twice"
            assert (e.hbm[ids] == NO_SLOT).all() and not e.archived[ids].any() and not e.hotness[ids].any()
            e.hbm[ids], e.archived[ids], e.hotness[ids] = 7, True, 1.5  # as a table would use them
            held.append(ids)
        else:
            ids = held.pop(n % len(held))
            e.release(ids)
            assert (e.refs[ids] == 0).all() and (e.hbm[ids] == NO_SLOT).all() and not e.archived[ids].any()
        assert e.num_used == sum(len(h) for h in held) and e.num_used + len(e.free_ids()) == e.capacity - 1
    assert e.hbm[NULL_ENTRY] == NO_SLOT and e.refs[NULL_ENTRY] == 0


def test_a_tables_blocks_are_entries_it_points_to() -> None:
    """A table's residency is its entries': truncating releases the cut blocks' entries, freeing a
    table releases all of them, and the checks catch a table pointing past its blocks."""
    bm = BlockManager(4, 8, 2, 4)
    seq = SeqId(1)
    bm.allocate(seq)
    bm.append(seq, 10)  # 3 blocks a layer
    t = bm.table(seq)
    ids = t.ids[:, :3].copy()
    assert bm.entries.num_used == 6 and (bm.entries.refs[ids] == 1).all()
    assert (t.hbm[:, :3] == bm.entries.hbm[ids]).all() and (t.layer_hbm(1) == bm.entries.hbm[ids[1]]).all()
    bm.truncate(seq, 4)  # one block left a layer
    assert bm.entries.num_used == 2 and (bm.entries.refs[ids[:, 1:]] == 0).all() and (t.ids[:, 1:] == 0).all()
    bm.check_invariants()
    t.ids[0, 2] = ids[0, 0]  # a cell past the table's blocks
    with pytest.raises(AssertionError, match=r"stale slots|past its blocks"):
        bm.check_invariants()
    t.ids[0, 2] = 0
    bm.free(seq)
    assert bm.entries.num_used == 0
    bm.check_invariants()


def test_layers_are_full_or_sliding_by_their_windows() -> None:
    """Each layer is a full-attention or a sliding-window one by its window (None: full); a list of
    another length is refused."""
    m = BlockManager(4, 4, 2, 4)
    assert m.window_layers.tolist() == [] and m.full_layers.tolist() == [0, 1]
    m = BlockManager(4, 4, 2, 4, [None, 8])
    assert m.window_layers.tolist() == [1] and m.full_layers.tolist() == [0]
    with pytest.raises(ValueError, match="1 layer windows for 2 layers"):
        BlockManager(4, 4, 2, 4, [None])


def test_window_layers_free_the_blocks_their_window_has_passed() -> None:
    """A query at position p of a window-w layer reads keys p - w < j <= p: from the next token
    (position n) on, blocks before (n - w + 1) // bs are never read again. They are freed in
    every tier, the table points at the null entry below the layer's floor, and nothing counts
    them; the full layer keeps every block."""
    m = BlockManager(8, 8, 2, 4, [None, 6])
    m.allocate(1)
    m.append(1, 20)  # blocks 0-4 of both layers in HBM
    assert m.floors(20).tolist() == [0, 3]  # (20 - 6 + 1) // 4
    assert m.floors(4).tolist() == [0, 0]
    free_before = m.hbm_alloc.free.tolist()
    assert m.drop_behind(1, 20) == 3
    assert m.drop_behind(1, 20) == 0  # nothing more until the context moves on
    t = m.table(1)
    assert t.floor.tolist() == [0, 3] and m.window_freed == 3
    assert (m.hbm_alloc.free - np.array(free_before)).tolist() == [0, 3]
    assert t.live().tolist() == [[True] * 5, [False, False, False, True, True]]
    assert t.copies() == (7, 0, 0)
    assert not t.archive_only().any()  # freed blocks are not "in the archive only"
    assert (t.locations(1)[:3] == 0).all()  # (the null slot: read as zeros, masked by the window)
    m.check_invariants()
    # The freed slots are taken by the next blocks; a block of the full layer moved to DDR keeps its place.
    m.append(1, 8)
    m.drop_behind(1, 28)
    assert t.floor.tolist() == [0, 5] and t.num_blocks == 7
    m.check_invariants()


def test_a_cut_behind_a_window_drops_the_whole_kv() -> None:
    """A cut that leaves a window layer reading a block it has freed keeps nothing (`keepable`:
    only a prefill from the start computes a window layer's KV again exactly); a cut within
    the window keeps its floor; an adopted table starts at each layer's floor."""
    m = BlockManager(8, 8, 2, 4, [None, 6])
    m.allocate(1)
    m.append(1, 20)
    m.drop_behind(1, 20)
    assert m.keepable(1, 18) == 18  # floors(18) = [0, 3]
    assert m.keepable(1, 16) == 0  # floors(16) = [0, 2]: block 2 of layer 1 is gone
    with pytest.raises(ValueError, match="freed behind a window"):
        m.truncate(1, 16)
    m.truncate(1, 18)
    assert m.table(1).floor.tolist() == [0, 3] and m.table(1).num_blocks == 5
    m.check_invariants()
    m.truncate(1, 0)
    assert m.table(1).floor.tolist() == [0, 0] and m.table(1).num_blocks == 0
    m.check_invariants()
    m.allocate(2)
    m.adopt_archived(2, 22)  # blocks 0-5; layer 1 from floors(22) = (22 - 5) // 4 = 4
    t = m.table(2)
    assert t.floor.tolist() == [0, 4] and t.live().sum() == 6 + 2
    assert t.archive_only().sum() == 8 and t.archived.sum() == 8 and m.entries.num_archived == 8
    m.check_invariants()
    with pytest.raises(ValueError, match="freed behind a window"):
        m.rewrite(2, 1)


def test_shared_entries_are_counted_stay_put_and_free_their_slots_with_the_last_reference() -> None:
    bm = BlockManager(hbm_slots_per_layer=4, ddr_slots=8, num_layers=2, block_size=4)
    a, b, c, d = SeqId(0), SeqId(1), SeqId(2), SeqId(3)
    for s in (d, a, b, c):
        bm.allocate(s)
    bm.append(d, 4)  # one HBM slot a layer, given back below
    bm.append(a, 22)  # 6 blocks a layer: 3 in HBM, 3 in DDR
    bm.share(a, b, 5)
    bm.share(b, c, 3)
    bm.check_invariants()
    ta, tb, tc = bm.table(a), bm.table(b), bm.table(c)
    assert (tb.ids[:, :5] == ta.ids[:, :5]).all() and tb.num_tokens == 20 and tc.num_tokens == 12
    e = bm.entries
    assert (e.refs[ta.ids[:, :3]] == 3).all() and (e.refs[ta.ids[:, 3:5]] == 2).all()
    assert (e.refs[ta.ids[:, 5]] == 1).all()
    assert bm.peers(a) == {b, c} and bm.peers(c) == {a, b}
    used = bm.hbm_capacity - int(bm.hbm_alloc.free.sum()) + bm.ddr_alloc.capacity - bm.ddr_free
    assert used == 12 + 2  # the blocks of `a` once, and `d`'s
    with pytest.raises(RuntimeError, match="share"):
        bm.drop_hbm(b, 0, np.array([0]))
    with pytest.raises(RuntimeError, match="a cut inside a shared block"):
        bm.truncate(b, 10)  # inside block 2, shared: never written to
    assert tb.num_tokens == 20
    # A copy added through one sharer changes every sharer's version.
    bm.free(d)
    before = (ta.version, tc.version)
    bm.add_hbm(b, 0, np.array([3]))  # (in DDR only until now)
    assert ta.version > before[0] and tc.version > before[1]
    bm.check_invariants()
    # Its DDR copy beside the HBM one may go (where the sessions read it stays); a lone DDR copy not.
    bm.drop_ddr(a, 0, np.array([3]))
    assert e.ddr[ta.ids[0, 3]] == NONE and e.hbm[ta.ids[0, 3]] != NONE
    with pytest.raises(RuntimeError, match="share"):
        bm.drop_ddr(a, 0, np.array([4]))
    bm.check_invariants()
    # Archived by its home: a sharer's release keeps the record's standing, the home's does not.
    bm.set_archived(a, 1, np.array([0]))
    bm.free(c)
    assert e.archived[ta.ids[1, 0]] and e.home[ta.ids[1, 0]] == a
    bm.free(a)
    assert not e.archived[tb.ids[1, 0]] and (e.refs[tb.ids[:, :5]] == 1).all() and not bm.peers(b)
    bm.check_invariants()
    bm.free(b)
    bm.check_invariants()
    assert e.num_used == 0 and bm.ddr_free == 8 and (bm.hbm_alloc.free == 4).all()


def test_a_missing_share_group_is_caught() -> None:
    bm = BlockManager(hbm_slots_per_layer=4, ddr_slots=4, num_layers=1, block_size=4)
    bm.allocate(SeqId(0))
    bm.allocate(SeqId(1))
    bm.append(SeqId(0), 8)
    bm.share(SeqId(0), SeqId(1), 2)
    bm._groups.clear()  # as if the share had not been recorded: version changes would not reach the peer
    with pytest.raises(AssertionError, match="two groups"):
        bm.check_invariants()


def test_a_long_append_takes_the_slots_of_sessions_that_took_turns_in_order() -> None:
    """Two sessions that appended by turns hold every other slot of HBM and of DDR, and give them
    back one after the other; a long append next (`TIDY_BLOCKS` a layer or more) takes the lowest
    free slots in order: one run of HBM and one of DDR per layer, not one a block. (Before, the
    first prompt after the warm-up read a 32K-token prompt in 63 runs.)"""
    from h3d.kv.blocks import TIDY_BLOCKS

    bm = BlockManager(hbm_slots_per_layer=16, ddr_slots=32, num_layers=2, block_size=4)
    for seq in (1, 2, 3):
        bm.allocate(SeqId(seq))
    for _ in range(16):  # 8 blocks each in HBM, then 8 each in DDR
        bm.append(SeqId(1), 4)
        bm.append(SeqId(2), 4)
    assert len(bm.runs(SeqId(1), 0)) == 16  # every other slot
    bm.free(SeqId(2))
    bm.free(SeqId(1))
    assert TIDY_BLOCKS <= 16
    bm.append(SeqId(3), 32 * 4)  # 16 blocks a layer in HBM, 16 spilled to DDR
    for layer in range(2):
        runs = bm.runs(SeqId(3), layer)
        assert [(t, c) for t, _, c in runs] == [(Tier.HBM, 16), (Tier.DDR, 16)], runs
        assert runs[0][1] == 1 + 16 * layer
    bm.check_invariants()
