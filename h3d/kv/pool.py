"""The bytes of the KV cache: K and V slabs indexed by slot, preallocated once.

Owner: the model runner. Which slot belongs to which block is `h3d.kv.blocks`'s business; this
module only stores and moves bytes. Slot 0 (`NULL_SLOT`) is never written and stays zero.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from h3d.config import DDR_MEMORY
from h3d.kv.blocks import NULL_SLOT

PIN_PIECE = 256 << 20  # a pinned slab is registered with CUDA in pieces of about this many bytes
PIN_THREADS = 8  # pieces registered at once
PIN_FIRST = 4 << 30  # bytes of the lowest slots registered before the pool is handed out; the rest after
PAGE = 4096

Registrar = Callable[[int, int], int]  # (address, bytes) -> 0, or the error of registering them


def _cuda_register(ptr: int, size: int) -> int:
    # flags: portable (every context) | mapped (device-addressable)
    return int(torch.cuda.cudart().cudaHostRegister(ptr, size, 3))


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class Pinning:
    """Pageable host memory page-locked for the GPU by `cudaHostRegister`, in pieces, lowest slots
    first, so that a pool can be used before all of it is registered.

    One `cudaHostAlloc` of ~100 GB can fail (docs/BENCHMARKS.md, "GPU: h3d against transformers on
    the H200", Many sessions), while the same memory registered piece by piece is one contiguous
    range the kernels read in place (under unified addressing a registered page's device address is
    its host address). And registering 100 GB takes tens of seconds (pages faulted in, then
    locked), which a start should not wait for: the pieces holding the lowest `PIN_FIRST` bytes'
    slots are registered at once, the rest on `PIN_THREADS` background threads, in slot order.
    `usable` is how many slots (from 0) are registered in every slab: all bytes of every head of a
    slot below it are; `BlockManager` hands out only those (`SlotAllocator.grow`).

    `slabs`: [heads, slots, ...] contiguous host tensors of one pool (its K and V). The slabs are
    cut at page boundaries (no page is in two pieces), at every head's start and every
    `PIN_PIECE` within a head. Unregistered at `close` (or when the pool goes)."""

    def __init__(
        self,
        slabs: Sequence[torch.Tensor],
        register: Registrar = _cuda_register,
        unregister: Callable[[int], None] = _cuda_unregister,
        first_bytes: int | None = None,
        piece_bytes: int | None = None,
        threads: int | None = None,
        align: int = PAGE,
        zero: bool = True,
    ) -> None:
        """`align`: where pieces may be cut (a slab's ends rounded out to it too); `zero`: fault each
        piece's pages in by zeroing them before `register` (memory mapped by `register` itself is
        not there before: `hostmem`)."""
        self._zero = zero
        first_bytes = PIN_FIRST if first_bytes is None else first_bytes
        piece_bytes = PIN_PIECE if piece_bytes is None else piece_bytes
        threads = PIN_THREADS if threads is None else threads
        self.num_slots = int(slabs[0].shape[1])
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = False
        self.t0 = time.perf_counter()
        self.done_s: float | None = None  # seconds from the start until every piece was registered
        self.registered: list[int] = []  # addresses of the pieces registered (unregistered at close)
        self.error: str | None = None  # why registering stopped short (the pool stays at `usable`)
        pieces = [p for slab in slabs for p in self._pieces(slab, piece_bytes, align)]
        pieces.sort(key=lambda p: p[2])
        self._pending = [p[2] for p in pieces]  # the unregistered pieces' lowest slots, sorted (a multiset)
        self.usable = 0
        self._update()
        slot_bytes = sum(slab[0, 0].numel() * slab.element_size() * slab.shape[0] for slab in slabs)
        first_slot = max(1, first_bytes // max(slot_bytes, 1))
        now = [p for p in pieces if p[2] < first_slot]
        later = pieces[len(now) :]
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="h3d-pin")
        for _ in self._pool.map(self._one, now):
            pass
        if self.error is not None:
            self.close()
            raise RuntimeError(self.error)
        self._later = [self._pool.submit(self._one, p) for p in later]
        self._pool.shutdown(wait=False)

    @staticmethod
    def _pieces(slab: torch.Tensor, piece_bytes: int, align: int = PAGE) -> list[tuple[int, int, int]]:
        """(address, end, lowest slot of any of its bytes) of every piece of `slab`, cut at multiples
        of `align` (a power of two); where the slab's ends are not, its first and last pieces
        reach out to them (unless `align` is a page: registering takes any address)."""
        base = slab.data_ptr()
        size = slab.numel() * slab.element_size()
        heads, slots = int(slab.shape[0]), int(slab.shape[1])
        head_bytes = size // heads
        slot_bytes = head_bytes // slots
        per_piece = max(1, piece_bytes // slot_bytes) * slot_bytes
        lo, hi = (base, base + size) if align == PAGE else (base & ~(align - 1), -(-(base + size) // align) * align)
        cuts = {lo, hi}
        for h in range(heads):
            cuts.update((base + h * head_bytes + at) & ~(align - 1) for at in range(0, head_bytes, per_piece))
        edges = sorted(c for c in cuts if lo <= c <= hi)
        out = []
        for a, b in itertools.pairwise(edges):
            a_in, b_in = max(a, base), min(b, base + size)  # the slab's own bytes in the piece
            first, last = (a_in - base) // head_bytes, (b_in - 1 - base) // head_bytes
            # A piece that holds a head's first bytes holds slot 0; else its first byte's slot is its lowest.
            low = 0 if first != last else ((a_in - base) % head_bytes) // slot_bytes
            out.append((a, b, low))
        return out

    def _one(self, piece: tuple[int, int, int]) -> None:
        a, b, low = piece
        with self._lock:
            if self._closing or self.error is not None:
                return
        # Registering pages already faulted in is about 5x faster than fresh ones: on the H200
        # host, 16 GiB took 7.9 s fresh on one thread, 1.4 s to zero and 1.0 s to register on
        # PIN_THREADS (docs/BENCHMARKS.md). memset releases the GIL (ctypes).
        if self._zero:
            ctypes.memset(a, 0, b - a)
        err = self._register(a, b - a)
        with self._lock:
            if err != 0:
                self.error = f"pinning {(b - a) / 1e6:.0f} MB of host memory failed (CUDA error {err})"
                self._changed.notify_all()
                return
            self.registered.append(a)
            self._pending.remove(low)
            self._update()
            if not self._pending:
                self.done_s = time.perf_counter() - self.t0
            self._changed.notify_all()

    def _update(self) -> None:
        self.usable = self._pending[0] if self._pending else self.num_slots

    def wait(self, slots: int, timeout: float | None = None) -> int:
        """Block until at least `slots` slots are usable (or registering failed or was stopped by
        `close`, or `timeout`); returns `usable`."""
        with self._changed:
            self._changed.wait_for(lambda: self.usable >= slots or self.error is not None or self._closing, timeout)
            return self.usable

    def close(self) -> None:
        """Stop registering, wait for the pieces under way, and unregister every piece."""
        with self._lock:
            self._closing = True
            self._changed.notify_all()  # (a `wait` returns: what it waits for will not come)
        for f in getattr(self, "_later", ()):
            f.cancel()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            registered, self.registered = self.registered, []
        for ptr in registered:
            self._unregister(ptr)

    def __del__(self) -> None:
        self.close()


def _host_slab(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor; pinned when `pin` and small (a large one is registered by `Pinning`)."""
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.empty(shape, dtype=dtype, pin_memory=pin and size <= PIN_PIECE)


def _mapped_slabs(
    shape: tuple[int, ...], dtype: torch.dtype, gpu: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor, Pinning]:
    """K and V slabs in one `hostmem.HostRange` that `gpu` (default: the current card) reads, its
    pieces mapped by `Pinning` (lowest slots first, the rest in the background). The range is
    unmapped once no tensor over it is left. RuntimeError where the driver cannot."""
    from h3d.kv import hostmem

    if not torch.cuda.is_available():
        raise RuntimeError("this CUDA driver cannot map pinned host memory (no CUDA device)")
    device = gpu if gpu is not None and gpu.index is not None else torch.device("cuda", torch.cuda.current_device())
    node = hostmem.gpu_numa_node(device)
    g = hostmem.granularity(node)
    if not g:
        raise RuntimeError("this CUDA driver cannot map pinned host memory (cuMemCreate on the host)")
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    slab = -(-size // g) * g
    rng = hostmem.HostRange(2 * slab, device, node)
    buf = (ctypes.c_ubyte * (2 * slab)).from_address(rng.base)
    done = weakref.finalize(buf, rng.close)  # (tensors keep `buf` alive; `rng` does not)
    done.atexit = False  # at exit the process's memory goes anyway: no driver calls while CUDA tears down
    k, v = (torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=at).view(dtype).view(shape) for at in (0, slab))
    pinning = Pinning([k, v], lambda ptr, n: rng.map(ptr - rng.base, n), lambda ptr: None, align=g, zero=False)
    return k, v, pinning


class KVPool:
    """k, v: [kv_heads, num_slots, block_size, head_dim] each.

    Head-major: a run of consecutive slots is, for each KV head, one contiguous [tokens, head_dim]
    matrix, which attention reads in place. A block's bytes are `k[:, slot]` and `v[:, slot]`.
    """

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool = False,
        register: tuple[Registrar, Callable[[int], None]] | None = None,
        host_memory: str = "registered",
        gpu: torch.device | None = None,
    ) -> None:
        """`pin_memory`: a host pool the GPU reads; a large one pinned in the background (`Pinning`,
        `usable`). `host_memory` (`h3d.config.DDR_MEMORY`): how, where pinned: `registered` (pageable memory
        page-locked by `cudaHostRegister`), `mapped` (the driver's pinned pages mapped into one
        range, `h3d.kv.hostmem`: read in place faster), `auto` (mapped where the driver can, else
        registered: `host_memory_error` says why not). `gpu`: the card that reads a mapped pool.
        `register`: (register, unregister) instead of CUDA's (tests: a host pool registered the
        same way on a CPU)."""
        if host_memory not in DDR_MEMORY:
            raise ValueError(f"host_memory: one of {', '.join(DDR_MEMORY)}, got {host_memory!r}")
        shape = (num_kv_heads, num_slots, block_size, head_dim)
        # empty, not zeros: a multi-GiB pool would be written in full at start (except a pinned slab
        # registered in pieces, whose pages are faulted in by zeroing: `_Registered`). Attention
        # never uses bytes past a sequence's length (it slices them off or zeroes them), and the
        # null slot, which pads tables, is zeroed here.
        # pin_memory: the DDR pool of a CUDA host, which the GPU reads and copies from directly.
        self.pinning: Pinning | None = None
        self.host_memory = "pageable"  # how the host slabs were made (`ddr_memory` in the logs)
        self.host_memory_error: str | None = None  # why `auto` did not map (the driver's answer)
        mapped = False
        if device.type == "cpu" and pin_memory and register is None and host_memory != "registered":
            try:
                self.k, self.v, self.pinning = _mapped_slabs(shape, dtype, gpu)
                self.host_memory, mapped = "mapped", True
            except RuntimeError as e:
                if host_memory == "mapped":
                    raise RuntimeError(f"ddr_memory mapped: {e}") from e
                self.host_memory_error = str(e)
        if device.type == "cpu" and not mapped:
            self.k, self.v = _host_slab(shape, dtype, pin_memory), _host_slab(shape, dtype, pin_memory)
            if (pin_memory and not self.k.is_pinned()) or register is not None:
                self.pinning = Pinning([self.k, self.v], *(register or ()))
            self.host_memory = "registered" if pin_memory or register is not None else "pageable"
        elif not mapped:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, NULL_SLOT] = 0
        self.v[:, NULL_SLOT] = 0
        self.num_slots = num_slots
        self.block_size = block_size

    @property
    def usable(self) -> int:
        """Slots (from 0) that may be handed out: all of them, or those registered so far."""
        return self.num_slots if self.pinning is None else self.pinning.usable

    def close(self) -> None:
        if self.pinning is not None:
            self.pinning.close()

    @staticmethod
    def slots_for_budget(mb: float, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """How many slots (one layer's K+V for a block each) fit in `mb` MiB."""
        slot_bytes = 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return int(mb * 2**20) // slot_bytes

    @property
    def slot_bytes(self) -> int:
        return 2 * self.k[:, NULL_SLOT].numel() * self.k.element_size()

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the blocks in `slots` ([n]): k, v [Hkv, n, block_size, D]."""
        return self.k[:, slots], self.v[:, slots]

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks: k, v [Hkv, n, block_size, D] into `slots` ([n])."""
        self.k[:, slots] = k.to(self.k.device, self.k.dtype, non_blocking=True)
        self.v[:, slots] = v.to(self.v.device, self.v.dtype, non_blocking=True)

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows: [n] pool rows (slot * block_size + offset); k, v: [n, kv_heads, head_dim]."""
        hkv, d = self.k.shape[0], self.k.shape[-1]
        self.k.view(hkv, -1, d).index_copy_(1, rows, k.transpose(0, 1).to(self.k.dtype))
        self.v.view(hkv, -1, d).index_copy_(1, rows, v.transpose(0, 1).to(self.v.dtype))
