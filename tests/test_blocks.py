"""BlockManager bookkeeping under random allocate / append / free sequences (hypothesis, stateful).

Besides `BlockManager.check_invariants`, the state machine keeps its own model of every sequence
(its token count and the pool rows `append` returned for each token) and checks independently:
no slot owned twice, free + used = capacity, tables point only at slots their sequence owns (in
the layer's own region), the rows of earlier tokens never move, no two live tokens share a pool
row, `runs` describes the tables exactly, and a failed append (OutOfBlocks) changes nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from h3d.errors import OutOfBlocks
from h3d.kv.blocks import NULL_SLOT, BlockManager, SeqId
from h3d.kv.pool import KVPool


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def _snapshot(bm: BlockManager) -> tuple:
    tables = {}
    for seq in range(-1, 8):
        if bm.has(SeqId(seq)):
            t = bm.table(SeqId(seq))
            tables[seq] = (t.num_tokens, t.num_blocks, t.active().copy())
    return bm.owner.copy(), [a.num_free for a in bm.allocators], tables


def _same(a: tuple, b: tuple) -> bool:
    owner_a, free_a, tables_a = a
    owner_b, free_b, tables_b = b
    if not np.array_equal(owner_a, owner_b) or free_a != free_b or tables_a.keys() != tables_b.keys():
        return False
    return all(tables_a[s][:2] == tables_b[s][:2] and np.array_equal(tables_a[s][2], tables_b[s][2]) for s in tables_a)


class BlockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.rows: dict[int, np.ndarray] = {}  # seq -> [L, tokens] rows returned by append

    @initialize(spl=st.integers(1, 12), layers=st.integers(1, 3), bs=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, spl: int, layers: int, bs: int) -> None:
        self.spl, self.layers, self.bs = spl, layers, bs
        self.bm = BlockManager(spl, layers, bs)

    @rule(seq=st.integers(0, 5))
    def open(self, seq: int) -> None:
        if seq in self.rows:
            before = _snapshot(self.bm)
            with pytest.raises(ValueError):
                self.bm.allocate(SeqId(seq))
            assert _same(before, _snapshot(self.bm))
        else:
            table = self.bm.allocate(SeqId(seq))
            assert table.num_tokens == 0 and table.num_blocks == 0
            self.rows[seq] = np.zeros((self.layers, 0), dtype=np.int64)

    @rule(seq=st.integers(0, 5), n=st.integers(0, 40))
    def append(self, seq: int, n: int) -> None:
        if seq not in self.rows:
            return
        tokens = self.rows[seq].shape[1]
        need = _blocks(tokens + n, self.bs) - _blocks(tokens, self.bs)
        free_per_layer = [a.num_free for a in self.bm.allocators]
        assert self.bm.blocks_needed(SeqId(seq), n) == need
        fits = need <= min(free_per_layer)
        assert self.bm.can_append(SeqId(seq), n) == fits
        if not fits:
            before = _snapshot(self.bm)
            with pytest.raises(OutOfBlocks):
                self.bm.append(SeqId(seq), n)
            assert _same(before, _snapshot(self.bm)), "a failed append changed the bookkeeping"
            return
        rows = self.bm.append(SeqId(seq), n)
        assert rows.shape == (self.layers, n)
        assert rows.dtype == np.int64
        # Each layer took exactly `need` new blocks from its own free list.
        assert [a.num_free for a in self.bm.allocators] == [f - need for f in free_per_layer]
        self.rows[seq] = np.concatenate([self.rows[seq], rows], axis=1)

    @rule(seq=st.integers(0, 6))
    def free(self, seq: int) -> None:
        self.bm.free(SeqId(seq))  # unknown sequences: a no-op
        self.rows.pop(seq, None)
        assert not self.bm.has(SeqId(seq))

    @invariant()
    def builtin_invariants(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    @invariant()
    def independent_invariants(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm, bs, spl = self.bm, self.bs, self.spl
        owner = bm.owner
        assert len(owner) == 1 + spl * self.layers == bm.num_slots
        assert owner[NULL_SLOT] == -1, "the null slot was handed out"
        seen: set[int] = set()
        all_rows: list[np.ndarray] = []
        for seq, rows in self.rows.items():
            table = bm.table(SeqId(seq))
            tokens = rows.shape[1]
            assert table.num_tokens == tokens
            assert table.num_blocks == _blocks(tokens, bs)
            active = table.active()
            assert active.shape == (self.layers, table.num_blocks)
            for layer in range(self.layers):
                first = 1 + layer * spl
                assert ((active[layer] >= first) & (active[layer] < first + spl)).all(), "slot outside its layer"
            flat = active.reshape(-1).tolist()
            assert NULL_SLOT not in flat
            assert len(set(flat)) == len(flat), f"seq {seq} holds a slot twice"
            assert not (seen & set(flat)), "a slot is owned by two sequences"
            seen.update(flat)
            assert (owner[active] == seq).all(), "a table points at a slot its sequence does not own"
            # The rows handed out for every token still follow from the table: slot * bs + offset.
            pos = np.arange(tokens)
            assert np.array_equal(rows, active[:, pos // bs] * bs + pos % bs), "a token's row moved"
            all_rows.append(rows.reshape(-1))
            # runs(): maximal runs of consecutive slots that expand back to the table.
            runs = bm.runs(SeqId(seq))
            assert len(runs) == self.layers
            for layer, layer_runs in enumerate(runs):
                expanded = [s + i for s, c in layer_runs for i in range(c)]
                assert expanded == active[layer].tolist()
                assert all(c >= 1 for _, c in layer_runs)
                for (s0, c0), (s1, _) in itertools.pairwise(layer_runs):
                    assert s1 != s0 + c0, "two runs should have been one"
        used = int((owner != -1).sum())
        assert used == len(seen), "a used slot belongs to no table"
        free_total = sum(a.num_free for a in bm.allocators)
        assert free_total + used == spl * self.layers, "free + used != capacity"
        assert bm.num_free == min(a.num_free for a in bm.allocators)
        rows = np.concatenate(all_rows) if all_rows else np.zeros(0, dtype=np.int64)
        assert len(np.unique(rows)) == len(rows), "two live tokens share a pool row"
        assert not (rows // bs == NULL_SLOT).any(), "a token was placed in the null slot"
        if self.rows:
            seqs = [SeqId(s) for s in self.rows]
            padded = bm.padded_tables(seqs)
            width = max(1, max(bm.table(s).num_blocks for s in seqs))
            assert padded.shape == (self.layers, len(seqs), width)
            for i, s in enumerate(seqs):
                nb = bm.table(s).num_blocks
                assert np.array_equal(padded[:, i, :nb], bm.table(s).active())
                assert (padded[:, i, nb:] == NULL_SLOT).all()


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_append_rows_are_slot_times_block_size_plus_offset() -> None:
    bm = BlockManager(slots_per_layer=8, num_layers=2, block_size=4)
    bm.allocate(SeqId(7))
    first = bm.append(SeqId(7), 5)  # tokens 0..4: two blocks per layer
    assert first.shape == (2, 5)
    table = bm.table(SeqId(7))
    assert table.num_blocks == 2 and table.num_tokens == 5
    for layer in range(2):
        for j in range(5):
            assert first[layer, j] == table.slots[layer, j // 4] * 4 + j % 4
    # A fresh pool hands each layer its lowest slots, in order: layer l's region starts at 1 + 8l.
    assert table.active().tolist() == [[1, 2], [9, 10]]
    assert first.tolist() == [[4, 5, 6, 7, 8], [36, 37, 38, 39, 40]]
    second = bm.append(SeqId(7), 6)  # tokens 5..10: fills block 1, opens block 2
    assert second.shape == (2, 6)
    assert table.num_blocks == 3 and table.num_tokens == 11
    for layer in range(2):
        for j, p in enumerate(range(5, 11)):
            assert second[layer, j] == table.slots[layer, p // 4] * 4 + p % 4
    assert not set(first.reshape(-1).tolist()) & set(second.reshape(-1).tolist())
    assert bm.runs(SeqId(7)) == [[(1, 3)], [(9, 3)]]
    empty = bm.append(SeqId(7), 0)
    assert empty.shape == (2, 0) and table.num_tokens == 11 and table.num_blocks == 3
    bm.check_invariants()


def test_out_of_blocks_changes_nothing_and_free_restores_capacity() -> None:
    bm = BlockManager(slots_per_layer=3, num_layers=2, block_size=4)
    bm.allocate(SeqId(1))
    bm.allocate(SeqId(2))
    bm.append(SeqId(1), 8)  # 2 blocks per layer
    bm.append(SeqId(2), 4)  # 1 block per layer: the pool is full
    assert bm.num_free == 0
    assert not bm.can_append(SeqId(2), 1)
    assert bm.can_append(SeqId(2), 0)
    before = _snapshot(bm)
    with pytest.raises(OutOfBlocks):
        bm.append(SeqId(2), 1)
    with pytest.raises(OutOfBlocks):
        bm.append(SeqId(1), 100)
    assert _same(before, _snapshot(bm))
    bm.check_invariants()
    bm.free(SeqId(1))
    assert bm.num_free == 2
    rows = bm.append(SeqId(2), 8)  # now fits: two more blocks per layer
    assert rows.shape == (2, 8)
    bm.free(SeqId(2))
    assert bm.num_free == 3 and all(a.num_free == 3 for a in bm.allocators)
    assert (bm.owner == -1).all()
    bm.check_invariants()


def test_rows_give_every_token_its_own_pool_storage() -> None:
    """K/V written through KVPool.write at append's rows all survive: no two tokens share storage.

    (Layout-agnostic: the values are compared as a multiset; attention and model tests check that
    the right values are read back at the right positions.)
    """
    bs, hkv, d = 4, 2, 3
    bm = BlockManager(slots_per_layer=6, num_layers=2, block_size=bs)
    pool = KVPool(bm.num_slots, bs, hkv, d, torch.float32, torch.device("cpu"))
    for seq in (1, 2):
        bm.allocate(SeqId(seq))
    written_k, written_v = [], []
    g = torch.Generator().manual_seed(0)
    for seq, n in ((1, 3), (2, 6), (1, 5), (2, 1), (1, 4)):
        rows = bm.append(SeqId(seq), n)
        for layer in range(2):
            k = torch.rand(n, hkv, d, generator=g) + 1.0  # nonzero, distinct
            v = -k - 1.0
            pool.write(torch.from_numpy(rows[layer]), k, v)
            written_k.append(k.reshape(-1))
            written_v.append(v.reshape(-1))
    want_k = torch.cat(written_k).sort().values
    want_v = torch.cat(written_v).sort().values
    assert torch.equal(pool.k[pool.k != 0].sort().values, want_k)
    assert torch.equal(pool.v[pool.v != 0].sort().values, want_v)
    bm.check_invariants()
