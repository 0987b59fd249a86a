"""`auto` tier sizing on the card: the budgets `h3d serve` would choose for a Llama-3-8B shape (random
bf16 weights), the runner built with them, a prompt of `--context` tokens in one chunk and 16
decode steps under `attention_entropy` (graphs), and the peak GPU memory against the card's.

    python3 -m h3d.bench.sizing [--context 131072]

Needs a CUDA device, torch and zstandard (the engine's build imports the archive's codecs); it
prints its figures, which docs/BENCHMARKS.md quotes ("`auto` sizing on the H200").
"""

from __future__ import annotations

import argparse
import time

import torch

from h3d.bench.gpu_base import Sizes, build_h3d
from h3d.config import EngineConfig
from h3d.engine.build import budgets, build_runner, host_memory
from h3d.engine.step import Chunk
from h3d.kv.blocks import SeqId

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072, help="prompt tokens, prefilled in one chunk")
    args = p.parse_args()
    dev = torch.device("cuda")
    raw = {**Sizes.pick(False).model, "max_position_embeddings": max(args.context + 64, 131072)}
    model = build_h3d(raw, torch.bfloat16, dev, 0)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(dev)
    host = host_memory()
    print(f"card {total / GIB:.2f} GiB, free after the weights {free / GIB:.2f} GiB; host {host[0] / GIB:.1f} GiB")
    cfg = EngineConfig.build(model="random-llama-3-8b", device="cuda")  # every `auto` key at its default
    sized = budgets(cfg, model, raw["max_position_embeddings"])
    print(f"auto: {sized}")
    t0 = time.perf_counter()
    runner = build_runner(cfg, model, sized)
    blocks = runner.blocks
    print(f"pools built in {time.perf_counter() - t0:.1f} s: {blocks.hbm_capacity} HBM slots, "
          f"{blocks.ddr_alloc.capacity} DDR slots (pinned)")  # fmt: skip
    torch.cuda.reset_peak_memory_stats(dev)
    seq = SeqId(1)
    runner.kv.open(seq)
    ids = torch.randint(0, 1000, (args.context,)).tolist()
    t0 = time.perf_counter()
    logits = runner.step([Chunk(seq, tuple(ids), 0, True, True)])
    torch.cuda.synchronize()
    print(f"{args.context}-token prompt in one chunk: {time.perf_counter() - t0:.2f} s (first call: compiles)")
    tok, pos = int(logits[0].argmax()), args.context
    t0 = time.perf_counter()
    for _ in range(16):
        logits = runner.step([Chunk(seq, (tok,), pos, True)])
        tok, pos = int(logits[0].argmax()), pos + 1
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / 16
    g = runner.graphs
    print(f"16 decode steps: {ms:.1f} ms each (the first captures); graph steps {g.replays}, captures {g.captures}")
    print(f"peak allocated {torch.cuda.max_memory_allocated(dev) / GIB:.2f} GiB of {total / GIB:.2f}; "
          f"free now {torch.cuda.mem_get_info(dev)[0] / GIB:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
