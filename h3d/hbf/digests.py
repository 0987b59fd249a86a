"""Block digests: per block and KV head, the element-wise min and max of its keys (post-RoPE).

Quest's bound: for a query q, `sum_d max(q_d * min_d, q_d * max_d)` is >= q . k for every key k of
the block, so ranking blocks by it never ranks a block below its true best key's score.

Digests live on the compute device for every block of every session (they are what selection
reads each step): per session a tensor [L, Hkv, capacity, 2, D] in the KV dtype, grown by
doubling. Cost: 2 * head_dim * element size per block and KV head, i.e. 2 / block_size of the KV
itself (1/16 at block_size 32): 3 KV heads x 64 dims x fp32 = 1.5 KiB per block of all heads,
46 MiB for a 32K-token session of the embedded model (30 layers).

Owner: `DigestStore`, updated by the model runner as K rows are written (the partial last block's
digest is kept current token by token).
"""

from __future__ import annotations

import torch

from h3d.kv.blocks import SeqId


class DigestStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (num_layers, num_kv_heads)
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self._digests: dict[SeqId, torch.Tensor] = {}  # [L, Hkv, cap, 2, D]

    def _empty(self, capacity: int) -> torch.Tensor:
        d = torch.empty((*self.shape, capacity, 2, self.head_dim), dtype=self.dtype, device=self.device)
        d[..., 0, :] = torch.finfo(self.dtype).max  # running min
        d[..., 1, :] = torch.finfo(self.dtype).min  # running max
        return d

    def ensure(self, seq: SeqId, num_blocks: int) -> torch.Tensor:
        d = self._digests.get(seq)
        if d is None or d.shape[2] < num_blocks:
            grown = self._empty(max(num_blocks, 2 * (d.shape[2] if d is not None else 4)))
            if d is not None:
                grown[:, :, : d.shape[2]] = d
            self._digests[seq] = d = grown
        return d

    def get(self, seq: SeqId, layer: int, num_blocks: int) -> torch.Tensor:
        """[Hkv, num_blocks, 2, D]: (min, max) of each block's keys."""
        return self._digests[seq][layer, :, :num_blocks]

    def update(self, seq: SeqId, layer: int, positions: torch.Tensor, k: torch.Tensor) -> None:
        """Fold new keys into their blocks' digests. positions: [n] token positions; k: [n, Hkv, D]."""
        if not len(positions):
            return
        d = self.ensure(seq, int(positions.max().item()) // self.block_size + 1)[layer]  # [Hkv, cap, 2, D]
        blocks = (positions // self.block_size).to(self.device)  # [n]
        idx = blocks[None, :, None].expand(k.shape[1], -1, self.head_dim)  # [Hkv, n, D]
        kt = k.transpose(0, 1).to(self.dtype)  # [Hkv, n, D]
        d[:, :, 0].scatter_reduce_(1, idx, kt, reduce="amin", include_self=True)
        d[:, :, 1].scatter_reduce_(1, idx, kt, reduce="amax", include_self=True)

    def drop(self, seq: SeqId) -> None:
        self._digests.pop(seq, None)

    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self._digests.values())


def block_scores(q: torch.Tensor, digests: torch.Tensor) -> torch.Tensor:
    """Quest upper bound per block, max over all query heads.

    q: [H, D] (one token's queries); digests: [Hkv, nb, 2, D] -> [nb] fp32.
    Each query head is scored against its KV head's digest (GQA groups of H / Hkv heads).
    """
    h, d = q.shape
    hkv = digests.shape[0]
    qg = q.float().view(hkv, h // hkv, 1, d)  # [Hkv, G, 1, D]
    lo = digests[:, None, :, 0].float()  # [Hkv, 1, nb, D]
    hi = digests[:, None, :, 1].float()
    bound = torch.maximum(qg * lo, qg * hi).sum(-1)  # [Hkv, G, nb]
    return bound.amax(dim=(0, 1))  # [nb]
