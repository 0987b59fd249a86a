"""HBF's prompt probe on the device in two launches a segment and one more: the attention mass
each key draws from a prompt's last queries (`key_mass`), without the [Hkv, rows, T] scores in
memory.

`h3d.hbf.policy.probe_anchors` ranks a layer's blocks by the softmax mass they draw from the last
`PROBE_QUERIES` queries of a prompt, per KV head. Its torch twin widens every key to fp32, scores
them all ([Hkv, m * G, T] fp32: 256 MB a layer for 32K keys of an 8B model), then a softmax and a
sum over them: on an H100 about 2 ms of the device a layer, most of a chat's second turn over 32K
of history (docs/BENCHMARKS.md). The kernels read the keys where they are, in their own dtype, and
keep only a row's running maximum and sum, then a key's sum:

- `_lse_kernel`, program (KV head, tile of rows, split of the keys): each row's maximum score and
  its sum of exponentials over the split's keys (the keys past each query masked: the query of
  row r, the (r // G)-th of the last m, sits at position T - m + r // G).
- `_combine_kernel`, program (KV head, tile of rows): the splits' partial figures into each row's
  log-sum-exp (in one launch: torch's ops took seven, and a chunk over a cached prefix is bound
  by its launches, docs/BENCHMARKS.md).
- `_mass_kernel`, program (KV head, tile of keys): each key's exp(score - lse) summed over every
  row of its head.

The keys may come in segments (a view of the HBM pool for the cached prefix, the chunk's own keys
as computed): each segment is a launch of each kernel, so nothing is concatenated. Scores are
`tl.dot`s of the keys' dtype with fp32 accumulation (`ieee` for fp32 keys); the queries, scaled,
are rounded to the keys' dtype first.

Its twin is the torch code of `probe_anchors` (`h3d.hbf.policy`); the tests run the kernels under
`TRITON_INTERPRET=1` against a float64 oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from h3d.kernels import loader

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None

BLOCK_ROWS = 64  # rows (query, head) a program scores at once
BLOCK_KEYS = 64  # keys a program scores at once
PROGRAMS = 512  # `_lse_kernel`: the keys are split until about this many programs run


def applies(device: torch.device) -> bool:
    """Whether `probe_anchors` launches these kernels for keys on `device`: on CUDA with Triton. A
    CPU runs the torch twin, under the interpreter too (it would take seconds a prompt there); the
    tests launch the kernels through it themselves."""
    return device.type == "cuda" and loader.runs_on(device)


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the probe's kernels, once."""
    # Every integer loose: strides follow the pool's size and the splits, lengths the context, so
    # that the warm-up's variant is the one every prompt runs (a variant compiled at a chat's
    # second turn took 0.29 s of it on an H100).
    strides = ("sq_h", "sq_r", "sk_h", "sk_t")
    lengths = ("rows", "seg_len", "key0", "total", "last")
    return loader.jit(
        globals(),
        {
            "lse": (*strides, "sb_h", "sb_r", *lengths, "split0", "per_split"),
            "mass": (*strides, "so_h", *lengths),
            "combine": ("sb_h", "sb_r", "rows", "splits"),
        },
        lse=_lse_kernel,
        mass=_mass_kernel,
        combine=_combine_kernel,
    )


def key_mass(
    q: torch.Tensor, keys: Sequence[torch.Tensor], last: int, group: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The softmax mass each key draws, summed over its KV head's rows: [Hkv, T] fp32.

    q: [Hkv, R, D], row r = (query r // `group`, query head r % `group`), already scaled; the
    queries are the sequence's last `last`. keys: [Hkv, T_i, D] segments in order (T = their sum;
    rows of D contiguous), the queries' own among the last. A key after a row's query draws
    nothing. `out`: where to write it (a [Hkv, T] fp32 view with contiguous rows, such as the first
    T columns of a wider buffer); a new tensor if None. Launches the kernels (CUDA, or the
    interpreter); see `probe_anchors` for the twin."""
    kern = _kernels()
    hkv, rows, d = q.shape
    total = sum(k.shape[1] for k in keys)
    dtype = keys[0].dtype
    qd = q.to(dtype).contiguous()
    segs = [k if k.stride(-1) == 1 else k.contiguous() for k in keys]
    d_pad = max(16, triton.next_power_of_2(d))
    consts = {
        "D": d, "D_PAD": d_pad, "BM": BLOCK_ROWS, "BN": BLOCK_KEYS, "DOT": loader.dot_dtype(dtype),
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }  # fmt: skip
    row_tiles = triton.cdiv(rows, BLOCK_ROWS)
    splits = []
    for k in segs:
        tiles = max(1, triton.cdiv(k.shape[1], BLOCK_KEYS))
        n = max(1, min(tiles, triton.cdiv(PROGRAMS, hkv * row_tiles)))
        splits.append((n, triton.cdiv(tiles, n) * BLOCK_KEYS))
    s_total = sum(n for n, _ in splits)
    best = torch.empty((hkv, rows, s_total), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(best)
    key0 = split0 = 0
    for k, (n, per_split) in zip(segs, splits, strict=True):
        kern.lse[(hkv, row_tiles, n)](
            qd, k, best, sums, qd.stride(0), qd.stride(1), k.stride(0), k.stride(1), best.stride(0), best.stride(1),
            rows, k.shape[1], key0, total, last, split0, per_split, G=group, **consts,
        )  # fmt: skip
        key0 += k.shape[1]
        split0 += n
    lse = torch.empty((hkv, rows), dtype=torch.float32, device=q.device)
    kern.combine[(hkv, row_tiles)](best, sums, lse, best.stride(0), best.stride(1), rows, s_total, BM=BLOCK_ROWS)
    if out is None:
        out = torch.empty((hkv, total), dtype=torch.float32, device=q.device)
    elif out.shape != (hkv, total) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"key_mass: out must be [{hkv}, {total}] fp32 with contiguous rows")
    key0 = 0
    for k in segs:
        kern.mass[(hkv, max(1, triton.cdiv(k.shape[1], BLOCK_KEYS)))](
            qd, k, lse, out, qd.stride(0), qd.stride(1), k.stride(0), k.stride(1), out.stride(0),
            rows, k.shape[1], key0, total, last, G=group, **consts,
        )  # fmt: skip
        key0 += k.shape[1]
    return out


# The kernels, as plain functions: `_kernels()` decorates them with `triton.jit` at the first launch.


def _lse_kernel(  # type: ignore[no-untyped-def]
    q, k, best, sums, sq_h, sq_r, sk_h, sk_t, sb_h, sb_r,
    rows, seg_len, key0, total, last, split0, per_split,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (h, row tile, split): each row's maximum score over the split's keys and its sum
    of exp(score - maximum), into best / sums [Hkv, rows, all splits] at split0 + split."""
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    sp = tl.program_id(2)
    live = r < rows
    d = tl.arange(0, D_PAD)
    dv = d < D
    qt = tl.load(
        q + h * sq_h + r[:, None].to(tl.int64) * sq_r + d[None, :], mask=live[:, None] & dv[None, :], other=0.0
    )
    qt = qt.to(DOT)
    qpos = total - last + r // G  # each row's query's position
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, seg_len)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    for j0 in range(lo, hi, BN):
        j = j0 + tl.arange(0, BN)
        kv = j < hi
        kt = tl.load(
            k + h * sk_h + j[:, None].to(tl.int64) * sk_t + d[None, :], mask=kv[:, None] & dv[None, :], other=0.0
        )
        s = tl.dot(qt, tl.trans(kt.to(DOT)), input_precision=PRECISION)  # [BM, BN] fp32
        s = tl.where(kv[None, :] & (key0 + j[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row with no key yet: nothing to add)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        m_i = m_new
    at = h * sb_h + r.to(tl.int64) * sb_r + split0 + sp
    tl.store(best + at, m_i, mask=live)
    tl.store(sums + at, l_i, mask=live)


def _combine_kernel(best, sums, lse, sb_h, sb_r, rows, splits, BM: tl.constexpr):  # type: ignore[no-untyped-def]
    """Program (h, row tile): each row's log-sum-exp over all keys, lse [Hkv, rows], from its
    splits' maxima and sums in best / sums [Hkv, rows, splits] (`_lse_kernel`'s)."""
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    live = r < rows
    at = h * sb_h + r.to(tl.int64) * sb_r
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    for sp in range(0, splits):
        b = tl.load(best + at + sp, mask=live, other=float("-inf"))
        x = tl.load(sums + at + sp, mask=live, other=0.0)
        m_new = tl.maximum(m_i, b)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (no key in the splits so far)
        l_i = l_i * tl.exp(m_i - m_safe) + x * tl.exp(b - m_safe)
        m_i = m_new
    l_i = tl.where(live, l_i, 1.0)  # (rows past the end: nothing summed, nothing stored)
    tl.store(lse + h * rows + r, m_i + tl.log(l_i), mask=live)  # (every row sees key 0: finite)


def _mass_kernel(  # type: ignore[no-untyped-def]
    q, k, lse, out, sq_h, sq_r, sk_h, sk_t, so_h,
    rows, seg_len, key0, total, last,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (h, key tile): each key's exp(score - its row's lse) summed over the head's rows,
    into out [Hkv, T] at key0 + the key."""
    h = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BN + tl.arange(0, BN)
    kv = j < seg_len
    d = tl.arange(0, D_PAD)
    dv = d < D
    at_k = k + h * sk_h + j[:, None].to(tl.int64) * sk_t + d[None, :]
    kt = tl.trans(tl.load(at_k, mask=kv[:, None] & dv[None, :], other=0.0).to(DOT))  # [D_PAD, BN]
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r0 in range(0, rows, BM):
        r = r0 + tl.arange(0, BM)
        live = r < rows
        qt = tl.load(
            q + h * sq_h + r[:, None].to(tl.int64) * sq_r + d[None, :], mask=live[:, None] & dv[None, :], other=0.0
        )
        s = tl.dot(qt.to(DOT), kt, input_precision=PRECISION)  # [BM, BN] fp32
        lse_r = tl.load(lse + h * rows + r, mask=live, other=float("inf"))
        qpos = total - last + r // G
        seen = live[:, None] & kv[None, :] & (key0 + j[None, :] <= qpos[:, None])
        acc += tl.sum(tl.where(seen, tl.exp(s - lse_r[:, None]), 0.0), axis=0)
    tl.store(out + h * so_h + key0 + j, acc, mask=kv)
