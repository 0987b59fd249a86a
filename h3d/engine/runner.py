"""The model runner: turns a step's chunks into one packed forward over the paged KV cache.

Owner of the KV pool tensors and (through `BlockManager`) of the block tables. A *chunk* is a run
of a sequence's tokens whose K/V are not in the cache yet: a prefill chunk of many tokens or a
decode step's one token; both go through the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from h3d.kv.attention import AttentionBatch
from h3d.kv.blocks import BlockManager, SeqId
from h3d.kv.pool import KVPool
from h3d.model.llama import CausalLM


@dataclass(frozen=True, slots=True)
class Chunk:
    """`token_ids` of `seq` to feed now, the first at position `start` (= its cached length)."""

    seq: SeqId
    token_ids: tuple[int, ...]
    start: int
    want_logits: bool


class ModelRunner:
    def __init__(self, model: CausalLM, slots_per_layer: int, block_size: int, check_invariants: bool = False) -> None:
        cfg = model.config
        self.model = model
        self.device = model.lm_head.weight_t.device
        self.blocks = BlockManager(slots_per_layer, cfg.num_layers, block_size)
        dtype = model.lm_head.weight_t.dtype
        self.pool = KVPool(self.blocks.num_slots, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.check_invariants = check_invariants

    def cached_tokens(self, seq: SeqId) -> int:
        return self.blocks.table(seq).num_tokens

    def can_fit(self, chunks: list[Chunk]) -> bool:
        need = sum(self.blocks.blocks_needed(c.seq, len(c.token_ids)) for c in chunks)
        return need <= self.blocks.num_free

    def _batch(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        rows, positions, seq_ends = [], [], []
        for c in chunks:
            if self.blocks.table(c.seq).num_tokens != c.start:
                raise RuntimeError(
                    f"chunk for seq {c.seq} starts at {c.start}, cache holds {self.cached_tokens(c.seq)}"
                )
            rows.append(self.blocks.append(c.seq, len(c.token_ids)))  # [L, n]
            end = c.start + len(c.token_ids)
            positions.append(np.arange(c.start, end, dtype=np.int64))
            seq_ends.append(np.full(len(c.token_ids), end, dtype=np.int64))
        seqs = [c.seq for c in chunks]
        kv_lens = tuple(self.blocks.table(s).num_tokens for s in seqs)
        dev = self.device
        batch = AttentionBatch(
            query_lens=tuple(len(c.token_ids) for c in chunks),
            kv_lens=kv_lens,
            write_rows=torch.from_numpy(np.concatenate(rows, axis=1)).to(dev),
            block_tables=torch.from_numpy(self.blocks.padded_tables(seqs)).to(dev),
            kv_lens_t=torch.tensor(kv_lens, dtype=torch.int64, device=dev),
            seq_ends=torch.from_numpy(np.concatenate(seq_ends)).to(dev),
            runs=tuple(self.blocks.runs(s) for s in seqs),
        )
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=dev)
        return ids, torch.from_numpy(np.concatenate(positions)).to(dev), batch

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        """Run the chunks; return fp32 logits of each chunk's last token where `want_logits`
        ([M, vocab]), or of every token when `all_logits` ([N, vocab])."""
        ids, positions, batch = self._batch(chunks)
        hidden = self.model(ids, positions, self.pool, batch)  # [N, hidden]
        if self.check_invariants:
            self.blocks.check_invariants()
        if all_logits:
            return self.model.logits(hidden)
        ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
        pick = [int(e) for e, c in zip(ends, chunks, strict=True) if c.want_logits]
        if not pick:
            return hidden.new_zeros((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[pick])

    def open(self, seq: SeqId) -> None:
        self.blocks.allocate(seq)

    def release(self, seq: SeqId) -> None:
        self.blocks.free(seq)
