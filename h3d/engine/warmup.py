"""Warm before ready: what the daemon does between loading the model and saying it serves.

A first request should not pay for compiling kernels or capturing graphs. `warm_up` runs, before
`READY=1`:

1. kernels (CUDA, or where `kernels=True`): a scratch sequence, not a session (no token log, no
   archive), prefilled with a prompt one slice longer than the layer-by-layer path's threshold
   (the long-prompt path and its Triton kernels), then `DECODE_STEPS` eager decode steps (the
   decode kernels), then released; then batches of 2 and 16 scratch sequences past the window
   decode a few steps together under the configured policy and `exact` (`_batches`: the kernels'
   specializations for batches above one); then the decode kernels once per variant a step can
   need (`h3d.kernels.decode.warm_decode`: a host-planned step lists each layer's selection at
   its own width, and the merge of its splits comes in one variant per power of two of their
   count). Triton keeps what it compiled under `TRITON_CACHE_DIR` (the daemon puts it under its
   data folder), so a restart compiles nothing, and loads every variant before ready;
2. on CUDA, a check that a chunk over cached keys attended segment by segment, nothing copied
   (`h3d.kv.attention.segmented_attention`), equals the copying path: if not, the copying path
   serves (`chunk_segments` 0 in the `warmed` event);
3. the named set of decode graphs (`DecodeGraphs.warm_set`): batch 1 at every width bucket up to
   the longest context, exact and selecting; captured here where `graphs_now` (the daemon's
   `graphs_before_ready`), else left waiting and captured after ready, one graph per turn of the
   engine's idle loop (the 66 graphs of a Llama-8B shape at 128K took 8-13 s on H100s, a third of
   the start; a step that needs one first runs its forward uncaptured). From then on a graph
   outside the set is captured between steps, never on a step's path
   (`DecodeGraphs.capture_deferred`), and counted.

The read-ahead of the sessions a restart reopened (`read_ahead_at_start`) goes on during the
warm-up only at the steps' bounded share (`READ_AHEAD_STEP_MB` a step): pumped between every
graph capture as well, its reads slowed the warm-up's graphs (13.4 s on an H100 host against
9.4 s without it on another, docs/BENCHMARKS.md), and ready matters more; once ready, the idle
loop pumps it without that bound.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from h3d.engine.step import Chunk
from h3d.errors import InvalidRequest
from h3d.hbf.policy import policy_named
from h3d.kernels import decode, loader
from h3d.kv import attention
from h3d.kv.blocks import SeqId

if TYPE_CHECKING:
    from h3d.engine.engine import Engine

DECODE_STEPS = 3
BATCHES = (2, 16)  # decode batches the scratch sequences run (`_batches`)
PREFILLED = 2  # of each batch, the prompts computed; the others are forks


@dataclass(frozen=True, slots=True)
class Warmup:
    """What the warm-up did: the scratch prompt's tokens (0: none), the graphs captured, the
    batch sizes and widths of the named set, and the seconds each part took."""

    prompt_tokens: int
    kernels_s: float
    prefill_tokens_per_s: float  # the scratch prompt's second prefill (0: none run)
    graphs: int
    batches: tuple[int, ...]
    widths: tuple[int, int]  # the narrowest and widest table width (blocks), (0, 0) when none
    graphs_s: float
    # kernels_s by part (`_scratch`'s), and the variants each compiled or loaded (`*_compiles`)
    parts: dict[str, float] = field(default_factory=dict)
    compiles: int = 0  # kernel variants compiled or loaded from Triton's cache (`loader.COMPILES`)
    graphs_deferred: int = 0  # of the warm set, the graphs left to capture after ready

    def fields(self) -> dict[str, object]:
        """For the `warmed` log event."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "kernels_s": round(self.kernels_s, 3),
            "graphs": self.graphs,
            "graphs_deferred": self.graphs_deferred,
            "graph_batches": list(self.batches),
            "graph_widths": list(self.widths),
            "graphs_s": round(self.graphs_s, 3),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s),
            "kernel_compiles": self.compiles,
            **{k: round(v, 3) if k.endswith("_s") else int(v) for k, v in self.parts.items()},
        }


def warm_up(engine: Engine, kernels: bool | None = None, graphs_now: bool = True) -> Warmup:
    """Compile and capture before serving (the module docstring). `kernels`: run the scratch
    sequence (None: on CUDA only; a CPU compiles nothing); `graphs_now`: capture the warm set now,
    else leave it to be captured after ready (`DecodeGraphs.warm`)."""
    runner = engine.runner
    t0 = time.perf_counter()
    prompt = 0
    parts: dict[str, float] = {}
    if kernels if kernels is not None else runner.device.type == "cuda":
        prompt = _scratch(engine, parts)
    if runner.device.type == "cuda":
        _check_segments(engine, parts)
    t1 = time.perf_counter()
    keys = runner.graphs.warm_set(engine.max_context)
    made = runner.graphs.warm(keys, now=graphs_now)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    widths = sorted(k.width for k in keys)
    _chat_template(engine)
    return Warmup(
        prompt_tokens=prompt,
        kernels_s=t1 - t0,
        prefill_tokens_per_s=engine.prefill_tokens_per_s or 0.0,
        graphs=made,
        graphs_deferred=len(keys) - made,
        batches=tuple(sorted({k.batch for k in keys})),
        widths=(widths[0], widths[-1]) if widths else (0, 0),
        graphs_s=time.perf_counter() - t1,
        parts=parts,
        compiles=loader.COMPILES.count,
    )


def _check_segments(engine: Engine, parts: dict[str, float]) -> None:
    """A chunk over cached keys is attended segment by segment (`attention.segmented_attention`)
    only if, on this device, that equals the copying path; `chunk_segments` in the `warmed` event
    says which (1: segments)."""
    model = engine.model.config
    dtype = next(engine.model.parameters()).dtype
    agree = attention.segments_agree(engine.runner.device, dtype, model.num_heads, model.num_kv_heads, model.head_dim)
    attention.chunk_segments = agree
    parts["chunk_segments"] = float(agree)


def _chat_template(engine: Engine) -> None:
    """The chat template compiled and its end of turn found (`Engine.end_of_turn`); a template
    that does not render is left to fail the chat requests that need it, with their status."""
    if engine.tokenizer.chat_template is None:
        return
    with contextlib.suppress(InvalidRequest):
        engine.end_of_turn  # noqa: B018  (the cached property is the point)


@torch.inference_mode()
def _scratch(engine: Engine, parts: dict[str, float]) -> int:
    """A scratch sequence's prefill and a few decode steps (released after). Returns its prompt's
    length; `parts` gets the seconds of each part (`scratch_s`, `prefill_s`, `batches_s`)."""
    began = time.perf_counter()
    compiled = loader.COMPILES.count
    runner, kv = engine.runner, engine.kv
    bs = kv.block_size
    rows = runner.model.slice_rows(runner.model.lm_head.weight_t.element_size())
    n = min(rows + 2 * bs + 3, engine.max_context - DECODE_STEPS - 1, int(engine.budgets.prefill_chunk_tokens))
    vocab = engine.model.config.vocab_size
    ids = tuple(1 + i % (vocab - 1) for i in range(n))
    seq = SeqId(next(engine._seq_ids))
    kv.open(seq, None, policy_named(engine.config.policy))
    try:
        runner.step([Chunk(seq, ids, 0, want_logits=True)])
        for i in range(DECODE_STEPS):
            runner.step([Chunk(seq, (ids[i],), n + i, want_logits=True)])
    finally:
        kv.release(seq, purge_archive=True)
    parts["scratch_s"] = time.perf_counter() - began
    parts["scratch_compiles"], compiled = loader.COMPILES.count - compiled, loader.COMPILES.count
    # The same prompt again, compiled by now: the engine's prefill rate, for what is cheaper than
    # computing KV again (a take-over's KV from the remote store, `Engine._choose_kv`).
    seq = SeqId(next(engine._seq_ids))
    kv.open(seq, None, policy_named(engine.config.policy))
    cuda = runner.device.type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step([Chunk(seq, ids, 0, want_logits=True)])
        if cuda:
            torch.cuda.synchronize()
        engine.prefill_tokens_per_s = n / max(time.perf_counter() - t0, 1e-6)
    finally:
        kv.release(seq, purge_archive=True)
    t1 = time.perf_counter()
    parts["prefill_s"] = t1 - began - parts["scratch_s"]
    _batches(engine, ids)
    t2 = time.perf_counter()
    parts["batches_s"] = t2 - t1
    parts["batches_compiles"], compiled = loader.COMPILES.count - compiled, loader.COMPILES.count
    if loader.runs_on(runner.device):
        model = engine.model.config
        dtype = next(engine.model.parameters()).dtype  # a step's queries'
        q = torch.zeros(1, model.num_heads, model.head_dim, dtype=dtype, device=runner.device)
        pools = runner.pools
        windows = any(w is not None for w in runner.windows)
        decode.warm_decode(q, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), engine.max_context // bs + 1, windows)
        parts["decode_s"] = time.perf_counter() - t2
        parts["decode_compiles"] = loader.COMPILES.count - compiled
    return n


def _batches(engine: Engine, ids: tuple[int, ...]) -> None:
    """Decode steps of several scratch sequences at once (released after): Triton compiles a
    kernel again for an integer argument that is 1, a multiple of 16 or neither (the rows of a
    norm or a cache write follow the batch), so batches of `BATCHES` run `DECODE_STEPS` steps
    through a graph (captured here, kept as any other), at widths on both sides of a multiple of
    16, under the configured policy and `exact`, with contexts past the window (the selecting
    path). Without this the first requests decoding together stall for the compiles (seconds).
    The same steps run eagerly compiled nothing more once the attention and selection kernels
    stopped specializing on widths and batches (`decode.LOOSE`, `select.LOOSE`): they were taken
    out, with the seconds of host-planned selection they cost."""
    runner, kv = engine.runner, engine.kv
    bs = kv.block_size
    blocks = 16 * -(-(engine.config.window_tokens + engine.config.recent_tokens + 2 * bs) // (16 * bs))
    n = min(blocks * bs - 1, engine.max_context - DECODE_STEPS - 1, int(engine.budgets.prefill_chunk_tokens))
    prompt = tuple(ids[i % len(ids)] for i in range(n))
    for name in dict.fromkeys((engine.config.policy, "exact")):
        for batch in BATCHES:
            seqs = [SeqId(next(engine._seq_ids)) for _ in range(batch)]
            try:
                for seq in seqs:
                    kv.open(seq, None, policy_named(name))
                # Two prompts in one step (a batch's prefill), the others their twins (`fork_whole`:
                # shared blocks, nothing computed): the same decode steps as 16 prompts, at 1/8 of
                # their prefill.
                runner.step([Chunk(seq, prompt, 0, want_logits=True) for seq in seqs[:PREFILLED]])
                for seq in seqs[PREFILLED:]:
                    if kv.fork_whole(seqs[0], seq) != n:
                        runner.step([Chunk(seq, prompt, 0, want_logits=True)])
                for i in range(DECODE_STEPS):  # through a graph where one applies (captured here)
                    runner.step([Chunk(seq, (prompt[i],), n + i, want_logits=True) for seq in seqs])
            finally:
                for seq in seqs:
                    if kv.has(seq):
                        kv.release(seq, purge_archive=True)
