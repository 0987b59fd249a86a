"""Triton, loaded lazily, and what the kernel modules share.

Triton is imported lazily, at the first launch (`load`): the engine core imports the kernel
modules with torch alone (Triton may not even be installed), and importing them does not fix the
interpreter mode. That mode is Triton's, fixed when Triton itself is first imported (its library
functions are decorated then): TRITON_INTERPRET must be set before anything imports Triton, as
the tests do at their top; `load` refuses to go on when it was set too late, and patches the
interpreter (`patch_interpreter_index`).

A kernel module writes its kernels as plain functions that refer to `triton` and `tl` as
globals; `jit` binds those globals at the first launch and decorates the kernels with
`triton.jit`. Triton compiles a kernel again for each new combination of its integer arguments'
properties (1, a multiple of 16, or neither) and of its `constexpr` values: an argument that
follows a table's width or a session's length (a stride, a count) is named in `jit`'s `loose`
(`do_not_specialize`), and a `constexpr` that follows one is rounded to a power of two, so that
a kernel has a handful of variants, compiled before ready (`h3d.engine.warmup`), rather than
one per width met by a step. `COMPILES` counts the variants this process compiled or loaded from
Triton's cache (the daemon's `slow_step` and `warmed` events report them).

`runs_on(device)` tells a wrapper whether to launch its kernels (CUDA tensors, or CPU tensors
under `TRITON_INTERPRET=1`) or to run its torch twin.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET, read as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


@cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the Triton kernels can run here: Triton is installed, and a GPU or the interpreter is there."""
    return triton_installed() and (interpreting() or torch.cuda.is_available())


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on `device`'s tensors: Triton is installed, and the device is CUDA or
    the interpreter is on. Otherwise the torch twins run."""
    return triton_installed() and (device.type == "cuda" or interpreting())


@dataclass(slots=True)
class Compiles:
    """Kernel variants this process compiled (or loaded from Triton's cache) since it started,
    and the seconds that took (Triton's JIT hooks)."""

    count: int = 0
    seconds: float = 0.0
    _began: float = 0.0

    def begin(self, **_: Any) -> None:  # `knobs.runtime.jit_cache_hook` (None: go on and compile)
        self.count += 1
        self._began = time.perf_counter()

    def end(self, **_: Any) -> None:  # `knobs.runtime.jit_post_compile_hook`
        self.seconds += time.perf_counter() - self._began


COMPILES = Compiles()


@cache
def load() -> SimpleNamespace:
    """Import Triton, once: `triton`, `tl`, `interpret` (the interpreter's mode) and `dtypes`
    (torch's floating dtypes as `tl`'s)."""
    import triton
    import triton.language as tl

    interpret = bool(triton.knobs.runtime.interpret)
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.max, InterpretedFunction):
            raise RuntimeError("paged_decode: Triton was imported before TRITON_INTERPRET was set; set it first")
        patch_interpreter_index()
    else:
        hooks = triton.knobs.runtime
        if hooks.jit_cache_hook is None and hooks.jit_post_compile_hook is None:
            hooks.jit_cache_hook, hooks.jit_post_compile_hook = COMPILES.begin, COMPILES.end
    return SimpleNamespace(
        triton=triton,
        tl=tl,
        interpret=interpret,
        dtypes={torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16},
    )


def jit(
    module_globals: dict[str, Any], loose: Mapping[str, Sequence[str]] | None = None, **kernels: Callable[..., Any]
) -> SimpleNamespace:
    """Load Triton, bind it as `triton` and `tl` in `module_globals` (the calling module's
    `globals()`, where its kernels look `tl` up), and decorate the `kernels` with `triton.jit`,
    under the same names; `loose[name]`: that kernel's integer arguments not specialized on (the
    module docstring)."""
    t = load()
    module_globals["triton"], module_globals["tl"] = t.triton, t.tl
    loose = loose or {}
    return SimpleNamespace(
        **{name: t.triton.jit(fn, do_not_specialize=tuple(loose.get(name, ()))) for name, fn in kernels.items()}
    )


def patch_interpreter_index() -> None:
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


def dot_dtype(dtype: torch.dtype) -> Any:
    """The operand type of the kernel's `tl.dot`s: the pools' own. Under the interpreter, bf16 goes
    through fp32 instead, since Triton 3.6's interpreter multiplies bf16's raw uint16 bits (the
    values are rounded to bf16 first all the same, so the results match the GPU's)."""
    t = load()
    if dtype not in t.dtypes:
        raise ValueError(f"paged_decode: pools of {dtype} are not supported (fp32, bf16, fp16)")
    return t.tl.float32 if t.interpret and dtype == torch.bfloat16 else t.dtypes[dtype]


def _pinned(t: torch.Tensor) -> bool:
    """Pinned by torch's allocator or registered, or pinned pages mapped by `h3d.kv.hostmem`."""
    from h3d.kv import hostmem

    return hostmem.mapped(t.data_ptr()) or t.is_pinned()


def addressable(pool: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A slab the kernel can read from `device`: on it, or pinned host memory (zero-copy over PCIe)."""
    if pool.stride(-1) != 1 or pool.stride(-2) != pool.shape[-1]:
        raise ValueError("paged_decode: each pool's [bs, D] tiles must be contiguous")
    if device.type == "cuda" and pool.device.type == "cpu" and not _pinned(pool):
        raise ValueError("paged_decode: a host pool read from the GPU must be pinned (KVPool(pin_memory=True))")
    return pool
