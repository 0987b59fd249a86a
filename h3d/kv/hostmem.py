"""Pinned host memory that the GPU reads in place fast: one contiguous virtual range, filled with
pinned pages piece by piece (CUDA's virtual memory management, the driver API through ctypes).

Why: the decode kernels read the DDR pool in place over PCIe, a few KiB at a time, scattered over
tens of GB. Pageable memory registered with `cudaHostRegister` (what `h3d.kv.pool.Pinning` does)
is read that way at about two thirds of the speed of memory the driver allocated pinned itself
(`cudaHostAlloc`), transparent huge pages or not (`python -m h3d.bench.ddr_reads`, H100,
docs/BENCHMARKS.md). But one `cudaHostAlloc` of ~100 GB can fail, takes tens of seconds, and is
usable only once it returns. `cuMemCreate` of host memory (`CU_MEM_LOCATION_TYPE_HOST_NUMA`,
CUDA 12.2+) gives the driver's own pinned pages in pieces, and `cuMemMap` places each piece in a
range reserved up front, so that a pool is one tensor the kernels index by slot and its lowest
slots are usable while the rest is still being mapped. The CPU reads and writes it as any memory
(`cuMemSetAccess` for the host as well as the device), as NCCL's host buffers do.

`HostRange(size)` reserves; `map(offset, size)` backs a piece (0, or the driver's error); `close()`
unmaps and frees (`h3d.kv.pool` makes the tensors over it, and closes it once they are gone).
`supported()` says whether this driver can (else the pool registers pageable memory instead);
`mapped(ptr)` whether a pointer lies in an open range (the kernels' check, `h3d.kernels.loader`).
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from typing import Any

import torch

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_DEVICE, _HOST_NUMA = 1, 3  # CU_MEM_LOCATION_TYPE_*
_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
CLOSED = -1  # `map`'s answer once the range is closed


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@cache
def _cuda() -> Any:
    """libcuda with the signatures used here; None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    sigs = {
        "cuMemGetAllocationGranularity": [p(size), p(_Prop), ctypes.c_int],
        "cuMemAddressReserve": [p(u64), size, size, u64, u64],
        "cuMemAddressFree": [u64, size],
        "cuMemCreate": [p(u64), size, p(_Prop), u64],
        "cuMemRelease": [u64],
        "cuMemMap": [u64, size, size, u64, u64],
        "cuMemUnmap": [u64, size],
        "cuMemSetAccess": [u64, size, p(_Access), size],
        "cuCtxGetCurrent": [p(ctypes.c_void_p)],
        "cuCtxSetCurrent": [ctypes.c_void_p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _prop(node: int) -> _Prop:
    prop = _Prop()
    prop.type = _PINNED
    prop.location = _Location(_HOST_NUMA, node)
    return prop


def gpu_numa_node(device: torch.device) -> int:
    """The NUMA node the GPU hangs off (0 where the system does not say, as in most VMs)."""
    props = torch.cuda.get_device_properties(device)
    ids = [int(getattr(props, f"pci_{x}_id", 0)) for x in ("domain", "bus", "device")]
    try:
        with open(f"/sys/bus/pci/devices/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/numa_node") as f:
            return max(0, int(f.read().strip()))
    except (OSError, ValueError):
        return 0


@cache
def granularity(node: int = 0) -> int:
    """The driver's piece size for host memory on `node`, 0 where it has none (no such support)."""
    lib = _cuda()
    if lib is None or not torch.cuda.is_available():
        return 0
    torch.cuda.init()
    out = ctypes.c_size_t(0)
    prop = _prop(node)
    return int(out.value) if lib.cuMemGetAllocationGranularity(ctypes.byref(out), ctypes.byref(prop), 0) == 0 else 0


def supported(node: int = 0) -> bool:
    return granularity(node) > 0


_live: dict[int, int] = {}  # base -> size of every open range (`mapped`)
_live_lock = threading.Lock()


def mapped(ptr: int) -> bool:
    """Whether host pointer `ptr` lies in an open `HostRange` (the GPU addresses it in place): a
    lookup of the ranges this process opened, no driver call (it runs at each kernel launch)."""
    with _live_lock:
        return any(base <= ptr < base + size for base, size in _live.items())


class HostRange:
    """`size` bytes (rounded up to the granularity) of virtual addresses, backed piece by piece."""

    def __init__(self, size: int, device: torch.device, node: int | None = None) -> None:
        lib = _cuda()
        if lib is None or not torch.cuda.is_available():
            raise RuntimeError("this CUDA driver cannot map pinned host memory (no CUDA device)")
        self.node = gpu_numa_node(device) if node is None else node
        self.granularity = granularity(self.node)
        if lib is None or not self.granularity:
            raise RuntimeError("this CUDA driver cannot map pinned host memory (cuMemCreate on the host)")
        self._lib, self.device = lib, device
        torch.cuda.init()
        torch.empty(0, device=device)  # the device's primary context current on this thread
        ctx = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(ctx))
        self._ctx = ctx
        g = self.granularity
        self.size = (size + g - 1) // g * g
        base = ctypes.c_uint64(0)
        err = lib.cuMemAddressReserve(ctypes.byref(base), self.size, max(g, 2 << 20), 0, 0)
        if err:
            raise RuntimeError(f"reserving {self.size / 1e9:.1f} GB of addresses failed (CUDA error {err})")
        self.base = int(base.value)
        with _live_lock:
            _live[self.base] = self.size
        self._lock = threading.Lock()
        self._mapped: list[tuple[int, int, int]] = []  # (offset, size, handle)

    def map(self, offset: int, size: int) -> int:
        """Back [offset, offset + size) (multiples of the granularity) with pinned pages that both
        the GPU and the CPU address; 0, or the driver's error (nothing left mapped then)."""
        lib = self._lib
        if not self.size:
            return CLOSED
        lib.cuCtxSetCurrent(self._ctx)
        handle = ctypes.c_uint64(0)
        prop = _prop(self.node)
        err = lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0)
        if err:
            return int(err)
        ptr = self.base + offset
        err = lib.cuMemMap(ptr, size, 0, handle, 0)
        if err:
            lib.cuMemRelease(handle)
            return int(err)
        access = (_Access * 2)(
            _Access(_Location(_DEVICE, self.device.index or 0), _READWRITE),
            _Access(_Location(_HOST_NUMA, self.node), _READWRITE),
        )
        err = lib.cuMemSetAccess(ptr, size, access, 2)
        if err:
            lib.cuMemUnmap(ptr, size)
            lib.cuMemRelease(handle)
            return int(err)
        with self._lock:
            if self.size:
                self._mapped.append((offset, size, int(handle.value)))
                return 0
        lib.cuMemUnmap(ptr, size)  # closed meanwhile
        lib.cuMemRelease(handle)
        return CLOSED

    def close(self) -> None:
        """Unmap and release every piece, then the addresses (no tensor over them may be used after)."""
        with self._lock:
            pieces, self._mapped = self._mapped, []
            size, self.size = self.size, 0
        with _live_lock:
            _live.pop(self.base, None)
        lib = self._lib
        lib.cuCtxSetCurrent(self._ctx)
        for offset, n, handle in pieces:
            lib.cuMemUnmap(self.base + offset, n)
            lib.cuMemRelease(handle)
        if size:
            lib.cuMemAddressFree(self.base, size)
