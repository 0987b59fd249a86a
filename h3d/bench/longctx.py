"""Sparse decoding against exact at long contexts: the tasks of `h3d.bench.longtasks` under each
HBF policy and budget.

    python -m h3d.bench.longctx --model DIR [--contexts 8192 16384 32768] [--tasks ...]
        [--depths 0.1 0.3 0.5 0.7 0.9] [--seeds 2] [--max-tokens 64] [--configs LABEL ...]
        [--hbm-mb MB] [--ddr-mb MB] [--archive DIR --codec CODEC] [--smoke] [--out FILE]
    python -m h3d.bench.longctx --combine A.json B.json ... --out ALL.json [--plot FILE.png]

Each prompt (the model's chat template around real text with the task's facts and its question; it
and its answer fit the nominal context) is prefilled once, under `attention_entropy` (prefill is
exact under every policy; the prompt's anchors are recorded then), and each configuration
generates greedily from it, the session rewound in between: `exact`; `attention_entropy` at 1,024,
2,048 and 4,096 tokens held fixed (its window bounds set to the budget) and at 2,048 with its
resizing on (the configured bounds); `fixed` and `layerwise` at 2,048. An answer is correct when
it holds every expected string (`longtasks.correct`).

`--out` writes `{"rows": [{task, context, policy, budget, resize, correct, total}], "prompts":
[...]}` after every prompt (a run stopped midway keeps what it did), one prompt entry per
configuration: the answer, the window's size after each decode step (`window_sizes`, and their
mean), the entropies of the last resize period, the HBM hit rate and archive reads. A miss of
`attention_entropy` or `layerwise` carries `miss`: the answer is generated again, eagerly, up to
the step where it left exact's answer, and at that step each selecting layer's rank of the
answer's blocks under the digest bound and whether it picked them (`rank_answer`).

`--archive DIR` with a small `--hbm-mb` and `--ddr-mb` puts the archive in play: most blocks are
written under `--codec` and read back from it every step. Runs split by context, task or archive
are joined by `--combine`: `rows` from the runs without an archive, `archive_rows` (each with
its codec) from the others, and `--plot` draws accuracy against the window. `--smoke`: one prompt
per task at the first context (the CPU host's run). A 16K prefill of a 0.5B model takes minutes
on 2 cores: the full suite is for the GPU host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h3d.bench.longtasks import TASKS, Task, correct, make
from h3d.bench.text import corpus
from h3d.config import SSD_CODECS, EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.hbf.digests import block_scores
from h3d.hbf.policy import POLICIES, HbfConfig, Selection, SelectionState, Window


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
RANKED = ("attention_entropy", "layerwise")  # policies whose misses are traced to the digest bound


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


def answer_facts(task: Task) -> range:
    """The indexes (in `task.facts`) of the facts the answer is read from."""
    return range(1) if task.name in ("single_needle", "multi_key") else range(4)


@contextlib.contextmanager
def watching(config: Config, state: SelectionState) -> Iterator[list[int]]:
    """The window's size after each decode step of `state`'s session (the policy's `after_step`
    wrapped while it runs)."""
    policy = POLICIES[config.policy]
    sizes: list[int] = []
    after = policy.after_step

    def step(s: SelectionState, cfg: HbfConfig) -> None:
        after(s, cfg)
        if s is state:
            sizes.append(s.window_tokens)

    policy.after_step = step  # type: ignore[method-assign,assignment]
    try:
        yield sizes
    finally:
        del policy.after_step


def rank_answer(
    engine: Engine, sid: SessionId, task: Task, offset: int, config: Config, answer: tuple[int, ...], step: int
) -> dict[str, Any]:
    """Where the answer's blocks stood at decode step `step` of a missed `answer` (the step where
    it left exact's), layer by layer: their rank under the digest bound (0: the block scoring
    highest; the best of a fact's blocks) and whether the layer picked them, against the room the
    window left. The answer is generated again up to that step, eagerly (no CUDA graph, so that the
    policy's pick runs on the host where it can be watched); greedy, it must replay `answer`."""
    seq = engine.session(sid).seq
    state = engine.kv.selection(seq)
    bs = engine.kv.block_size
    tok = engine.tokenizer
    facts = []
    for i in answer_facts(task):
        first = offset + task.inserted_at[i]
        n = len(tok.encode(task.facts[i], add_special_tokens=False))
        facts.append(list(range(first // bs, (first + n - 1) // bs + 1)))
    seen: dict[int, dict[str, Any]] = {}
    policy = POLICIES[config.policy]
    pick = policy._pick
    steps = [-1]  # decode steps of the session seen (a step's first selecting layer starts one)

    def watched(s: SelectionState, cfg: HbfConfig, w: Window) -> Selection:
        sel = pick(s, cfg, w)
        if s is not state:
            return sel
        if w.layer == cfg.dense_layers:
            steps[0] += 1
        if steps[0] == step:
            scores = block_scores(w.q, w.digests).cpu()
            if sel is None:
                chosen = set(range(w.num_blocks))
            else:
                chosen = set(np.unique(sel.cpu().numpy() if isinstance(sel, torch.Tensor) else sel).tolist())
            seen[w.layer] = {
                "ranks": [min(int((scores > scores[b]).sum()) for b in f if b < w.num_blocks) for f in facts],
                "picked": [any(b in chosen for b in f) for f in facts],
                "room": int(w.room),
            }
        return sel

    graphs = engine.runner.graphs
    enabled = graphs.enabled
    policy._pick = watched  # type: ignore[method-assign,assignment]
    graphs.enabled = False
    try:
        done = engine.complete(sid, "", SamplingParams(max_tokens=step + 1, temperature=0.0))
    finally:
        del policy._pick
        graphs.enabled = enabled
    layers = sorted(seen)
    return {
        "step": step,
        "replayed": done.token_ids == answer[: step + 1],
        "fact_blocks": facts,
        "layers": layers,
        "ranks": [seen[layer]["ranks"] for layer in layers],
        "picked": [seen[layer]["picked"] for layer in layers],
        "room": [seen[layer]["room"] for layer in layers],
    }


def departure(answer: tuple[int, ...], exact: tuple[int, ...] | None) -> int:
    """The first decode step whose token differs from exact's answer (0 where there is none to
    compare with, or where the two are the same)."""
    if exact is None:
        return 0
    n = next((i for i, (a, b) in enumerate(zip(answer, exact, strict=False)) if a != b), None)
    if n is None:
        n = min(len(answer), len(exact))
    return n if n < len(answer) else 0


def engine_for(args: argparse.Namespace) -> Engine:
    keys: dict[str, Any] = {
        "model": args.model, "policy": "attention_entropy", "max_context_tokens": max(args.contexts),
    }  # fmt: skip
    if args.hbm_mb is not None:
        keys["hbm_mb"] = args.hbm_mb
    if args.ddr_mb is not None:
        keys["ddr_mb"] = args.ddr_mb
    if args.archive is not None:
        keys.update(ssd_path=str(args.archive), ssd_codec=args.codec)
    return Engine(EngineConfig.build(**keys))


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_for(args)
    base = engine.kv.hbf
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=False)
    text = corpus()
    hay = (text, engine.tokenizer.encode(text, add_special_tokens=False))
    configs = [c for c in CONFIGS if args.configs is None or c.label in args.configs]
    tally: dict[tuple[str, int, Config], list[int]] = {}
    result: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens, "rows": [], "prompts": []}
    if args.archive is not None:
        result["archive"] = {"codec": args.codec, "hbm_mb": args.hbm_mb, "ddr_mb": args.ddr_mb}
    depths = [0.5] if args.smoke else args.depths
    seeds = [0] if args.smoke else list(range(args.seeds))
    contexts = args.contexts[:1] if args.smoke else args.contexts
    for context in contexts:
        for name in args.tasks:
            for depth in depths:
                for seed in seeds:
                    task, ids = build(engine, name, context, depth, seed, hay, args.max_tokens)
                    offset = len(ids) - len(task.ids) - len(frame(engine, task.question)[1])
                    sid = engine.create_session(policy="attention_entropy")
                    t0 = time.perf_counter()
                    engine.append(sid, token_ids=ids)
                    prefill_s = time.perf_counter() - t0
                    seq = engine.session(sid).seq
                    marks = []
                    exact_ids: tuple[int, ...] | None = None
                    for config in configs:
                        engine.set_policy(sid, config.policy)
                        cfg = windowed(base, config)
                        engine.kv.hbf = engine.runner.hbf = cfg
                        state = engine.kv.selection(seq)

                        def reset(state: SelectionState = state, cfg: HbfConfig = cfg, c: Config = config) -> None:
                            state.window_tokens = c.budget or cfg.window_tokens
                            state.steps, state.entropies[:] = 0, []

                        reset()
                        before = engine.tier_stats()
                        t1 = time.perf_counter()
                        with watching(config, state) as sizes:
                            done = engine.complete(sid, "", params)
                        decode_s = time.perf_counter() - t1
                        after = engine.tier_stats()
                        ok = correct(task, done.text)
                        t = tally.setdefault((name, context, config), [0, 0])
                        t[0] += ok
                        t[1] += 1
                        needed = (after.hbm_hits + after.hbm_misses) - (before.hbm_hits + before.hbm_misses)
                        entry: dict[str, Any] = {
                            "task": name, "context": context, "depth": depth, "seed": seed, "config": config.label,
                            "correct": ok, "answers": list(task.answers), "answer": done.text,
                            "answer_tokens": len(done.token_ids), "window_sizes": sizes,
                            "mean_window": round(sum(sizes) / len(sizes), 1) if sizes else None,
                            "entropies": [float(x) for x in state.entropies],
                            "hbm_hit_rate": (after.hbm_hits - before.hbm_hits) / needed if needed else 1.0,
                            "ssd_reads": after.ssd_read_count - before.ssd_read_count,
                            "prompt_tokens": len(ids), "prefill_s": round(prefill_s, 2), "decode_s": round(decode_s, 2),
                        }  # fmt: skip
                        engine.rewind(sid, len(ids))
                        if config.policy == "exact":
                            exact_ids = done.token_ids
                        if not ok and config.policy in RANKED:
                            reset()
                            step = departure(done.token_ids, exact_ids)
                            entry["miss"] = rank_answer(engine, sid, task, offset, config, done.token_ids, step)
                            engine.rewind(sid, len(ids))
                        result["prompts"].append(entry)
                        marks.append(f"{config.label} {'ok' if ok else 'MISS'}")
                    engine.kv.hbf = engine.runner.hbf = base
                    engine.close_session(sid, purge=True)
                    print(f"{name} {context} depth {depth} seed {seed} (prefill {prefill_s:.1f} s): "
                          + ", ".join(marks), flush=True)  # fmt: skip
                    result["rows"] = rows_of(tally)
                    if args.out is not None:
                        save(result, args.out)
    return result


def rows_of(tally: dict[tuple[str, int, Config], list[int]]) -> list[dict[str, Any]]:
    return [
        {"task": name, "context": context, "policy": c.policy, "budget": c.budget, "resize": c.resize,
         "correct": v[0], "total": v[1]}
        for (name, context, c), v in tally.items()
    ]  # fmt: skip


def save(result: dict[str, Any], path: Path) -> None:
    """Write `result` as JSON, whole or not at all (a run stopped midway leaves the last prompt's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def table(rows: list[dict[str, Any]], by_codec: bool = False) -> str:
    labels = [c.label for c in CONFIGS if any(same(r, c) for r in rows)]
    extra = "codec | " if by_codec else ""
    lines = [f"| task | context | {extra}" + " | ".join(labels) + " |", "|---|---|" + "---|" * (len(labels) + by_codec)]
    keys = sorted(
        {(r["task"], r["context"], r.get("codec", "")) for r in rows}, key=lambda k: (TASKS.index(k[0]), k[1], k[2])
    )
    for task, context, codec in keys:
        cells = []
        for c in CONFIGS:
            if c.label not in labels:
                continue
            r = next((r for r in rows if (r["task"], r["context"], r.get("codec", "")) == (task, context, codec)
                      and same(r, c)), None)  # fmt: skip
            cells.append(f"{r['correct']}/{r['total']}" if r else "")
        lines.append(f"| {task} | {context} | " + (f"{codec} | " if by_codec else "") + " | ".join(cells) + " |")
    return "\n".join(lines)


def same(row: dict[str, Any], c: Config) -> bool:
    return (row["policy"], row["budget"], row["resize"]) == (c.policy, c.budget, c.resize)


def combine(paths: list[Path]) -> dict[str, Any]:
    """One result from the JSON of several runs (split by context, task or depth, or on the
    archive): `prompts` and `rows` from the runs without an archive, `archive_prompts` and
    `archive_rows` (each with its `codec`) from the others. An earlier combined result is a run
    like the others (its `archive_prompts` keep their codecs), so a run that completes it can be
    added later. Rows are counted again from the prompts; a prompt and configuration run twice
    (same task, context, depth, seed, codec) counts once, as first given."""
    out: dict[str, Any] = {"prompts": [], "archive_prompts": []}
    seen: set[tuple[Any, ...]] = set()
    for path in paths:
        part = json.loads(path.read_text())
        out.setdefault("model", part["model"])
        out.setdefault("max_tokens", part["max_tokens"])
        codec = part["archive"].get("codec") if "archive" in part else None
        if "archive" in part:
            out["archive"] = {k: v for k, v in part["archive"].items() if k != "codec"}
        given = [(p, codec) for p in part["prompts"]] + [(p, p["codec"]) for p in part.get("archive_prompts", [])]
        for p, c in given:
            key = (p["task"], p["context"], p["depth"], p["seed"], p["config"], c)
            if key not in seen:
                seen.add(key)
                out["archive_prompts" if c else "prompts"].append({**p, "codec": c} if c else p)
    by_label = {c.label: c for c in CONFIGS}
    for rows, prompts in (("rows", "prompts"), ("archive_rows", "archive_prompts")):
        tally: dict[tuple[Any, ...], list[int]] = {}
        for p in out[prompts]:
            t = tally.setdefault((p["task"], p["context"], p["config"], p.get("codec")), [0, 0])
            t[0] += p["correct"]
            t[1] += 1
        out[rows] = [
            {"task": task, "context": context, "policy": by_label[label].policy, "budget": by_label[label].budget,
             "resize": by_label[label].resize, "correct": v[0], "total": v[1], **({"codec": codec} if codec else {})}
            for (task, context, label, codec), v in tally.items()
        ]  # fmt: skip
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against the window per task (columns) and context (rows): attention_entropy held
    at each budget, exact as a dashed line, the other configurations as single points (needs
    matplotlib: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(len(contexts), len(tasks), figsize=(3.6 * len(tasks), 3 * len(contexts)), squeeze=False)
    for i, context in enumerate(contexts):
        for j, task in enumerate(tasks):
            ax = axes[i][j]
            mine = [r for r in rows if (r["task"], r["context"]) == (task, context)]

            def acc(r: dict[str, Any]) -> float:
                return r["correct"] / r["total"]

            for r in mine:
                if r["policy"] == "exact":
                    ax.axhline(acc(r), color="black", linestyle="--", label="exact")
            held = [r for r in mine if r["policy"] == "attention_entropy" and not r["resize"]]
            fixed = sorted((r["budget"], acc(r)) for r in held)
            ax.plot([b for b, _ in fixed], [a for _, a in fixed], marker="o", label="attention_entropy")
            for r in mine:
                if r["policy"] == "attention_entropy" and r["resize"]:
                    ax.plot([r["budget"]], [acc(r)], marker="^", linestyle="", label="attention_entropy, resizing")
                elif r["policy"] in ("fixed", "layerwise"):
                    ax.plot([r["budget"]], [acc(r)], marker="s" if r["policy"] == "fixed" else "D", linestyle="",
                            label=r["policy"])  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(f"{task}, {context // 1024}K", fontsize=9)
            if i == len(contexts) - 1:
                ax.set_xlabel("window (tokens)")
            if j == 0:
                ax.set_ylabel("answers correct")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m h3d.bench.longctx",
        description=__doc__.split("\n\n")[0],
        epilog="python -m h3d.bench.longctx --combine A.json B.json ... --out ALL.json [--plot FILE.png]: "
        "one result (and its tables) from runs split by context, task or archive",
    )
    p.add_argument("--model", help="the model folder (make longctx-model)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--seeds", type=int, default=2, help="prompts per task, length and depth")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (multi_value needs about 60)")
    p.add_argument("--configs", nargs="+", choices=[c.label for c in CONFIGS], help="run only these configurations")
    p.add_argument("--hbm-mb", type=float, help="the engine's hbm_mb (default: its own, auto)")
    p.add_argument("--ddr-mb", type=float, help="the engine's ddr_mb (default: its own, auto)")
    p.add_argument(
        "--archive",
        type=Path,
        help="an archive folder (ssd_path): with a small --hbm-mb and --ddr-mb, blocks come back from it",
    )
    p.add_argument("--codec", choices=SSD_CODECS, default="raw-zstd", help="the archive's ssd_codec")
    p.add_argument("--smoke", action="store_true", help="one prompt per task at the first context")
    p.add_argument("--out", type=Path, help="write the rows and per-prompt results as JSON (after every prompt)")
    p.add_argument("--combine", type=Path, nargs="+", help="the JSON of earlier runs to combine into --out")
    p.add_argument("--plot", type=Path, help="with --combine: a PNG of accuracy against the window")
    args = p.parse_args(argv)
    if args.combine:
        result = combine(args.combine)
    elif args.model is None:
        p.error("--model is required (or --combine)")
    else:
        result = run(args)
    print(table(result["rows"]))
    if result.get("archive_rows"):
        print()
        print(table(result["archive_rows"], by_codec=True))
    if args.combine and args.plot is not None:
        plot(result["rows"], args.plot)
    if args.out is not None:
        save(result, args.out)


if __name__ == "__main__":
    main()
