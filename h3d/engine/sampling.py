"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds,
presence and frequency penalties.

Each request with a seed owns a `torch.Generator` seeded once, so its tokens are reproducible
whatever else is in the batch. Greedy rows are one batched argmax. The penalties are OpenAI's
(and vLLM's): before anything else, a token's logit loses `frequency_penalty` times the number of
times the request generated it, and `presence_penalty` once if it generated it at all (the
request's own tokens: neither the prompt nor the session's earlier turns count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h3d.errors import InvalidRequest

MIN_TEMPERATURE = 1e-6  # temperatures in [0, this) sample greedily
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be within -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got {value}")
        return self

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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


def penalize(logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int]) -> torch.Tensor:
    """logits: [vocab] -> the logits less the presence and frequency penalties of `output_ids` (the
    request's generated tokens so far); unchanged (the same tensor) without penalties or tokens."""
    if not params.penalized or not output_ids:
        return logits
    ids = torch.tensor(list(output_ids), dtype=torch.long, device=logits.device)
    counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)


class Argmax:
    """Each row's argmax, queued now and read when the tokens are needed: on a GPU the host goes
    on with other work (the step's rebalance, `Engine._run`) while the device finishes the forward
    and copies the ids into pinned memory; work queued after it does not delay the read."""

    def __init__(self, logits: torch.Tensor) -> None:
        ids = torch.argmax(logits, dim=-1)
        self._done: torch.cuda.Event | None = None
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
            ids = host
        self._ids = ids

    def tolist(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return list(self._ids.tolist())


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    outputs: Sequence[Sequence[int]] | None = None,
    argmax: Argmax | None = None,
) -> list[int]:
    """logits: [B, vocab] -> B token ids; greedy rows without penalties in one argmax (`argmax`,
    where it was queued before). `outputs`: each row's generated tokens so far (what the
    penalties count)."""
    greedy = (argmax or Argmax(logits)).tolist()
    picked = []
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.penalized and outputs is not None and outputs[i]:
            row = penalize(logits[i].float(), p, outputs[i])
            picked.append(int(torch.argmax(row).item()) if p.greedy else sample(row, p, g))
        else:
            picked.append(greedy[i] if p.greedy else sample(logits[i], p, g))
    return picked
