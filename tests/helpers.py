"""Helpers shared by the test modules (plain functions; the fixtures live in conftest.py).

The tiny checkpoints are built by conftest.py; this module knows their names and shapes and holds
the comparisons the tests share: teacher-forced logits through the runner, transformers'
reference logits (whole prompt or chunk by chunk through its own KV cache) and the top-2 margins
that tell where a greedy comparison between two implementations stops being meaningful.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.step import Chunk
from h3d.kv.blocks import SeqId

# Special tokens of the test tokenizer (trained in conftest.py); their ids are fixed by the order
# they are given to the trainer.
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
NUM_SPECIAL = 3
VOCAB_SIZE = 512  # the test tokenizer's vocabulary, and every test model's

# Greedy comparisons between two implementations stop where the reference's best two logits are
# closer than this: below it, fp32 rounding differences (~1e-5) could legitimately flip argmax.
MARGIN = 1e-3


@dataclass(frozen=True)
class Spec:
    """One tiny checkpoint: architecture, attention shape, embeddings, RoPE scaling."""

    arch: str  # "llama" | "qwen2" | "qwen3" | "mistral" | "gemma3"
    heads: int
    kv_heads: int
    layers: int
    tied: bool
    rope: dict[str, Any] = field(default_factory=dict)
    max_pos: int = 1024
    # "v5": transformers 5's `rope_parameters`; "v4": legacy `rope_theta` + `rope_scaling`.
    rope_format: str = "v5"
    seed: int = 0
    # Sliding-window attention: Mistral's on every layer; Qwen2's from layer `window_from` on.
    window: int | None = None
    window_from: int = 0
    softcap: float | None = None  # Gemma's final_logit_softcapping


SPECS: dict[str, Spec] = {
    # GQA ratio 1 (MHA), separate LM head.
    "llama_mha_untied": Spec("llama", heads=4, kv_heads=4, layers=2, tied=False, seed=1),
    # GQA ratio 4 with 8 heads of 16 (q size 128 != hidden 64: explicit head_dim), tied head.
    "llama_gqa4_tied": Spec("llama", heads=8, kv_heads=2, layers=3, tied=True, seed=2),
    # The same shape with room for long contexts (restarts of sessions of thousands of tokens).
    "llama_long": Spec("llama", heads=8, kv_heads=2, layers=3, tied=True, seed=2, max_pos=8192),
    # Llama 3 scaling with a short original context, so low and medium frequencies are rescaled.
    "llama3_rope": Spec(
        "llama",
        heads=4,
        kv_heads=1,
        layers=2,
        tied=False,
        rope={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        seed=3,
    ),
    # Linear scaling written the transformers-4 way (rope_theta + rope_scaling {"type": ...}).
    "linear_rope": Spec(
        "llama",
        heads=4,
        kv_heads=2,
        layers=2,
        tied=True,
        rope={"rope_type": "linear", "factor": 4.0},
        rope_format="v4",
        seed=4,
    ),
    # Dynamic NTK: max_position_embeddings is small so a 300-token prompt goes past it.
    "dynamic_rope": Spec(
        "llama",
        heads=4,
        kv_heads=1,
        layers=2,
        tied=False,
        rope={"rope_type": "dynamic", "factor": 2.0},
        max_pos=128,
        rope_format="v4",
        seed=5,
    ),
    "qwen2_gqa4_untied": Spec("qwen2", heads=4, kv_heads=1, layers=2, tied=False, seed=6),
    "qwen2_mha_tied": Spec("qwen2", heads=4, kv_heads=4, layers=3, tied=True, seed=7),
    "mistral_gqa2": Spec("mistral", heads=4, kv_heads=2, layers=2, tied=False, seed=8),
    # QK-norm, no q/k/v bias, 8 heads of 16 over a hidden size of 64 (as Qwen3's explicit head_dim).
    "qwen3_gqa4_tied": Spec("qwen3", heads=8, kv_heads=2, layers=2, tied=True, seed=9),
    # YaRN as Qwen2.5 and Qwen3 configure it for long contexts, with a short original context so that
    # the ramp crosses the dimensions of a 16-wide head and the cos/sin scale is not 1.
    "qwen3_yarn": Spec(
        "qwen3",
        heads=4,
        kv_heads=2,
        layers=2,
        tied=False,
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        seed=10,
    ),
    "qwen2_yarn_mscale": Spec(
        "qwen2",
        heads=4,
        kv_heads=1,
        layers=2,
        tied=True,
        rope={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
        seed=11,
    ),
    # Sliding windows shorter than the prompt and not a multiple of the blocks: Mistral's on every
    # layer, Qwen2's on its last two of three (`use_sliding_window`, `max_window_layers` = 1).
    "mistral_window": Spec("mistral", heads=4, kv_heads=2, layers=2, tied=False, seed=12, window=40),
    "qwen2_window_layers": Spec("qwen2", heads=4, kv_heads=2, layers=3, tied=True, seed=13, window=24, window_from=1),
    # Gemma 3: QK-norm, 1 + w norms, sandwich norms, GeGLU, scaled embeddings, its own attention
    # scale, a 24-token window on two layers of three with a local RoPE base, soft-capped logits.
    "gemma3_window": Spec("gemma3", heads=4, kv_heads=2, layers=3, tied=True, seed=14, window=24, softcap=30.0),
}

# The configs whose logits are position-independent in the sense that feeding the prompt in chunks
# must give the same logits as one forward (everything but dynamic NTK).
STATIC_ROPE = [name for name, spec in SPECS.items() if spec.rope.get("rope_type") != "dynamic"]


# The CPU tests' engines on a GPU host (`H3D_TEST_DEVICE=cuda`, in fp32 there: the oracles' 1e-4
# holds), for the GPU paths of what the tests build (model families, windows).
TEST_DEVICE = os.environ.get("H3D_TEST_DEVICE")


def make_engine(model_dir: Path | str, **overrides: Any) -> Engine:
    # ddr_mb: the default 4 GiB is a million 4 KiB slots of a tiny model, which every
    # check_invariants pass (after each step) walks; 16 MiB is plenty for these tests.
    kw: dict[str, Any] = {
        "block_size": 16,
        "prefill_chunk_tokens": 512,
        "hbm_mb": 8.0,
        "ddr_mb": 16.0,
        "check_invariants": True,
    }
    if TEST_DEVICE:
        kw.update(device=TEST_DEVICE, dtype="fp32")
    kw.update(overrides)
    return Engine(EngineConfig.build(model=str(model_dir), **kw))


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n random non-special token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(NUM_SPECIAL, vocab, (n,), generator=g).tolist()


def split_sizes(total: int, sizes: Sequence[int]) -> list[int]:
    """`sizes` cut or extended so that they sum to `total` (the last one takes the rest)."""
    out: list[int] = []
    left = total
    for s in sizes:
        if left <= 0:
            break
        out.append(min(s, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return out


def runner_logits(
    engine: Engine, seq: int, ids: Sequence[int], chunk_sizes: Sequence[int], start: int = 0
) -> torch.Tensor:
    """Feed `ids` to sequence `seq` (opened if new) chunk by chunk; logits of every fed token [N, V]."""
    runner = engine.runner
    if not runner.blocks.has(SeqId(seq)):
        runner.kv.open(SeqId(seq))
    outs = []
    pos = start
    for n in split_sizes(len(ids), chunk_sizes):
        part = tuple(ids[pos - start : pos - start + n])
        outs.append(runner.step([Chunk(SeqId(seq), part, pos, True)], all_logits=True).cpu())
        pos += n
    return torch.cat(outs)


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: Sequence[int], chunk_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """transformers' logits for every token of `ids` [N, V]: one forward, or chunk by chunk through its cache."""
    x = torch.tensor([list(ids)])
    # Dynamic NTK RoPE in transformers is stateful: its frequencies are recomputed only when a
    # forward grows past the longest length seen so far, or reset by a forward shorter than
    # max_position_embeddings. A one-token forward resets them, so every reference starts fresh.
    model(input_ids=x[:, :1])
    if chunk_sizes is None:
        return model(input_ids=x).logits[0].float()
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    outs = []
    pos = 0
    for n in split_sizes(len(ids), chunk_sizes):
        out = model(
            input_ids=x[:, pos : pos + n],
            cache=cache,
            use_cache=True,
            position_ids=torch.arange(pos, pos + n)[None],
        )
        outs.append(out.logits[0].float())
        pos += n
    return torch.cat(outs)


def top2_margins(logits: torch.Tensor) -> list[float]:
    """logits [N, V] -> best minus second-best logit of each row."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def clear_prefix(margins: Sequence[float], threshold: float = MARGIN) -> int:
    """Number of leading steps whose argmax is decided by more than `threshold`."""
    for i, m in enumerate(margins):
        if m < threshold:
            return i
    return len(margins)


def assert_greedy_match(
    got: Sequence[int], want: Sequence[int], margins: Sequence[float], min_compared: int = 16
) -> int:
    """`got` equals `want` token for token up to the first step where `want`'s choice was close.

    `margins[i]` is the reference's top-2 margin at the step that chose `want[i]`. Returns the
    number of tokens compared; fails if that is under `min_compared` (the test then proves little).
    """
    n = min(clear_prefix(margins), len(want))
    assert n >= min_compared, f"only {n} greedy steps had a clear argmax; make the test model's logits less flat"
    assert len(got) >= n, f"got {len(got)} tokens, expected at least {n}"
    for i in range(n):
        assert got[i] == want[i], f"greedy token {i} differs: got {got[i]}, want {want[i]} (margin {margins[i]:.3g})"
    return n


def write_generation_config(model_dir: Path, **values: Any) -> None:
    """Write `generation_config.json` into `model_dir` (e.g. eos_token_id=[...])."""
    (model_dir / "generation_config.json").write_text(json.dumps(values, indent=2))


_scratch_seq = iter(range(1_000_000, 2_000_000))


def teacher_margins(engine: Engine, context: Sequence[int], generated: Sequence[int]) -> list[float]:
    """Top-2 margins of the steps that chose `generated` after `context`, teacher-forced in one chunk
    on a scratch sequence of `engine`'s runner (released afterwards)."""
    seq = next(_scratch_seq)
    ids = list(context) + list(generated)[:-1]
    logits = runner_logits(engine, seq, ids, [len(ids)])
    engine.kv.release(SeqId(seq))
    return top2_margins(logits[len(context) - 1 :])


def step_until_failure(engine: Engine, max_steps: int = 1000) -> Exception:
    """Step until a request fails; return its error (an expected failure ends the request with a
    `RequestFailed` event; the engine itself goes on)."""
    from h3d.engine.session import RequestFailed

    for _ in range(max_steps):
        if not engine.has_work:
            break
        for event in engine.step():
            if isinstance(event, RequestFailed):
                return event.error
    raise AssertionError("no request failed")


def manifest_places(folder: Path) -> dict[tuple[str, int, int], dict[str, Any]]:
    """(session, layer, block) -> the manifest's latest `put` entry for it (deleted sessions dropped)."""
    places: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in (folder / "manifest.log").read_bytes().splitlines():
        entry = json.loads(line[9:])
        if entry["op"] == "del":
            places = {k: e for k, e in places.items() if k[0] != entry["s"]}
        elif entry["op"] == "puts":  # a bulk write: the fields as lists
            for j in range(len(entry["l"])):
                one = {name: (x[j] if isinstance(x, list) else x) for name, x in entry.items()}
                places[(entry["s"], one["l"], one["i"])] = one
        else:
            places[(entry["s"], entry["l"], entry["i"])] = entry
    return places


def flip_payload_byte(folder: Path, session: str, layer: int, block: int) -> None:
    """A bit flipped near the end of an archive record's payload (`folder`: the archive's)."""
    entry = manifest_places(folder)[(session, layer, block)]
    seg = folder / f"seg-{entry['seg']:06d}.h3kv"
    data = bytearray(seg.read_bytes())
    data[entry["off"] + entry["len"] - 7] ^= 0x10
    seg.write_bytes(bytes(data))
