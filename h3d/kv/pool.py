"""The bytes of the KV cache: K and V slabs indexed by slot, preallocated once.

Owner: the model runner. Which slot belongs to which block is `h3d.kv.blocks`'s business; this
module only stores and moves bytes. Slot 0 (`NULL_SLOT`) is never written and stays zero.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch

from h3d.kv.blocks import NULL_SLOT

PIN_PIECE = 4 << 30  # a pinned slab larger than this is host memory registered with CUDA piece by piece
PIN_THREADS = 8  # pieces registered at once
PAGE = 4096


class _Registered:
    """Pageable host memory page-locked for the GPU by `cudaHostRegister`, in pieces of PIN_PIECE
    bytes: one `cudaHostAlloc` of ~100 GB can fail (docs/BENCHMARKS.md, "GPU: h3d against
    transformers on the H200", Many sessions), while the same memory registered piece by piece is
    one contiguous range the kernels read in place (under unified addressing a registered page's
    device address is its host address). Unregistered when the tensor that holds this object goes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        base = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size()
        self.pieces: list[int] = []
        # Cut at page boundaries (the allocation itself need not start on one): no page is in two pieces.
        cuts = [base, *((base + at) & ~(PAGE - 1) for at in range(PIN_PIECE, size, PIN_PIECE)), base + size]
        # Registering pages already faulted in is about 5x faster than fresh ones, and faulting them
        # in (writing zeros) runs on torch's CPU threads: on the H200 host, 16 GiB took 7.9 s fresh on
        # one thread, 1.4 s to zero and 1.0 s to register on PIN_THREADS (docs/BENCHMARKS.md).
        tensor.view(-1).view(torch.uint8).zero_()
        cudart = torch.cuda.cudart()

        def register(piece: tuple[int, int]) -> int:
            # flags: portable (every context) | mapped (device-addressable)
            return int(cudart.cudaHostRegister(piece[0], piece[1] - piece[0], 3))

        pieces = list(itertools.pairwise(cuts))
        with ThreadPoolExecutor(min(PIN_THREADS, len(pieces))) as pool:
            errors = list(pool.map(register, pieces))
        self.pieces = [ptr for (ptr, _), err in zip(pieces, errors, strict=True) if err == 0]
        failed = next((err for err in errors if err != 0), 0)
        if failed:
            self.close()
            raise RuntimeError(f"cudaHostRegister of {size / 1e9:.1f} GB of host memory failed (error {failed})")

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        for ptr in self.pieces:
            cudart.cudaHostUnregister(ptr)
        self.pieces = []

    def __del__(self) -> None:
        self.close()


def _host_slab(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor; pinned when `pin` (registered in pieces when large, `_Registered`)."""
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if not pin or size <= PIN_PIECE:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    t = torch.empty(shape, dtype=dtype)
    t._h3d_registered = _Registered(t)  # type: ignore[attr-defined]  # lives (and unregisters) with t
    return t


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
    ) -> None:
        shape = (num_kv_heads, num_slots, block_size, head_dim)
        # empty, not zeros: a multi-GiB pool would be written in full at start (except a pinned slab
        # registered in pieces, whose pages are faulted in by zeroing: `_Registered`). Attention
        # never uses bytes past a sequence's length (it slices them off or zeroes them), and the
        # null slot, which pads tables, is zeroed here.
        # pin_memory: the DDR pool of a CUDA host, which the GPU reads and copies from directly.
        if device.type == "cpu":
            self.k, self.v = _host_slab(shape, dtype, pin_memory), _host_slab(shape, dtype, pin_memory)
        else:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, NULL_SLOT] = 0
        self.v[:, NULL_SLOT] = 0
        self.num_slots = num_slots
        self.block_size = block_size

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
