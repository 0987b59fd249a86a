"""Block digests: per block and KV head, the element-wise min and max of its keys (post-RoPE).

Quest's bound: for a query q, `sum_d max(q_d * min_d, q_d * max_d)` is >= q . k for every key k of
the block, so ranking blocks by it never ranks a block below its true best key's score.

A block's digest is kept per `digest_tokens` tokens (config key, default `DIGEST_TOKENS` = 8: four
parts of a 32-token block) and its bound is the larger of its parts': the bound of a narrower range
is tighter, so a block holding one relevant token stands out more (Quest found 16-token pages
better than larger ones; on the 8K retrieval benchmark 8-token parts found more needles than
16-token ones: docs/BENCHMARKS.md, "Retrieval quality per HBF policy and budget").

Digests live on the compute device for every block of every session (they are what selection
reads each step): per session a tensor [L, Hkv, capacity * parts, 2, D] in the KV dtype, grown by
a quarter. Cost: 2 * head_dim * element size per part and KV head, i.e. 1 / digest_tokens of the
KV itself (1/8 by default): 3 KV heads x 64 dims x fp32 x 4 parts = 6 KiB per 32-token block of
all heads, 184 MiB for a 32K-token session of the embedded model (30 layers); 1/16 with
`digest_tokens = 16`.

Owner: `DigestStore`, updated by the model runner as K rows are written (the partial last block's
digest is kept current token by token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h3d.kv.blocks import SeqId

DIGEST_TOKENS = 8  # tokens per digest by default: a block of block_size tokens has block_size / 8 parts


class DigestStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        part_tokens: int = DIGEST_TOKENS,
    ) -> None:
        self.shape = (num_layers, num_kv_heads)
        self.head_dim = head_dim
        self.block_size = block_size
        self.parts = max(1, block_size // part_tokens)
        self.part_tokens = block_size // self.parts
        self.dtype = dtype
        self.device = device
        self._digests: dict[SeqId, torch.Tensor] = {}  # [L, Hkv, cap, 2, D]

    def _empty(self, capacity: int) -> torch.Tensor:
        d = torch.empty((*self.shape, capacity, 2, self.head_dim), dtype=self.dtype, device=self.device)
        d[..., 0, :] = torch.finfo(self.dtype).max  # running min
        d[..., 1, :] = torch.finfo(self.dtype).min  # running max
        return d

    def ensure(self, seq: SeqId, num_parts: int) -> torch.Tensor:
        d = self._digests.get(seq)
        if d is None or d.shape[2] < num_parts:
            # Grown by a quarter (not doubled): a long prompt's digests are large, and doubling them
            # at its first decode step would take twice their memory at once.
            grown = self._empty(max(num_parts, 5 * (d.shape[2] if d is not None else 4) // 4))
            if d is not None:
                grown[:, :, : d.shape[2]] = d
            self._digests[seq] = d = grown
        return d

    def has(self, seq: SeqId) -> bool:
        return seq in self._digests

    def data_ptr(self, seq: SeqId) -> int:
        """Where the session's store is (a captured step reads it there; growing it moves it)."""
        return self._digests[seq].data_ptr()

    def reserve(self, seq: SeqId, num_blocks: int) -> None:
        """Room for `num_blocks` blocks of `seq` now (a session whose length is known: no growth,
        and no copy of the old digests beside the new ones, later)."""
        self.ensure(seq, num_blocks * self.parts)

    def get(self, seq: SeqId, layer: int, num_blocks: int) -> torch.Tensor:
        """[Hkv, num_blocks, parts, 2, D]: (min, max) of the keys of each part of each block."""
        d = self._digests[seq][layer, :, : num_blocks * self.parts]
        return d.view(d.shape[0], num_blocks, self.parts, 2, self.head_dim)

    def update(self, seq: SeqId, layer: int, start: int, k: torch.Tensor) -> None:
        """Fold the keys of positions start, start + 1, ... into their parts' digests. k: [n, Hkv, D].

        Whole parts (a long chunk's) take one min/max reduction each; the partial parts at either
        end fold their keys in by scatter, so a partial part grows token by token. No host sync."""
        n = k.shape[0]
        if not n:
            return
        pt = self.part_tokens
        last = (start + n - 1) // self.block_size + 1
        d = self.ensure(seq, last * self.parts)[layer]  # [Hkv, cap, 2, D]
        kt = k.transpose(0, 1).to(self.dtype)  # [Hkv, n, D]
        a = min(n, -start % pt)  # keys before the first part boundary
        b = a + (n - a) // pt * pt  # the end of the whole parts
        if b > a:
            first, whole = (start + a) // pt, kt[:, a:b].unflatten(1, (-1, pt))  # [Hkv, m, pt, D]
            span = slice(first, first + whole.shape[1])
            d[:, span, 0] = torch.minimum(d[:, span, 0], whole.amin(dim=2))
            d[:, span, 1] = torch.maximum(d[:, span, 1], whole.amax(dim=2))
        for lo, hi in ((0, a), (b, n)):
            if hi > lo:
                parts = torch.arange(start + lo, start + hi, device=self.device) // pt  # [m]: each key's part
                idx = parts[None, :, None].expand(kt.shape[0], -1, self.head_dim)  # [Hkv, m, D]
                d[:, :, 0].scatter_reduce_(1, idx, kt[:, lo:hi], reduce="amin", include_self=True)
                d[:, :, 1].scatter_reduce_(1, idx, kt[:, lo:hi], reduce="amax", include_self=True)

    def layer(self, seq: SeqId, layer: int) -> torch.Tensor:
        """One layer of the session's store: [Hkv, capacity * parts, 2, D] (min, max)."""
        return self._digests[seq][layer]

    def fold(self, seq: SeqId, layer: int, pos: torch.Tensor, k: torch.Tensor) -> None:
        """`update` of one new key whose position is in a tensor (a decode step captured in a CUDA
        graph: no host value is read). k: [1, Hkv, D]; pos: [1] int64 on the device. The store must
        already hold its part (`ensure`)."""
        d = self._digests[seq][layer]  # [Hkv, cap, 2, D]
        idx = (pos // self.part_tokens).view(1, 1, 1).expand(d.shape[0], 1, self.head_dim)
        kt = k.transpose(0, 1).to(self.dtype)  # [Hkv, 1, D]
        d[:, :, 0].scatter_reduce_(1, idx, kt, reduce="amin", include_self=True)
        d[:, :, 1].scatter_reduce_(1, idx, kt, reduce="amax", include_self=True)

    def truncate(self, seq: SeqId, num_tokens: int, tail: Callable[[int, int], torch.Tensor]) -> None:
        """Forget the keys past `num_tokens`: the parts after it start over, and the part it ends in
        is folded again from `tail(layer, start)`, its kept keys ([n, Hkv, D] from position start)."""
        d = self._digests.get(seq)
        if d is None:
            return
        first = num_tokens // self.part_tokens  # the first part that held a cut key
        d[:, :, first:, 0] = torch.finfo(self.dtype).max
        d[:, :, first:, 1] = torch.finfo(self.dtype).min
        if num_tokens % self.part_tokens:
            start = first * self.part_tokens
            for layer in range(self.shape[0]):
                self.update(seq, layer, start, tail(layer, start))

    def drop(self, seq: SeqId) -> None:
        self._digests.pop(seq, None)

    def nbytes(self) -> int:
        return sum(d.numel() * d.element_size() for d in self._digests.values())


def block_scores(q: torch.Tensor, digests: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """Quest upper bound per block, max over all query heads (or over each KV head's group).

    q: [H, D] (one token's queries); digests: [Hkv, nb, 2, D], or [Hkv, nb, parts, 2, D] (a block's
    bound is its parts' largest) -> [nb] fp32 ([Hkv, nb] `per_head`). Each query head is scored
    against its KV head's digest (GQA groups of H / Hkv heads).
    """
    if digests.dim() == 5:
        hkv, nb, parts = digests.shape[:3]
        flat = block_scores(q, digests.reshape(hkv, nb * parts, 2, -1), per_head=True)  # [Hkv, nb * parts]
        per_block = flat.view(hkv, nb, parts).amax(dim=2)
        return per_block if per_head else per_block.amax(dim=0)
    h, d = q.shape
    hkv = digests.shape[0]
    # sum_d max(q_d lo_d, q_d hi_d) = hi . max(q, 0) + lo . min(q, 0): two small matrix products
    # in the digests' dtype instead of an elementwise [Hkv, G, nb, D] tensor.
    qg = q.to(digests.dtype).view(hkv, h // hkv, d).transpose(1, 2)  # [Hkv, D, G]
    lo, hi = digests[:, :, 0], digests[:, :, 1]  # [Hkv, nb, D]
    bound = (torch.bmm(hi, qg.clamp(min=0)) + torch.bmm(lo, qg.clamp(max=0))).float()  # [Hkv, nb, G]
    return bound.amax(dim=2) if per_head else bound.amax(dim=(0, 2))  # [Hkv, nb] or [nb]
