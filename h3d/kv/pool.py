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
    ) -> None:
        shape = (num_kv_heads, num_slots, block_size, head_dim)
        # zeros, not empty: padded gathers read unused rows, and 0 * NaN would poison the output.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows: [n] pool rows (slot * block_size + offset); k, v: [n, kv_heads, head_dim]."""
        hkv, d = self.k.shape[0], self.k.shape[-1]
        self.k.view(hkv, -1, d).index_copy_(1, rows, k.transpose(0, 1).to(self.k.dtype))
        self.v.view(hkv, -1, d).index_copy_(1, rows, v.transpose(0, 1).to(self.v.dtype))
