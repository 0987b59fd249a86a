"""Two fusions of the decoder's small ops, each in one launch: `add_rms_norm` (the residual add and
the next RMSNorm) and `rotary` (RoPE), each with its torch twin that the CPU runs; the tests run
the kernels under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from h3d.kernels import loader

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the norm and RoPE kernels, once."""
    return loader.jit(globals(), add_norm=_add_norm_kernel, rope=_rope_kernel)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm of a decoder, in one launch: returns (s, norm(s)) with
    s = x + residual in x's dtype and norm(s) = weight * (s * rsqrt(mean(s^2) + eps) in fp32,
    rounded to the dtype) rounded again, transformers' two roundings. x, residual: [N, H].
    Without Triton (the CPU), the same in torch ops."""
    if loader.runs_on(x.device):
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
    if loader.runs_on(x.device):
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


# The kernels, as plain functions: `_kernels()` decorates them with `triton.jit` at the first launch.


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
