"""Paged attention against a slow oracle written here, over blocks spread across the HBM and DDR pools.

A block's *location* is its HBM slot (>= 0) or -(DDR slot + 1) (see `h3d.kv.blocks`). The oracle
walks each sequence's location table token by token (location = table[t // bs], offset t % bs),
gathers that token's key and value from the pool the location names, and takes a causal softmax in
float64, one query and one head at a time; query head h reads KV head h // (H / Hkv), as
transformers' repeat_kv does.

The pools start as NaN everywhere but the zeroed null slot (as `torch.empty` may leave them), and
only the tokens of each sequence (positions < kv_len) are written, with random values, through
`KVPool.write`: reading a wrong slot, a wrong pool, a wrong offset or any byte past kv_len (the
unwritten tail of a last block) shows up as a NaN or a wrong value. HBM slot s and DDR slot s hold
different values, so mistaking one pool for the other shows up too.

Tables are scattered (random permutations: many runs, the gather path), made of a few runs, or
contiguous (the in-place path of `paged_attention`); blocks live all in HBM, all in DDR, split
(the first blocks in HBM, the rest in DDR, as the engine places a session that outgrows its HBM
share: runs of both tiers read in place) or mixed block by block (many runs of alternating tiers).
Lengths are odd; GQA ratios 1 and 4; blocks of 16 and 32.

Tolerances: fp32 inputs give fp32 accumulations that agree with float64 to about 1e-6, checked
at 1e-5. With bf16 inputs the oracle upcasts exactly the same bf16 values, so only two roundings
separate an fp32-accumulating kernel from it: the output's final rounding to bf16 (at most half a
bf16 ulp, 2^-8 of |out|: bf16 keeps 8 significant bits), and, in kernels that (like flash attention
and torch's CPU SDPA) round the softmax probabilities to bf16 before the P·V product, an error of at
most 2^-8 p_t on each probability, i.e. 2^-8 Σ_t p_t |v_t| on the output. The bf16 check is
|Δ| <= 2^-8 (|out| + Σ_t p_t |v_t|) + 1e-5, computed per element by the oracle.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import TEST_DEVICE

from h3d.kv import attention as A
from h3d.kv.blocks import NULL_SLOT, Tier
from h3d.kv.pool import KVPool

HEAD_DIM = 16
NUM_SLOTS = 97  # per pool; slot 0 is the null slot
HBM, DDR = int(Tier.HBM), int(Tier.DDR)

Runs = list[tuple[int, int, int]]


def _slot_tables(lengths: list[int], bs: int, layout: str, g: torch.Generator) -> list[list[int]]:
    """Disjoint lists of slots for sequences of `lengths` tokens, laid out as asked."""
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


def _place(slots: list[int], tiers: str, g: torch.Generator) -> list[int]:
    """A sequence's slots -> its location table, each block put in the pool `tiers` says.

    The same slot number is free in both pools (the tables are disjoint), so a block keeps its
    slot number whichever pool it goes to.
    """
    nb = len(slots)
    if tiers == "hbm":
        in_ddr = [False] * nb
    elif tiers == "ddr":
        in_ddr = [True] * nb
    elif tiers == "split":
        in_ddr = [j >= (nb + 1) // 2 for j in range(nb)]
    else:
        assert tiers == "mixed"
        in_ddr = (torch.rand(nb, generator=g) < 0.5).tolist()
        if nb >= 2:  # both tiers present
            in_ddr[0], in_ddr[-1] = False, True
    return [-(s + 1) if d else s for s, d in zip(slots, in_ddr, strict=True)]


def _runs(locs: list[int]) -> Runs:
    """Maximal runs of consecutive slots of one pool: (tier, first slot, count)."""
    out: Runs = []
    for loc in locs:
        tier, slot = (HBM, loc) if loc >= 0 else (DDR, -loc - 1)
        if out and out[-1][0] == tier and out[-1][1] + out[-1][2] == slot:
            out[-1] = (tier, out[-1][1], out[-1][2] + 1)
        else:
            out.append((tier, slot, 1))
    return out


class TwoPools:
    """An HBM and a DDR KVPool, NaN everywhere but the null slots, plus logical copies of the values
    written, [S, bs, Hkv, D] per pool (`k[tier]`, `v[tier]`), which the oracle reads.

    Values enter the pools only through `KVPool.write` at rows slot * bs + offset, so the tests do
    not depend on the pools' physical layout.
    """

    def __init__(self, bs: int, hkv: int, dtype: torch.dtype, g: torch.Generator) -> None:
        self.bs = bs
        cpu = torch.device("cpu")
        self.pool = [KVPool(NUM_SLOTS, bs, hkv, HEAD_DIM, dtype, cpu) for _ in (HBM, DDR)]
        for p in self.pool:
            for t in (p.k, p.v):
                t.fill_(float("nan"))
                t[:, NULL_SLOT] = 0
        self.k = [torch.randn(NUM_SLOTS, bs, hkv, HEAD_DIM, generator=g).to(dtype) for _ in (HBM, DDR)]
        self.v = [torch.randn(NUM_SLOTS, bs, hkv, HEAD_DIM, generator=g).to(dtype) for _ in (HBM, DDR)]
        self.pools = A.Pools(k=(self.pool[HBM].k, self.pool[DDR].k), v=(self.pool[HBM].v, self.pool[DDR].v))

    def fill(self, tables: list[list[int]], lengths: list[int]) -> None:
        """Write the first `length` tokens of each sequence (and nothing past them)."""
        rows: list[list[int]] = [[], []]
        for table, n in zip(tables, lengths, strict=True):
            for t in range(n):
                loc, off = table[t // self.bs], t % self.bs
                tier, slot = (HBM, loc) if loc >= 0 else (DDR, -loc - 1)
                rows[tier].append(slot * self.bs + off)
        for tier in (HBM, DDR):
            if rows[tier]:
                r = torch.tensor(rows[tier])
                flat_k = self.k[tier].reshape(-1, *self.k[tier].shape[2:])
                flat_v = self.v[tier].reshape(-1, *self.v[tier].shape[2:])
                self.pool[tier].write(r, flat_k[r], flat_v[r])

    def token(self, table: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        loc, off = table[t // self.bs], t % self.bs
        tier, slot = (HBM, loc) if loc >= 0 else (DDR, -loc - 1)
        return self.k[tier][slot, off], self.v[tier][slot, off]


def oracle(
    q: torch.Tensor, p: TwoPools, table: list[int], kv_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D]: the sequence's last n tokens -> (out, Σ_t p_t |v_t|), both [n, H, D] float64.

    Keys and values are gathered token by token through the location table.
    """
    n, h, _ = q.shape
    hkv = p.k[HBM].shape[2]
    group = h // hkv
    kv = [p.token(table, t) for t in range(kv_len)]
    keys = torch.stack([k.double() for k, _ in kv])  # [T, Hkv, D]
    vals = torch.stack([v.double() for _, v in kv])
    out = torch.zeros(n, h, q.shape[2], dtype=torch.float64)
    mag = torch.zeros_like(out)
    for j in range(n):
        pos = kv_len - n + j  # causal: the query sees keys 0..pos
        for head in range(h):
            g = head // group
            scores = (keys[: pos + 1, g] @ q[j, head].double()) * scale  # [pos + 1]
            w = torch.exp(scores - scores.max())
            w /= w.sum()
            out[j, head] = w @ vals[: pos + 1, g]
            mag[j, head] = w @ vals[: pos + 1, g].abs()
    return out, mag


def assert_close_to_oracle(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, mag = want
    assert got.shape == out.shape
    assert torch.isfinite(got).all(), "attention read a byte nothing wrote (NaN)"
    if got.dtype == torch.float32:
        bound = torch.full_like(out, 1e-5)
    else:
        assert got.dtype == torch.bfloat16
        bound = (out.abs() + mag) * 2.0**-8 + 1e-5
    excess = ((got.double() - out).abs() - bound).max().item()
    assert excess <= 0, f"max |Δ| beyond tolerance by {excess:.3g} ({got.dtype})"


def _padded(tables: list[list[int]], extra: int = 0) -> torch.Tensor:
    """[B, W] location tables padded with the null slot, as the runner builds them."""
    width = max(len(t) for t in tables) + extra
    out = torch.full((len(tables), width), NULL_SLOT, dtype=torch.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor(t)
    return out


def _layer_kv(tables: list[list[int]], query_lens: list[int], kv_lens: list[int]) -> A.LayerKV:
    padded = _padded(tables)
    return A.LayerKV(
        query_lens=tuple(query_lens),
        kv_lens=tuple(kv_lens),
        runs=tuple(_runs(t) for t in tables),
        tables=lambda: padded,
    )


DTYPES = [torch.float32, torch.bfloat16]
GQA = [(4, 4), (8, 2)]  # (H, Hkv): ratio 1 and 4
# (slot layout, tier placement): every layout, and every placement, at least once.
PLACEMENTS = [
    ("scattered", "hbm"),
    ("scattered", "mixed"),
    ("few_runs", "split"),
    ("few_runs", "ddr"),
    ("contiguous", "hbm"),
    ("contiguous", "split"),
]
SCALE = HEAD_DIM**-0.5


def _oracle_batch(
    q: torch.Tensor, p: TwoPools, tables: list[list[int]], query_lens: list[int], kv_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    outs, mags, start = [], [], 0
    for t, n, kv in zip(tables, query_lens, kv_lens, strict=True):
        out, mag = oracle(q[start : start + n], p, t, kv, SCALE)
        outs.append(out)
        mags.append(mag)
        start += n
    return torch.cat(outs), torch.cat(mags)


@pytest.mark.parametrize("tiers", ["hbm", "ddr", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_attention(bs: int, heads: tuple[int, int], dtype: torch.dtype, tiers: str) -> None:
    h, hkv = heads
    g = torch.Generator().manual_seed(bs * 10 + h + len(tiers))
    lengths = [1, 17, 63, 95, 2 * bs + 1]
    tables = [_place(t, tiers, g) for t in _slot_tables(lengths, bs, "scattered", g)]
    p = TwoPools(bs, hkv, dtype, g)
    p.fill(tables, lengths)
    q = (2.0 * torch.randn(len(lengths), h, HEAD_DIM, generator=g)).to(dtype)
    padded = _padded(tables, extra=2)  # padded beyond the longest table
    got = A.decode_attention(q, p.pools, padded, torch.tensor(lengths), SCALE)
    assert got.dtype == dtype
    assert_close_to_oracle(got, _oracle_batch(q, p, tables, [1] * len(lengths), lengths))


@pytest.mark.parametrize("tiers", ["hbm", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(("kv_len", "n"), [(77, 77), (77, 13), (33, 1), (101, 40)])
def test_prefill_attention(
    kv_len: int, n: int, bs: int, heads: tuple[int, int], dtype: torch.dtype, tiers: str
) -> None:
    h, hkv = heads
    g = torch.Generator().manual_seed(kv_len + n + bs + len(tiers))
    (slots,) = _slot_tables([kv_len], bs, "scattered", g)
    table = _place(slots, tiers, g)
    p = TwoPools(bs, hkv, dtype, g)
    p.fill([table], [kv_len])
    q = (2.0 * torch.randn(n, h, HEAD_DIM, generator=g)).to(dtype)
    got = A.prefill_attention(q, p.pools, torch.tensor(table), kv_len, SCALE)
    assert got.dtype == dtype
    assert_close_to_oracle(got, oracle(q, p, table, kv_len, SCALE))


def test_the_chunk_path_imports_no_dynamo() -> None:
    """A chunk over a cached prefix (the first one after a start) must not import torch._dynamo
    (seconds of the engine thread): on the test device, bf16 where it is CUDA (flash's path)."""
    code = (
        "import sys, torch\n"
        "from h3d.kv import attention as A\n"
        f"dev = torch.device({TEST_DEVICE or 'cpu'!r})\n"
        "dt = torch.bfloat16 if dev.type == 'cuda' else torch.float32\n"
        "q = torch.randn(8, 8, 64, device=dev, dtype=dt)\n"
        "k, v = (torch.randn(2, 40, 64, device=dev, dtype=dt) for _ in range(2))\n"
        "A.causal_lower_right_attention(q, k, v, 0.125)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(("layout", "tiers"), PLACEMENTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("impl", ["paged_attention", "reference_attention"])
def test_batched_attention(
    impl: str, bs: int, heads: tuple[int, int], dtype: torch.dtype, layout: str, tiers: str
) -> None:
    """A packed batch mixing decode steps and prefill chunks, at both layers of 2 (tables differ per layer)."""
    fn = getattr(A, impl)
    h, hkv = heads
    g = torch.Generator().manual_seed(bs + h + len(layout) + 7 * len(tiers))
    kv_lens = [1, 29, 301, 45, 2 * bs]
    query_lens = [1, 29, 1, 12, 5]
    both = _slot_tables(kv_lens * 2, bs, layout, g)  # the two layers' blocks are disjoint, as in the pool
    placed = [_place(t, tiers, g) for t in both]
    tables = [placed[: len(kv_lens)], placed[len(kv_lens) :]]
    p = TwoPools(bs, hkv, dtype, g)
    for layer_tables in tables:
        p.fill(layer_tables, kv_lens)
    q = (2.0 * torch.randn(sum(query_lens), h, HEAD_DIM, generator=g)).to(dtype)
    for layer in (0, 1):
        layer_kv = _layer_kv(tables[layer], query_lens, kv_lens)
        if layout == "scattered":
            assert len(layer_kv.runs[2]) > A.MAX_RUNS  # the gather path is exercised
        if tiers in ("split", "mixed"):
            assert {r[0] for r in layer_kv.runs[2]} == {HBM, DDR}  # one sequence reads both pools
        got = fn(q, p.pools, layer_kv, SCALE)
        assert got.dtype == dtype
        assert_close_to_oracle(got, _oracle_batch(q, p, tables[layer], query_lens, kv_lens))


@pytest.mark.parametrize(("layout", "tiers"), PLACEMENTS)
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("impl", ["paged_attention", "reference_attention"])
def test_batched_decode_only(impl: str, heads: tuple[int, int], layout: str, tiers: str) -> None:
    fn = getattr(A, impl)
    h, hkv = heads
    bs = 16
    g = torch.Generator().manual_seed(h + len(layout) + 7 * len(tiers))
    kv_lens = [3, 16, 17, 200, 81]
    tables = [_place(t, tiers, g) for t in _slot_tables(kv_lens, bs, layout, g)]
    p = TwoPools(bs, hkv, torch.float32, g)
    p.fill(tables, kv_lens)
    q = 2.0 * torch.randn(len(kv_lens), h, HEAD_DIM, generator=g)
    got = fn(q, p.pools, _layer_kv(tables, [1] * len(kv_lens), kv_lens), SCALE)
    assert_close_to_oracle(got, _oracle_batch(q, p, tables, [1] * len(kv_lens), kv_lens))


@pytest.mark.parametrize("n", [1, 7])
def test_run_attention_reads_runs_across_pools(n: int) -> None:
    """`run_attention` on a hand-built mix: an HBM run, a DDR run of consecutive slots, a lone HBM
    block, a DDR run ending in a partial block."""
    bs, h, hkv = 16, 8, 2
    g = torch.Generator().manual_seed(n)
    table = [5, 6, 7, -(10 + 1), -(11 + 1), -(12 + 1), 40, -(3 + 1), -(4 + 1)]
    kv_len = 8 * bs + 9
    runs = _runs(table)
    assert runs == [(HBM, 5, 3), (DDR, 10, 3), (HBM, 40, 1), (DDR, 3, 2)]
    p = TwoPools(bs, hkv, torch.float32, g)
    p.fill([table], [kv_len])
    q = 2.0 * torch.randn(n, h, HEAD_DIM, generator=g)
    got = A.run_attention(q, p.pools, runs, kv_len, SCALE)
    assert_close_to_oracle(got, oracle(q, p, table, kv_len, SCALE))


@pytest.mark.parametrize(
    "table", [[5, 6, 7, 8], [5, 6, 9, 8], [5, -(10 + 1), -(11 + 1), 40], [-(3 + 1), -(4 + 1)]],
    ids=["one HBM run", "HBM, scattered", "HBM and DDR", "DDR only"],
)  # fmt: skip
def test_head_major_keys_are_each_tokens_own(table: list[int]) -> None:
    """`head_major` (the prompt probe's keys: a view of the HBM pool where the blocks are one run,
    else gathered, DDR's too): token t of KV head h is the key written for it."""
    bs, hkv = 16, 2
    g = torch.Generator().manual_seed(len(table))
    p = TwoPools(bs, hkv, torch.float32, g)
    tokens = len(table) * bs - 5
    p.fill([table], [tokens])
    got = A.head_major(p.pools.k, np.asarray(table, dtype=np.int64), tokens)
    assert got.shape == (hkv, tokens, HEAD_DIM)
    want = torch.stack([p.token(table, t)[0] for t in range(tokens)]).transpose(0, 1)  # [Hkv, T, D]
    assert torch.equal(got, want)
    assert (got.data_ptr() == p.pool[HBM].k[:, 5].data_ptr()) == (table == [5, 6, 7, 8])  # (a view of one run)


@pytest.mark.parametrize(("n", "t", "heads"), [(1, 40, (4, 4)), (16, 16, (8, 2)), (24, 100, (6, 2)), (64, 300, (4, 1))])
def test_the_chunk_path_equals_a_plain_softmax_over_the_keys_before_each_query(
    n: int, t: int, heads: tuple[int, int]
) -> None:
    """A chunk's queries are its sequence's last n tokens: query i sees keys 0..t-n+i. The chunk
    path (on a CPU SDPA with the boolean mask; on a GPU test run also flash's own lower-right mask,
    in bf16) against a float64 softmax written out here."""
    g = torch.Generator().manual_seed(n + t)
    h, hkv = heads
    q = torch.randn(n, h, 32, generator=g)
    k, v = torch.randn(hkv, t, 32, generator=g), torch.randn(hkv, t, 32, generator=g)
    want = torch.empty(n, h, 32, dtype=torch.float64)
    for i in range(n):
        for head in range(h):
            kh = head // (h // hkv)
            seen = t - n + i + 1
            w = torch.softmax(0.2 * (k[kh, :seen].double() @ q[i, head].double()), dim=0)
            want[i, head] = w @ v[kh, :seen].double()
    torch.testing.assert_close(A.causal_lower_right_attention(q, k, v, 0.2).double(), want, rtol=1e-4, atol=1e-5)
    if TEST_DEVICE and TEST_DEVICE.startswith("cuda"):
        got = A.causal_lower_right_attention(*(x.to(TEST_DEVICE, torch.bfloat16) for x in (q, k, v)), 0.2)
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", ["copies", "segments"])
@pytest.mark.parametrize(("layout", "tiers"), PLACEMENTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa4"])
def test_chunks_attend_to_their_own_kv_as_written(
    heads: tuple[int, int], dtype: torch.dtype, layout: str, tiers: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `fresh` (the forward's new K/V), a prefill chunk reads only the blocks before it from
    the pools: the new tokens' rows are poisoned after the oracle has read them, and the result
    still equals the oracle. Chunks that start their sequence take `causal_attention`; the others
    (some starting mid-block) read their earlier tokens' blocks in place: concatenated with the
    chunk's own (`copies`), or segment by segment, merged by their log-sum-exps (`segments`, what
    CUDA runs with flash attention; here its twin)."""
    if path == "segments":
        monkeypatch.setattr(A, "_segmented", lambda q, keys: True)
        calls = []
        inner = A.segmented_attention
        monkeypatch.setattr(A, "segmented_attention", lambda *a: calls.append(1) or inner(*a))
    h, hkv = heads
    bs = 16
    g = torch.Generator().manual_seed(h + len(layout) + 7 * len(tiers))
    kv_lens = [1, 29, 301, 45, 2 * bs, 50]
    query_lens = [1, 29, 1, 12, 5, 50]  # decode, whole, decode, mid-block chunk, block-aligned chunk, whole
    tables = [_place(t, tiers, g) for t in _slot_tables(kv_lens, bs, layout, g)]
    p = TwoPools(bs, hkv, dtype, g)
    p.fill(tables, kv_lens)
    q = (2.0 * torch.randn(sum(query_lens), h, HEAD_DIM, generator=g)).to(dtype)
    want = _oracle_batch(q, p, tables, query_lens, kv_lens)
    fresh_k, fresh_v, runs = [], [], []
    for table, n, kv in zip(tables, query_lens, kv_lens, strict=True):
        new = [p.token(table, t) for t in range(kv - n, kv)]
        fresh_k.append(torch.stack([k for k, _ in new]))  # [n, Hkv, D]
        fresh_v.append(torch.stack([v for _, v in new]))
        if n == 1:
            runs.append(_runs(table))  # a decode step reads every block, its new token's too
            continue
        runs.append(_runs(table[: -(-(kv - n) // bs)]))  # the blocks before the chunk
        for t in range(kv - n, kv):  # poison the chunk's own rows: they must not be read
            loc, off = table[t // bs], t % bs
            pool = p.pool[HBM if loc >= 0 else DDR]
            slot = loc if loc >= 0 else -loc - 1
            pool.k[:, slot, off] = float("nan")
            pool.v[:, slot, off] = float("nan")
    layer_kv = A.LayerKV(
        query_lens=tuple(query_lens),
        kv_lens=tuple(kv_lens),
        runs=tuple(runs),
        tables=lambda: _padded(tables),
        fresh=(torch.cat(fresh_k), torch.cat(fresh_v)),
    )
    got = A.paged_attention(q, p.pools, layer_kv, SCALE)
    assert got.dtype == dtype
    assert_close_to_oracle(got, want)
    if path == "segments":
        assert len(calls) == 2  # (the two chunks over cached keys)


def test_segments_agree_with_the_copying_path_and_a_broken_merge_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up's check (`segments_agree`) passes where the segments are right (the CPU twin; on
    a GPU test run, flash attention in bf16) and fails where a part is left out of the merge."""
    assert A.segments_agree(torch.device("cpu"), torch.float32, 8, 2, 32)
    if TEST_DEVICE and TEST_DEVICE.startswith("cuda"):
        assert A.segments_agree(torch.device(TEST_DEVICE), torch.bfloat16, 32, 8, 128)
    merge = A.merge_parts
    monkeypatch.setattr(A, "merge_parts", lambda parts: merge(parts[:-1]))
    assert not A.segments_agree(torch.device("cpu"), torch.float32, 8, 2, 32)


@pytest.mark.parametrize(
    ("n", "heads", "group_bytes"), [(1, (4, 4), None), (37, (8, 2), None), (64, (8, 2), 1), (50, (6, 3), 5000)]
)
def test_causal_attention_in_head_groups_into_its_queries_buffer(
    n: int, heads: tuple[int, int], group_bytes: int | None
) -> None:
    """`causal_attention` (a chunk that starts its sequence: is_causal, no mask) equals the masked
    SDPA, in one call or one KV head group at a time (`group_bytes` small), and written into q's own
    buffer (out=q) as the long-prompt path does."""
    group_bytes = A.GROUP_BYTES if group_bytes is None else group_bytes
    g = torch.Generator().manual_seed(n)
    h, hkv = heads
    q = torch.randn(n, h, 32, generator=g)
    k, v = torch.randn(n, hkv, 32, generator=g), torch.randn(n, hkv, 32, generator=g)
    mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=0.2,
        enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(A.causal_attention(q, k, v, 0.2, group_bytes=group_bytes), want, rtol=1e-5, atol=1e-5)
    buf = q.clone()
    assert A.causal_attention(buf, k, v, 0.2, out=buf, group_bytes=group_bytes) is buf
    torch.testing.assert_close(buf, want, rtol=1e-5, atol=1e-5)


def test_causal_sdpa_repeats_kv_where_no_fast_kernel_takes_gqa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA form of a group's call (`fast_only`: flash, memory-efficient or cuDNN kernels only)
    gives the same result with native GQA and, where that is refused, with K/V repeated."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 40, 32, generator=g)
    k, v = torch.randn(1, 1, 40, 32, generator=g), torch.randn(1, 1, 40, 32, generator=g)
    want = A.causal_sdpa(q, k, v, 0.2, 4, fast_only=False)
    torch.testing.assert_close(A.causal_sdpa(q, k, v, 0.2, 4, fast_only=True), want, rtol=1e-5, atol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_gqa(*args, enable_gqa=False, **kw):  # type: ignore[no-untyped-def]
        if enable_gqa:
            raise RuntimeError("No available kernel")
        return sdpa(*args, **kw)

    monkeypatch.setattr(A.F, "scaled_dot_product_attention", no_gqa)
    torch.testing.assert_close(A.causal_sdpa(q, k, v, 0.2, 4, fast_only=True), want, rtol=1e-5, atol=1e-5)


def test_short_decode_sequences_are_attended_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`paged_attention` runs each decode sequence with at most `SERIAL_ELEMENTS` key elements on
    one thread (no OpenMP parallel region per tiny op), the longer ones and the chunks on all of
    torch's threads; the batch's rows come back in order, equal to the oracle, and the thread
    count is restored."""
    h, hkv = 8, 2
    bs = 16
    g = torch.Generator().manual_seed(11)
    kv_lens = [3, 200, 17, 45, 81]
    query_lens = [1, 1, 1, 12, 1]
    tables = [_place(t, "split", g) for t in _slot_tables(kv_lens, bs, "few_runs", g)]
    p = TwoPools(bs, hkv, torch.float32, g)
    p.fill(tables, kv_lens)
    q = 2.0 * torch.randn(sum(query_lens), h, HEAD_DIM, generator=g)
    monkeypatch.setattr(A, "SERIAL_ELEMENTS", hkv * HEAD_DIM * 100)  # 200 tokens are over it, 81 under
    seen: list[tuple[int, int]] = []
    inner = A.run_attention

    def spy(q: torch.Tensor, pools: A.Pools, runs: Runs, kv_len: int, *rest: object) -> torch.Tensor:
        seen.append((kv_len, torch.get_num_threads()))
        return inner(q, pools, runs, kv_len, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(A, "run_attention", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = A.paged_attention(q, p.pools, _layer_kv(tables, query_lens, kv_lens), SCALE)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert sorted(seen) == [(3, 1), (17, 1), (45, 2), (81, 1), (200, 2)]
    assert_close_to_oracle(got, _oracle_batch(q, p, tables, query_lens, kv_lens))
