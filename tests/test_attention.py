"""Paged attention against a slow oracle written here.

The oracle walks each sequence's block table token by token (slot = table[t // bs], offset
t % bs), gathers that token's key and value, and takes a causal softmax in float64, one query and
one head at a time; query head h reads KV head h // (H / Hkv), as transformers' repeat_kv does.

The pools are filled everywhere with random values (large ones in the unused tail of each last
block), so reading a wrong slot, a wrong offset or an unmasked position shows up. Tables are
scattered (random permutations: many runs, the gather path), made of a few runs, or contiguous
(the in-place path of `paged_attention`); lengths are odd; GQA ratios 1 and 4; blocks of 16 and 32.

Tolerances: fp32 inputs give fp32 accumulations that agree with float64 to about 1e-6, checked
at 1e-5. With bf16 inputs the oracle upcasts exactly the same bf16 values, so only two roundings
separate an fp32-accumulating kernel from it: the output's final rounding to bf16 (at most half a
bf16 ulp, 2^-8 of |out|: bf16 keeps 8 significant bits), and, in kernels that (like flash attention
and torch's CPU SDPA) round the softmax probabilities to bf16 before the P·V product, an error of at
most 2^-8 p_t on each probability, i.e. 2^-8 Σ_t p_t |v_t| on the output. The bf16 check is
|Δ| <= 2^-8 (|out| + Σ_t p_t |v_t|) + 1e-5, computed per element by the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3d.kv import attention as A
from h3d.kv.blocks import NULL_SLOT
from h3d.kv.pool import KVPool

HEAD_DIM = 16
NUM_SLOTS = 97  # slot 0 is the null slot


def _runs(table: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in table:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def _tables(lengths: list[int], bs: int, layout: str, g: torch.Generator) -> list[list[int]]:
    """Disjoint block tables for sequences of `lengths` tokens, laid out as asked."""
    need = [-(-n // bs) for n in lengths]
    assert sum(need) <= NUM_SLOTS - 1
    if layout == "scattered":
        free = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).tolist()
        out = []
        for nb in need:
            out.append(free[:nb])
            del free[:nb]
        return out
    if layout == "contiguous":
        out, start = [], 1 + int(torch.randint(0, 5, (1,), generator=g))
        for nb in need:
            out.append(list(range(start, start + nb)))
            start += nb + 1  # a gap, so sequences do not touch
        return out
    assert layout == "few_runs"
    # Each sequence: its blocks in 2-3 runs of consecutive slots, runs taken from a shuffled pool of
    # 4-slot pieces.
    pieces = (torch.randperm((NUM_SLOTS - 1) // 4, generator=g) * 4 + 1).tolist()
    out = []
    for nb in need:
        table: list[int] = []
        while len(table) < nb:
            p = pieces.pop()
            table += list(range(p, p + min(4, nb - len(table))))
        out.append(table)
    return out


class Pool:
    """A KVPool filled with random K/V, plus the same values in a logical [S, bs, Hkv, D] layout.

    Values enter the pool only through `KVPool.write` at rows slot * bs + offset, so the tests do
    not depend on the pool's physical layout; the oracle reads the logical copy.
    """

    def __init__(self, bs: int, hkv: int, dtype: torch.dtype, g: torch.Generator) -> None:
        self.bs = bs
        self.pool = KVPool(NUM_SLOTS, bs, hkv, HEAD_DIM, dtype, torch.device("cpu"))
        self.k = torch.randn(NUM_SLOTS, bs, hkv, HEAD_DIM, generator=g).to(dtype)
        self.v = torch.randn(NUM_SLOTS, bs, hkv, HEAD_DIM, generator=g).to(dtype)
        self.k[NULL_SLOT] = 0
        self.v[NULL_SLOT] = 0
        self._write(torch.arange(bs, NUM_SLOTS * bs))

    def _write(self, rows: torch.Tensor) -> None:
        flat_k = self.k.reshape(-1, *self.k.shape[2:])
        flat_v = self.v.reshape(-1, *self.v.shape[2:])
        self.pool.write(rows, flat_k[rows], flat_v[rows])

    def poison_tails(self, tables: list[list[int]], lengths: list[int]) -> None:
        """Large values past each sequence's last token: visible if attention reads them."""
        bs = self.bs
        for table, n in zip(tables, lengths, strict=True):
            if n % bs:
                self.k[table[-1], n % bs :] = 30.0
                self.v[table[-1], n % bs :] = -1000.0
                self._write(torch.arange(table[-1] * bs + n % bs, (table[-1] + 1) * bs))


def oracle(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: list[int], kv_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]: the sequence's last n tokens -> (out, Σ_t p_t |v_t|), both [n, H, D] float64.

    Keys and values are gathered token by token through the block table.
    """
    n, h, _ = q.shape
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    group = h // hkv
    keys = torch.stack([k_pool[table[t // bs], t % bs].double() for t in range(kv_len)])  # [T, Hkv, D]
    vals = torch.stack([v_pool[table[t // bs], t % bs].double() for t in range(kv_len)])
    out = torch.zeros(n, h, q.shape[2], dtype=torch.float64)
    mag = torch.zeros_like(out)
    for j in range(n):
        pos = kv_len - n + j  # causal: the query sees keys 0..pos
        for head in range(h):
            kv = head // group
            scores = (keys[: pos + 1, kv] @ q[j, head].double()) * scale  # [pos + 1]
            w = torch.exp(scores - scores.max())
            w /= w.sum()
            out[j, head] = w @ vals[: pos + 1, kv]
            mag[j, head] = w @ vals[: pos + 1, kv].abs()
    return out, mag


def assert_close_to_oracle(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, mag = want
    assert got.shape == out.shape
    assert torch.isfinite(got).all()
    if got.dtype == torch.float32:
        bound = torch.full_like(out, 1e-5)
    else:
        assert got.dtype == torch.bfloat16
        bound = (out.abs() + mag) * 2.0**-8 + 1e-5
    excess = ((got.double() - out).abs() - bound).max().item()
    assert excess <= 0, f"max |Δ| beyond tolerance by {excess:.3g} ({got.dtype})"


def _batch(tables: list[list[list[int]]], query_lens: list[int], kv_lens: list[int]) -> A.AttentionBatch:
    """tables[layer][seq] -> the AttentionBatch the runner would build (write_rows unused here)."""
    num_layers, num_seqs = len(tables), len(tables[0])
    width = max(len(t) for layer in tables for t in layer)
    block_tables = torch.full((num_layers, num_seqs, width), NULL_SLOT, dtype=torch.int64)
    for layer in range(num_layers):
        for i, t in enumerate(tables[layer]):
            block_tables[layer, i, : len(t)] = torch.tensor(t)
    seq_ends = np.concatenate([np.full(n, kv, dtype=np.int64) for n, kv in zip(query_lens, kv_lens, strict=True)])
    return A.AttentionBatch(
        query_lens=tuple(query_lens),
        kv_lens=tuple(kv_lens),
        write_rows=torch.zeros((num_layers, sum(query_lens)), dtype=torch.int64),
        block_tables=block_tables,
        kv_lens_t=torch.tensor(kv_lens, dtype=torch.int64),
        seq_ends=torch.from_numpy(seq_ends),
        runs=tuple([_runs(tables[layer][i]) for layer in range(num_layers)] for i in range(num_seqs)),
    )


DTYPES = [torch.float32, torch.bfloat16]
GQA = [(4, 4), (8, 2)]  # (H, Hkv): ratio 1 and 4
LAYOUTS = ["scattered", "few_runs", "contiguous"]
SCALE = HEAD_DIM**-0.5


def _oracle_batch(
    q: torch.Tensor, p: Pool, tables: list[list[int]], query_lens: list[int], kv_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    outs, mags, start = [], [], 0
    for t, n, kv in zip(tables, query_lens, kv_lens, strict=True):
        out, mag = oracle(q[start : start + n], p.k, p.v, t, kv, SCALE)
        outs.append(out)
        mags.append(mag)
        start += n
    return torch.cat(outs), torch.cat(mags)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_attention(bs: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    h, hkv = heads
    g = torch.Generator().manual_seed(bs * 10 + h)
    lengths = [1, 17, 63, 95, 2 * bs + 1]
    tables = _tables(lengths, bs, "scattered", g)
    p = Pool(bs, hkv, dtype, g)
    p.poison_tails(tables, lengths)
    q = (2.0 * torch.randn(len(lengths), h, HEAD_DIM, generator=g)).to(dtype)
    width = max(len(t) for t in tables) + 2  # padded beyond the longest table
    padded = torch.full((len(lengths), width), NULL_SLOT, dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    got = A.decode_attention(q, p.pool.k, p.pool.v, padded, torch.tensor(lengths), SCALE)
    assert got.dtype == dtype
    assert_close_to_oracle(got, _oracle_batch(q, p, tables, [1] * len(lengths), lengths))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("kv_len", "n"), [(77, 77), (77, 13), (33, 1), (101, 40)])
def test_prefill_attention(kv_len: int, n: int, bs: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    h, hkv = heads
    g = torch.Generator().manual_seed(kv_len + n + bs)
    (table,) = _tables([kv_len], bs, "scattered", g)
    p = Pool(bs, hkv, dtype, g)
    p.poison_tails([table], [kv_len])
    q = (2.0 * torch.randn(n, h, HEAD_DIM, generator=g)).to(dtype)
    got = A.prefill_attention(q, p.pool.k, p.pool.v, torch.tensor(table), kv_len, SCALE)
    assert got.dtype == dtype
    assert_close_to_oracle(got, oracle(q, p.k, p.v, table, kv_len, SCALE))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("impl", ["paged_attention", "reference_attention"])
def test_batched_attention(impl: str, bs: int, heads: tuple[int, int], dtype: torch.dtype, layout: str) -> None:
    """A packed batch mixing decode steps and prefill chunks, at both layers of 2 (tables differ per layer)."""
    fn = getattr(A, impl)
    h, hkv = heads
    g = torch.Generator().manual_seed(bs + h + len(layout))
    kv_lens = [1, 29, 301, 45, 2 * bs]
    query_lens = [1, 29, 1, 12, 5]
    both = _tables(kv_lens * 2, bs, layout, g)  # the two layers' blocks are disjoint, as in the pool
    tables = [both[: len(kv_lens)], both[len(kv_lens) :]]
    p = Pool(bs, hkv, dtype, g)
    for layer_tables in tables:
        p.poison_tails(layer_tables, kv_lens)
    q = (2.0 * torch.randn(sum(query_lens), h, HEAD_DIM, generator=g)).to(dtype)
    batch = _batch(tables, query_lens, kv_lens)
    assert not batch.decode_only
    if layout == "scattered":
        assert max(len(r) for r in batch.runs[2]) > A.MAX_RUNS  # the gather path is exercised
    for layer in (0, 1):
        got = fn(q, p.pool.k, p.pool.v, batch, layer, SCALE)
        assert got.dtype == dtype
        assert_close_to_oracle(got, _oracle_batch(q, p, tables[layer], query_lens, kv_lens))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("impl", ["paged_attention", "reference_attention"])
def test_batched_decode_only(impl: str, heads: tuple[int, int], layout: str) -> None:
    fn = getattr(A, impl)
    h, hkv = heads
    bs = 16
    g = torch.Generator().manual_seed(h + len(layout))
    kv_lens = [3, 16, 17, 200, 81]
    tables = _tables(kv_lens, bs, layout, g)
    p = Pool(bs, hkv, torch.float32, g)
    p.poison_tails(tables, kv_lens)
    q = 2.0 * torch.randn(len(kv_lens), h, HEAD_DIM, generator=g)
    batch = _batch([tables], [1] * len(kv_lens), kv_lens)
    assert batch.decode_only
    got = fn(q, p.pool.k, p.pool.v, batch, 0, SCALE)
    assert_close_to_oracle(got, _oracle_batch(q, p, tables, [1] * len(kv_lens), kv_lens))
