"""The decode step's Triton kernels: paged decode attention (one query token per sequence, blocks
read where they live), `paged_write` (new K/V into HBM or pinned DDR), and two fusions of the
model's small ops, `add_rms_norm` (residual add + RMSNorm) and `rotary` (RoPE); each has a torch
twin that the CPU runs, and the tests run the kernels under `TRITON_INTERPRET=1`.

`paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale)` attends each sequence's query
heads to the blocks listed for each of its KV heads: `tables[b, kh, :nblocks[b, kh]]` holds block
locations (HBM slot `s >= 0`, or `-(DDR slot + 1)`), a selection in any order or every block, each
list ending with the sequence's last, partial block (`tail[b]` valid tokens; every other listed
block has `bs`). Pool slabs are `[Hkv, slots, bs, D]` (`h3d.kv.pool.KVPool`): for a (block, head)
the `bs x D` tile is contiguous, so each key row is one coalesced `D`-element load.

Grid and work (flash-decoding):

- `_split_kernel`, grid `(B, Hkv, splits)`. Program (b, kh, s) takes entries
  `[s * block_split, (s + 1) * block_split)` of list (b, kh) and walks them `CHUNK` blocks at a time
  (a `TILE = CHUNK * bs >= 64`-token tile): it loads the tile's locations, picks for each key row a
  pointer into the HBM or the DDR slab by the location's sign (a pointer select: one load per row,
  no second masked load), and runs an online softmax in fp32 (base 2, `scale * log2 e` folded in).
  GQA: the program serves all `G = H / Hkv` query heads of its KV head at once, a `[G_PAD, D]` query
  tile (`G_PAD = max(16, next pow2 of G)`, padded rows masked: `tl.dot` wants every dim >= 16)
  against a `[TILE, D]` key tile, so K/V are read once per KV head, never repeated. Both products
  are `tl.dot`s with fp32 accumulation (`ieee` precision for fp32 pools, no tf32).
  Bytes read per program: `2 * block_split * bs * D * itemsize` of K/V (less for the tail's masked
  rows), `block_split * 4` of table, `G * D * itemsize` of query. It writes `G` partial rows of
  `D` fp32 and `G` log-sum-exps.
- `_merge_kernel`, grid `(B, H)`: merges the splits of one query head by log-sum-exp, reading
  `splits * (D + 1) * 4` bytes and writing `D` values in q's dtype. Splits that got no entry (lists
  shorter than the table width; their programs write zeros and lse = -inf) are not even read: the
  merge counts the used ones, `cdiv(nblocks, block_split)`.

Why two kernels: a split does not know when its siblings finish, and a merge inside the first
kernel would need a grid-wide barrier or atomics plus a "last program merges" counter (more state,
nondeterministic order). A second launch of `B * H` tiny programs costs a few microseconds, and is
skipped altogether when one split covers the table (the split kernel then writes the output).

Split heuristic (`block_split=None`), from shapes only (no device sync, so CUDA-graph friendly):
at most `4 * SMs` programs; `splits = (4 * SMs) // (B * Hkv)` (at least 1, and no more than one per
`CHUNK` blocks of the table width `W`); `block_split = cdiv(W, splits)` rounded up to a multiple of
`CHUNK`. A wide batch (B * Hkv >= 4 * SMs) gets one split and no merge; one long sequence gets many.
The cap of about 4 programs per SM came from a one-off sweep of `block_split` on an H200 (its
script was not kept; `python -m h3d.bench.gpu` times the kernel inside whole decode steps).

The DDR slab: on CUDA it is a pinned host tensor, passed to the kernel as is. Triton's launcher
resolves each pointer argument with `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`,
which succeeds for pinned (cudaHostAlloc'd) memory and, under unified addressing, gives the same
address: the kernel then reads those rows over PCIe (zero-copy). Pageable host memory is refused
here with a clear error (the GPU cannot address it). Checked on an H200 (torch 2.11, Triton 3.6):
outputs within tolerance of the float64 oracle with pinned DDR slabs, and a CUDA graph of a call
replays to the same output; in `python -m h3d.bench.gpu`, `exact_25pct` (75 % of the blocks read
from pinned DDR) generates exactly `exact_full`'s tokens.

Fallback: the Triton kernels run on CUDA tensors, or on CPU tensors when `TRITON_INTERPRET=1`
(Triton's interpreter). Otherwise (CPU without the interpreter, or no Triton installed)
`torch_paged_decode` computes the same thing by gathering the listed blocks and a masked fp32
softmax. Triton is imported lazily, at the first launch: the engine core imports this module with
torch alone, and importing it does not fix the interpreter mode. That mode is Triton's, fixed when
Triton itself is first imported (its library functions are decorated then): TRITON_INTERPRET must
be set before anything imports Triton, as the tests do at their top.
"""

from __future__ import annotations

import importlib.util
import math
import os
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


def _interpreting() -> bool:
    """TRITON_INTERPRET, read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the Triton kernels can run here: Triton is installed, and a GPU or the interpreter is there."""
    return _triton_installed() and (_interpreting() or torch.cuda.is_available())


@cache
def _kernels() -> SimpleNamespace:
    """Import Triton and decorate the two kernels, once."""
    global triton, tl
    import triton as triton_module
    import triton.language as tl_module

    triton, tl = triton_module, tl_module
    interpret = bool(triton.knobs.runtime.interpret)
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.max, InterpretedFunction):
            raise RuntimeError("paged_decode: Triton was imported before TRITON_INTERPRET was set; set it first")
        _patch_interpreter_index()
    return SimpleNamespace(
        split=triton.jit(_split_kernel),
        merge=triton.jit(_merge_kernel),
        write=triton.jit(_write_kernel),
        copy=triton.jit(_copy_kernel),
        add_norm=triton.jit(_add_norm_kernel),
        rope=triton.jit(_rope_kernel),
        interpret=interpret,
        dtypes={torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16},
    )


def _patch_interpreter_index() -> None:
    """Let the interpreter take runtime loop bounds (`range(start, end)`) under NumPy >= 2.4.

    Triton 3.6's interpreter turns a scalar (a 1-element array there) into an int with `int()`,
    which NumPy 2.4 refuses for arrays of one dimension (triton-lang/triton#9171, fixed upstream
    after 3.6). Wrap its per-launch patching so that `__index__` goes through `.item()`.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_h3d_index_fix", False):
        return

    def patch(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch._h3d_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch


BLOCK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_TILE = 64  # key rows per loop step of a program: CHUNK = max(1, MIN_TILE // bs) blocks
PROGRAMS_PER_SM = 4  # the split heuristic's target (module docstring)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the wrapper allocates (output, split workspace); tests poison it with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    *,
    block_split: int | None = None,
) -> torch.Tensor:
    """Decode attention over per-(sequence, KV head) block lists. See the module docstring.

    q: [B, H, D]; k_pools, v_pools: (HBM, DDR) slabs [Hkv, S_tier, bs, D]; tables: [B, Hkv, W]
    int32; nblocks: [B, Hkv] int32 (>= 1); tail: [B] int32 in 1..bs -> [B, H, D] in q's dtype.
    """
    _check(q, k_pools, v_pools, tables, nblocks, tail)
    if _triton_installed() and (q.device.type == "cuda" or _interpreting()):
        return _triton_paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale, block_split)
    return torch_paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale)


def paged_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
) -> None:
    """Store new tokens' K/V where their blocks live, in one launch: k, v [N, Hkv, D]; rows [N]
    int64 on k's device, a pool row (slot * bs + offset) of HBM (>= 0) or -(DDR row + 1) of the
    pinned DDR slab, written in place over PCIe (so that a step captured in a CUDA graph needs no
    host copy). Without Triton (the CPU), two `index_copy_`s."""
    if _triton_installed() and (k.device.type == "cuda" or _interpreting()):
        kernels = _kernels()
        n, hkv, d = k.shape
        hbm_k, ddr_k = (_addressable(p, k.device) for p in k_pools)
        hbm_v, ddr_v = (_addressable(p, k.device) for p in v_pools)
        if hbm_k.stride() != hbm_v.stride() or ddr_k.stride() != ddr_v.stride():
            raise ValueError("paged_write: the K and V slabs of a tier must share their layout")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("paged_write: k and v rows must be contiguous")
        if not rows.is_contiguous():
            raise ValueError("paged_write: rows must be contiguous")
        kernels.write[(n, hkv)](
            k, v, hbm_k, hbm_v, ddr_k, ddr_v, rows,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), hbm_k.stride(0), ddr_k.stride(0),
            D=d, D_PAD=triton.next_power_of_2(d), num_warps=1,
        )  # fmt: skip
        return
    in_hbm = rows >= 0
    for pools, x in ((k_pools, k), (v_pools, v)):
        for pool, sel, r in ((pools[0], in_hbm, rows), (pools[1], ~in_hbm, -rows - 1)):
            idx = torch.nonzero(sel).flatten()
            if len(idx):
                flat = pool.view(pool.shape[0], -1, pool.shape[-1])
                flat.index_copy_(1, r[idx].to(pool.device), x[idx].transpose(0, 1).to(pool.device, pool.dtype))


def copy_blocks(
    src: tuple[torch.Tensor, torch.Tensor],
    src_slots: torch.Tensor,
    dst: tuple[torch.Tensor, torch.Tensor],
    dst_slots: torch.Tensor,
) -> None:
    """Copy whole blocks between pools: (K, V) slabs [Hkv, S, bs, D] of `src` at `src_slots` [n] into
    `dst`'s at `dst_slots` [n]. On CUDA one kernel launch, each program reading a block of one KV
    head where it lives (HBM, or the pinned DDR slab over PCIe) and writing it where it goes: no
    gather on the host and no staging copy. Without Triton (the CPU), an index copy per pool."""
    device = src_slots.device
    if _triton_installed() and (device.type == "cuda" or _interpreting()):
        if not len(src_slots):
            return
        kernels = _kernels()
        sk, sv = (_addressable(p, device) for p in src)
        dk, dv = (_addressable(p, device) for p in dst)
        if sk.stride() != sv.stride() or dk.stride() != dv.stride():
            raise ValueError("copy_blocks: the K and V slabs of a pool must share their layout")
        hkv, _, bs, d = sk.shape
        kernels.copy[(len(src_slots), hkv)](
            sk, sv, dk, dv, src_slots.contiguous(), dst_slots.contiguous(), sk.stride(0), dk.stride(0),
            N=bs * d, N_PAD=triton.next_power_of_2(bs * d), num_warps=4,
        )  # fmt: skip
        return
    for a, b in zip(src, dst, strict=True):
        b[:, dst_slots.to(b.device)] = a[:, src_slots.to(a.device)].to(b.device, b.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm of a decoder, in one launch: returns (s, norm(s)) with
    s = x + residual in x's dtype and norm(s) = weight * (s * rsqrt(mean(s^2) + eps) in fp32,
    rounded to the dtype) rounded again, transformers' two roundings. x, residual: [N, H].
    Without Triton (the CPU), the same in torch ops."""
    if _triton_installed() and (x.device.type == "cuda" or _interpreting()):
        kernels = _kernels()
        n, h = x.shape
        if x.stride(-1) != 1 or residual.stride(-1) != 1 or residual.shape != x.shape:
            raise ValueError("add_rms_norm: x and residual must be [N, H] with contiguous rows")
        summed = torch.empty((n, h), dtype=x.dtype, device=x.device)
        normed = torch.empty((n, h), dtype=x.dtype, device=x.device)
        block = triton.next_power_of_2(h)
        kernels.add_norm[(n,)](
            x, residual, weight, summed, normed, x.stride(0), residual.stride(0), h, eps,
            BLOCK=block, num_warps=max(1, min(16, block // 256)),
        )  # fmt: skip
        return summed, normed
    summed = x + residual
    normed = torch.nn.functional.rms_norm(summed.float(), (x.shape[-1],), eps=eps)
    return summed, weight * normed.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in one launch: x [N, H, D] (rows contiguous), cos, sin [N, D] -> x * cos +
    rotate_half(x) * sin in x's dtype, with torch's roundings (each product rounded, then the
    sum). Without Triton (the CPU), `h3d.model.rope.apply_rotary`'s torch ops."""
    if _triton_installed() and (x.device.type == "cuda" or _interpreting()):
        kernels = _kernels()
        n, h, d = x.shape
        if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("rotary: rows of x, cos and sin must be contiguous")
        out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
        kernels.rope[(n, h)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0),
            D=d, HALF=d // 2, num_warps=1,
        )  # fmt: skip
        return out
    from h3d.model.rope import apply_rotary

    return apply_rotary(x, cos, sin)


def _check(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
) -> None:
    b, h, d = q.shape
    hkv, _, bs, dk = k_pools[0].shape
    if bs not in BLOCK_SIZES or d not in HEAD_DIMS:
        raise ValueError(f"paged_decode: block size {bs} must be one of {BLOCK_SIZES}, head dim {d} of {HEAD_DIMS}")
    if dk != d or h % hkv:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit pools {tuple(k_pools[0].shape)}")
    for pool in (*k_pools, *v_pools):
        if pool.dim() != 4 or pool.shape[0] != hkv or pool.shape[2:] != (bs, d) or pool.dtype != k_pools[0].dtype:
            raise ValueError(f"paged_decode: pool {tuple(pool.shape)} {pool.dtype} differs from the HBM K slab")
    if tables.shape[:2] != (b, hkv) or nblocks.shape != (b, hkv) or tail.shape != (b,):
        raise ValueError(f"paged_decode: tables {tuple(tables.shape)}, nblocks, tail do not match B={b}, Hkv={hkv}")


# ---------------------------------------------------------------- torch path (CPU, or no Triton)


def torch_paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as `paged_decode`, in plain torch: gather the listed blocks, masked fp32 softmax."""
    b, h, d = q.shape
    hkv, _, bs, _ = k_pools[0].shape
    w = tables.shape[-1]
    dev = q.device
    entry = torch.arange(w, device=dev)  # [W]
    n = nblocks.to(dev, torch.int64)[..., None]  # [B, Hkv, 1]
    listed = entry < n  # [B, Hkv, W]; padding entries are replaced by slot 0 and never used
    loc = torch.where(listed, tables.to(dev, torch.int64), 0)
    last = entry == n - 1  # [B, Hkv, W]
    tok = torch.arange(bs, device=dev)
    valid_tok = torch.where(last[..., None], tok < tail.to(dev)[:, None, None, None], True)  # [B, Hkv, W, bs]
    valid = (listed[..., None] & valid_tok).reshape(b, hkv, w * bs)  # [B, Hkv, T]
    k = _gather(k_pools, loc).masked_fill(~valid[..., None], 0.0)  # [B, Hkv, T, D] fp32
    v = _gather(v_pools, loc).masked_fill(~valid[..., None], 0.0)
    qg = q.float().view(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,bktd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,bktd->bkgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def _gather(pools: tuple[torch.Tensor, torch.Tensor], loc: torch.Tensor) -> torch.Tensor:
    """pools: (HBM, DDR) [Hkv, S, bs, D]; loc: [B, Hkv, W] -> [B, Hkv, W*bs, D] fp32 on loc's device."""
    hbm, ddr = pools
    b, hkv, w = loc.shape
    heads = torch.arange(hkv, device=loc.device)[None, :, None]  # [1, Hkv, 1]
    from_hbm = hbm[heads.to(hbm.device), loc.clamp(min=0).to(hbm.device)].float().to(loc.device)
    from_ddr = ddr[heads.to(ddr.device), (-loc - 1).clamp(min=0).to(ddr.device)].float().to(loc.device)
    g = torch.where((loc >= 0)[..., None, None], from_hbm, from_ddr)  # [B, Hkv, W, bs, D]
    return g.reshape(b, hkv, w * hbm.shape[2], hbm.shape[3])


# ---------------------------------------------------------------- Triton path


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4  # the interpreter: a few splits, so that the merge is exercised


def choose_block_split(b: int, hkv: int, w: int, bs: int, device: torch.device) -> int:
    """Blocks per program for a [B, Hkv, W] table (see the module docstring's heuristic)."""
    chunk = max(1, MIN_TILE // bs)
    splits = max(1, min(PROGRAMS_PER_SM * _sm_count(device) // (b * hkv), -(-w // chunk)))
    per = -(-w // splits)
    return max(chunk, -(-per // chunk) * chunk)


def _triton_paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    block_split: int | None,
) -> torch.Tensor:
    kernels = _kernels()
    b, h, d = q.shape
    hkv, _, bs, _ = k_pools[0].shape
    w = tables.shape[-1]
    g = h // hkv
    k_hbm, k_ddr = (_addressable(p, q.device) for p in k_pools)
    v_hbm, v_ddr = (_addressable(p, q.device) for p in v_pools)
    if k_hbm.stride() != v_hbm.stride() or k_ddr.stride() != v_ddr.stride():
        raise ValueError("paged_decode: K and V slabs of a tier must share their layout")
    if any(t.device != q.device for t in (tables, nblocks, tail)):
        raise ValueError("paged_decode: tables, nblocks and tail must be on q's device")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_split is None:
        block_split = choose_block_split(b, hkv, w, bs, q.device)
    if block_split < 1:
        raise ValueError(f"paged_decode: block_split must be >= 1, got {block_split}")
    splits = max(1, -(-w // block_split))
    chunk = max(1, MIN_TILE // bs)
    out = _empty((b, h, d), q.dtype, q.device)
    if splits > 1:
        part_o = _empty((b, h, splits, d), torch.float32, q.device)  # [B, H, S, D]
        part_lse = _empty((b, h, splits), torch.float32, q.device)  # [B, H, S] (log2)
    else:  # unused: the split kernel writes `out`
        part_o = part_lse = out
    big = d * chunk * bs >= 128 * 128
    kernels.split[(b, hkv, splits)](
        q, k_hbm, v_hbm, k_ddr, v_ddr, tables, nblocks, tail, out, part_o, part_lse,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_hbm.stride(0), k_hbm.stride(1), k_ddr.stride(0), k_ddr.stride(1),
        tables.stride(0), tables.stride(1), tables.stride(2),
        nblocks.stride(0), nblocks.stride(1), tail.stride(0),
        block_split,
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), BS=bs, D=d, CHUNK=chunk, SINGLE=splits == 1,
        PRECISION="ieee" if k_hbm.dtype == torch.float32 else "tf32", DOT=_dot_dtype(kernels, k_hbm.dtype),
        num_warps=8 if big else 4, num_stages=2 if big else 3,
    )  # fmt: skip
    if splits > 1:
        kernels.merge[(b, h)](
            part_o, part_lse, nblocks, out,
            nblocks.stride(0), nblocks.stride(1), block_split,
            SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), G=g, D=d,
            num_warps=4, num_stages=1,
        )  # fmt: skip
    return out


def _dot_dtype(kernels: SimpleNamespace, dtype: torch.dtype) -> Any:
    """The operand type of the kernel's `tl.dot`s: the pools' own. Under the interpreter, bf16 goes
    through fp32 instead, since Triton 3.6's interpreter multiplies bf16's raw uint16 bits (the
    values are rounded to bf16 first all the same, so the results match the GPU's)."""
    if dtype not in kernels.dtypes:
        raise ValueError(f"paged_decode: pools of {dtype} are not supported (fp32, bf16, fp16)")
    return tl.float32 if kernels.interpret and dtype == torch.bfloat16 else kernels.dtypes[dtype]


def _addressable(pool: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A slab the kernel can read from `device`: on it, or pinned host memory (zero-copy over PCIe)."""
    if pool.stride(-1) != 1 or pool.stride(-2) != pool.shape[-1]:
        raise ValueError("paged_decode: each pool's [bs, D] tiles must be contiguous")
    if device.type == "cuda" and pool.device.type == "cpu" and not pool.is_pinned():
        raise ValueError("paged_decode: a host pool read from the GPU must be pinned (KVPool(pin_memory=True))")
    return pool


# The kernels, as plain functions: `_kernels()` decorates them with `triton.jit` at the first launch.


def _split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_hbm, v_hbm, k_ddr, v_ddr, tables_ptr, nblocks_ptr, tail_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_hbm_h, stride_hbm_s, stride_ddr_h, stride_ddr_s,
    stride_tb, stride_th, stride_tw,
    stride_nb, stride_nh, stride_tail,
    block_split,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    SINGLE: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Program (b, kh, split): online softmax of kh's G query heads over its share of list (b, kh)."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(nblocks_ptr + b * stride_nb + kh * stride_nh)
    tail = tl.load(tail_ptr + b * stride_tail)
    start = split * block_split
    end = tl.minimum(start + block_split, n)

    rows_g = tl.arange(0, G_PAD)  # [G_PAD] query heads of kh (rows >= G are padding)
    cols = tl.arange(0, D)  # [D]
    heads = kh * G + rows_g
    q = (
        tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + cols[None, :],
            mask=(rows_g < G)[:, None],
            other=0.0,
        )
        .to(k_hbm.dtype.element_ty)
        .to(DOT)
    )  # [G_PAD, D], rounded to the pools' dtype first

    r = tl.arange(0, CHUNK * BS)  # [TILE] key rows of a step: block r // BS, token r % BS
    r_blk = r // BS
    r_tok = r % BS
    table = tables_ptr + b.to(tl.int64) * stride_tb + kh.to(tl.int64) * stride_th
    head_hbm = kh.to(tl.int64) * stride_hbm_h
    head_ddr = kh.to(tl.int64) * stride_ddr_h
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i0 in range(start, end, CHUNK):
        j = i0 + r_blk  # [TILE] list entry of each row
        live = j < end
        loc = tl.load(table + j * stride_tw, mask=live, other=0)  # [TILE] int32
        in_hbm = loc >= 0
        slot = tl.where(in_hbm, loc, -loc - 1).to(tl.int64)
        offset = tl.where(in_hbm, head_hbm + slot * stride_hbm_s, head_ddr + slot * stride_ddr_s) + r_tok * D
        valid = live & ((j < n - 1) | (r_tok < tail))  # [TILE]: the last block has `tail` tokens
        tile = offset[:, None] + cols[None, :]  # [TILE, D]
        k = tl.load(tl.where(in_hbm, k_hbm, k_ddr)[:, None] + tile, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION) * qk_scale  # [G_PAD, TILE] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [G_PAD, TILE]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(tl.where(in_hbm, v_hbm, v_ddr)[:, None] + tile, mask=valid[:, None], other=0.0)
        pv = tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), input_precision=PRECISION)  # [G_PAD, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty list (nblocks == 0) gives zeros, not NaN
    o = acc / l_safe[:, None]
    keep = (rows_g < G)[:, None]
    row = b.to(tl.int64) * (G * tl.num_programs(1)) + heads  # [G_PAD] query head row of [B, H]
    if SINGLE:
        tl.store(out_ptr + row[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        nsplit = tl.num_programs(2)
        tl.store(part_o_ptr + (row[:, None] * nsplit + split) * D + cols[None, :], o, mask=keep)
        tl.store(part_lse_ptr + row * nsplit + split, m_i + tl.log2(l_safe), mask=rows_g < G)


def _merge_kernel(  # type: ignore[no-untyped-def]
    part_o_ptr, part_lse_ptr, nblocks_ptr, out_ptr,
    stride_nb, stride_nh, block_split,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Program (b, h): out[b, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over used splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(nblocks_ptr + b * stride_nb + (h // G) * stride_nh)
    s = tl.arange(0, SPLITS_PAD)
    used = s < tl.minimum(tl.cdiv(n, block_split), SPLITS)  # splits past the list: not read
    row = b.to(tl.int64) * tl.num_programs(1) + h
    lse = tl.load(part_lse_ptr + row * SPLITS + s, mask=used, other=float("-inf"))  # [SPLITS_PAD]
    top = tl.max(lse, 0)
    wgt = tl.where(used, tl.exp2(lse - top), 0.0)
    cols = tl.arange(0, D)
    o = tl.load(part_o_ptr + (row * SPLITS + s[:, None]) * D + cols[None, :], mask=used[:, None], other=0.0)
    total = tl.sum(wgt, 0)
    merged = tl.sum(wgt[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out_ptr + row * D + cols, merged.to(out_ptr.dtype.element_ty))


def _write_kernel(  # type: ignore[no-untyped-def]
    k, v, hbm_k, hbm_v, ddr_k, ddr_v, rows,
    k_stride_n, k_stride_h, v_stride_n, v_stride_h, hbm_stride_h, ddr_stride_h,
    D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Program (n, kh): token n's K and V of KV head kh to its row, in HBM or in pinned DDR.
    Offsets in int64: a head's slab alone can pass 2**31 elements (128K tokens of an 8B model)."""
    n = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    row = tl.load(rows + n)
    d = tl.arange(0, D_PAD)
    inside = d < D
    kx = tl.load(k + n * k_stride_n + kh * k_stride_h + d, mask=inside)
    vx = tl.load(v + n * v_stride_n + kh * v_stride_h + d, mask=inside)
    in_hbm = row >= 0
    hbm_at = kh * hbm_stride_h + tl.where(in_hbm, row, 0) * D + d
    ddr_at = kh * ddr_stride_h + tl.where(in_hbm, 0, -row - 1) * D + d
    tl.store(hbm_k + hbm_at, kx.to(hbm_k.dtype.element_ty), mask=inside & in_hbm)
    tl.store(hbm_v + hbm_at, vx.to(hbm_v.dtype.element_ty), mask=inside & in_hbm)
    tl.store(ddr_k + ddr_at, kx.to(ddr_k.dtype.element_ty), mask=inside & ~in_hbm)
    tl.store(ddr_v + ddr_at, vx.to(ddr_v.dtype.element_ty), mask=inside & ~in_hbm)


def _copy_kernel(  # type: ignore[no-untyped-def]
    sk, sv, dk, dv, src_slots, dst_slots, src_stride_h, dst_stride_h, N: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    """Program (i, kh): block i's K and V tiles of KV head kh, from slot src_slots[i] to dst_slots[i]."""
    i = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    a = tl.load(src_slots + i)
    b = tl.load(dst_slots + i)
    e = tl.arange(0, N_PAD)
    inside = e < N
    at_src = kh * src_stride_h + a * N + e
    at_dst = kh * dst_stride_h + b * N + e
    tl.store(dk + at_dst, tl.load(sk + at_src, mask=inside).to(dk.dtype.element_ty), mask=inside)
    tl.store(dv + at_dst, tl.load(sv + at_src, mask=inside).to(dv.dtype.element_ty), mask=inside)


def _add_norm_kernel(  # type: ignore[no-untyped-def]
    x, res, w, out_sum, out_norm, stride_x, stride_r, n_cols, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program n: row n's s = x + res (rounded to the dtype, as torch adds) and the RMSNorm of s."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    inside = c < n_cols
    a = tl.load(x + row * stride_x + c, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(res + row * stride_r + c, mask=inside, other=0.0).to(tl.float32)
    s = (a + b).to(out_sum.dtype.element_ty)
    tl.store(out_sum + row * n_cols + c, s, mask=inside)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / n_cols
    y = (sf * tl.rsqrt(var + eps)).to(out_norm.dtype.element_ty).to(tl.float32)
    wv = tl.load(w + c, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_norm + row * n_cols + c, (wv * y).to(out_norm.dtype.element_ty), mask=inside)


def _rope_kernel(  # type: ignore[no-untyped-def]
    x, cos, sin, out, stride_n, stride_h, stride_c,
    D: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """Program (n, h): out = x * cos + rotate_half(x) * sin for token n's head h."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D)
    base = x + n * stride_n + h * stride_h
    xv = tl.load(base + d).to(tl.float32)
    partner = tl.load(base + (d + HALF) % D).to(tl.float32)
    rot = tl.where(d < HALF, -partner, partner)  # rotate_half: [-x2, x1] (negated in fp32: exact)
    c = tl.load(cos + n * stride_c + d).to(tl.float32)
    s = tl.load(sin + n * stride_c + d).to(tl.float32)
    dt = out.dtype.element_ty
    y = (xv * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)  # torch's roundings
    tl.store(out + (n * tl.num_programs(1) + h) * D + d, y.to(dt))
