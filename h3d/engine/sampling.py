"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

Each request with a seed owns a `torch.Generator` seeded once, so its tokens are reproducible
whatever else is in the batch. Greedy rows are one batched argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h3d.errors import InvalidRequest

MIN_TEMPERATURE = 1e-6  # temperatures in [0, this) sample greedily


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks tokens and when it stops. temperature 0 is greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise InvalidRequest(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        # Below MIN_TEMPERATURE, logits / temperature overflow to inf and the softmax to NaN.
        return self.temperature < MIN_TEMPERATURE


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] fp32 -> one token id."""
    if params.greedy or generator is None:
        return int(torch.argmax(logits).item())
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = cumulative - torch.softmax(sorted_scores, dim=-1) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [B, vocab] -> B token ids; greedy rows in one argmax."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    return [
        greedy[i] if p.greedy else sample(logits[i], p, g)
        for i, (p, g) in enumerate(zip(params, generators, strict=True))
    ]
