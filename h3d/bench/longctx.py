"""Sparse decoding against exact at long contexts: the tasks of `h3d.bench.longtasks` under each
HBF policy and budget.

    python -m h3d.bench.longctx --model DIR [--contexts 8192 16384 32768] [--tasks ...]
        [--depths 0.1 0.3 0.5 0.7 0.9] [--seeds 2] [--max-tokens 64] [--smoke] [--out FILE]

Each prompt (the model's chat template around real text with the task's facts and its question; it
and its answer fit the nominal context) is prefilled once, under `attention_entropy` (prefill is
exact under every policy; the prompt's anchors are recorded then), and each configuration
generates greedily from it, the session rewound in between: `exact`; `attention_entropy` at 1,024,
2,048 and 4,096 tokens held fixed (its window bounds set to the budget) and at 2,048 with its
resizing on (the configured bounds); `fixed` and `layerwise` at 2,048. An answer is correct when
it holds every expected string (`longtasks.correct`). `--out` writes `{"rows": [{task, context,
policy, budget, resize, correct, total}], "prompts": [...]}`, one prompt entry per configuration
with the answer, the window at the end and the entropies of the last resize period. `--smoke`:
one prompt per task at the first context (the CPU host's run). A 16K prefill of a 0.5B model takes
minutes on 2 cores: the full suite is for the GPU host.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from h3d.bench.longtasks import TASKS, Task, correct, make
from h3d.bench.text import corpus
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.hbf.policy import HbfConfig


@dataclass(frozen=True, slots=True)
class Config:
    policy: str
    budget: int | None  # tokens of the window (None: exact)
    resize: bool = False

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@{self.budget}{'+resize' if self.resize else ''}"


CONFIGS = (
    Config("exact", None),
    Config("attention_entropy", 1024),
    Config("attention_entropy", 2048),
    Config("attention_entropy", 4096),
    Config("attention_entropy", 2048, resize=True),
    Config("fixed", 2048),
    Config("layerwise", 2048),
)
MARGIN = 8  # tokens kept free under the nominal context, past the prompt and its answer


def frame(engine: Engine, question: str) -> tuple[list[int], list[int]]:
    """The token ids before the haystack and after it: the chat template's user turn around it
    (plain text where the model has none), the question at its end."""
    tok = engine.tokenizer
    mark = "\x00"
    if tok.chat_template is not None:
        text = tok.apply_chat_template([{"role": "user", "content": mark + "\n\n" + question}])
        head, tail = text.split(mark)
        return tok.encode(head), tok.encode(tail, add_special_tokens=False)
    return tok.encode(""), tok.encode("\n\n" + question + "\nAnswer:", add_special_tokens=False)


def build(
    engine: Engine, name: str, context: int, depth: float, seed: int, hay: tuple[str, list[int]], answer: int
) -> tuple[Task, list[int]]:
    """Task `name` whose prompt and an `answer` of that many tokens fit `context`, and the
    prompt's ids."""
    tok = engine.tokenizer
    text, ids = hay

    def encode(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    probe = make(name, encode, ids, text, context, depth, seed)  # its question (the same at every length)
    head, tail = frame(engine, probe.question)
    body = context - len(head) - len(tail) - answer - MARGIN
    task = make(name, encode, ids, text, body, depth, seed)
    head, tail = frame(engine, task.question)
    return task, head + task.ids + tail


def windowed(hbf: HbfConfig, config: Config) -> HbfConfig:
    """The HBF configuration of a run: the window held at the budget unless it resizes."""
    if config.budget is None or config.resize:
        return hbf
    return replace(hbf, window_min_tokens=config.budget, window_max_tokens=config.budget)


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(
        EngineConfig.build(model=args.model, policy="attention_entropy", max_context_tokens=max(args.contexts))
    )
    base = engine.kv.hbf
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=False)
    text = corpus()
    hay = (text, engine.tokenizer.encode(text, add_special_tokens=False))
    tally: dict[tuple[str, int, Config], list[int]] = {}
    prompts: list[dict[str, Any]] = []
    depths = [0.5] if args.smoke else args.depths
    seeds = [0] if args.smoke else list(range(args.seeds))
    contexts = args.contexts[:1] if args.smoke else args.contexts
    for context in contexts:
        for name in args.tasks:
            for depth in depths:
                for seed in seeds:
                    task, ids = build(engine, name, context, depth, seed, hay, args.max_tokens)
                    sid = engine.create_session(policy="attention_entropy")
                    t0 = time.perf_counter()
                    engine.append(sid, token_ids=ids)
                    prefill_s = time.perf_counter() - t0
                    seq = engine.session(sid).seq
                    for config in CONFIGS:
                        engine.set_policy(sid, config.policy)
                        cfg = windowed(base, config)
                        engine.kv.hbf = engine.runner.hbf = cfg
                        state = engine.kv.selection(seq)
                        state.window_tokens = config.budget or cfg.window_tokens
                        state.steps, state.entropies[:] = 0, []
                        before = engine.tier_stats()
                        done = engine.complete(sid, "", params)
                        after = engine.tier_stats()
                        ok = correct(task, done.text)
                        t = tally.setdefault((name, context, config), [0, 0])
                        t[0] += ok
                        t[1] += 1
                        needed = (after.hbm_hits + after.hbm_misses) - (before.hbm_hits + before.hbm_misses)
                        prompts.append({
                            "task": name, "context": context, "depth": depth, "seed": seed, "config": config.label,
                            "correct": ok, "answers": list(task.answers), "answer": done.text,
                            "window_at_end": state.window_tokens, "entropies": [float(x) for x in state.entropies],
                            "hbm_hit_rate": (after.hbm_hits - before.hbm_hits) / needed if needed else 1.0,
                            "prompt_tokens": len(ids), "prefill_s": round(prefill_s, 2),
                        })  # fmt: skip
                        engine.rewind(sid, len(ids))
                    engine.kv.hbf = engine.runner.hbf = base
                    engine.close_session(sid, purge=True)
                    exact = tally[(name, context, CONFIGS[0])]
                    print(f"{name} {context} depth {depth} seed {seed}: exact {exact[0]}/{exact[1]}", flush=True)
    rows = [
        {"task": name, "context": context, "policy": c.policy, "budget": c.budget, "resize": c.resize,
         "correct": v[0], "total": v[1]}
        for (name, context, c), v in tally.items()
    ]  # fmt: skip
    return {"model": args.model, "max_tokens": args.max_tokens, "rows": rows, "prompts": prompts}


def table(rows: list[dict[str, Any]]) -> str:
    labels = [c.label for c in CONFIGS]
    lines = ["| task | context | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    keys = sorted({(r["task"], r["context"]) for r in rows}, key=lambda k: (TASKS.index(k[0]), k[1]))
    for task, context in keys:
        cells = []
        for c in CONFIGS:
            r = next((r for r in rows if (r["task"], r["context"], r["policy"], r["budget"], r["resize"])
                      == (task, context, c.policy, c.budget, c.resize)), None)  # fmt: skip
            cells.append(f"{r['correct']}/{r['total']}" if r else "")
        lines.append(f"| {task} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.longctx", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model folder (make longctx-model)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, default=2, help="prompts per task, length and depth")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (multi_value needs about 60)")
    p.add_argument("--smoke", action="store_true", help="one prompt per task at the first context")
    p.add_argument("--out", type=Path, help="write the rows and per-prompt results as JSON")
    args = p.parse_args(argv)
    result = run(args)
    print(table(result["rows"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
