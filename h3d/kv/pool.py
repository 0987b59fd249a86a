"""The bytes of the KV cache: K and V slabs indexed by slot, preallocated once.

Owner: the model runner. Which slot belongs to which block is `h3d.kv.blocks`'s business; this
module only stores and moves bytes. Slot 0 (`NULL_SLOT`) is never written and stays zero.
"""

from __future__ import annotations

import torch

from h3d.kv.blocks import NULL_SLOT


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
        # empty, not zeros: a multi-GiB pool would be written in full at start. Attention never
        # uses bytes past a sequence's length (it slices them off or zeroes them), and the null
        # slot, which pads tables, is zeroed here.
        # pin_memory: the DDR pool of a CUDA host, which the GPU reads and copies from directly.
        self.k = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
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
