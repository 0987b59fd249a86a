"""Retrieval quality per HBF policy and token budget: needles in real text (CPU, embedded model).

    python -m h3d.bench.retrieval --model DIR [--contexts 2048 4096 8192] [--needles 5]
        [--depths 0.1 0.3 0.5 0.7 0.9] [--budgets 256 512 1024 2048] [--write docs/BENCHMARKS.md]

Each prompt is real English text (h3d.bench.text) cut to the context length, with one needle
sentence ("The access code for the <place> archive is <5 digits>.") inserted at a depth, then the
question and the start of the answer. The prompt is prefilled once (prefill is exact under every
policy; `layerwise` and `attention_entropy` record their prompt anchors then), and each policy x
budget generates 8 greedy tokens from it, the session rewound in between. A run is correct when
the digits appear in the answer.

Calibration of `attention_entropy`'s resize thresholds: for every prompt the bench also records
the entropy (nats) that the policy computes at each decode step (softmax of the digest bounds of the
first sparse layer, the quantity the window resizes on) and the smallest budget at which the policy
found the needle; the `calibration` table sets the two side by side (`--write` records it too).
Deterministic: needles, digits and depths come from a fixed seed. A full sweep takes hours on 2
cores; `--contexts`, `--needles` and `--depths` trim it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from h3d.bench.report import write_section
from h3d.bench.text import corpus
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams

PLACES = ["Lisbon", "Kyoto", "Nairobi", "Quito", "Tallinn", "Hobart", "Tromso", "Cusco", "Dakar", "Oulu"]
SPARSE = ("fixed", "layerwise", "attention_entropy")


@dataclass(slots=True)
class Probe:
    """One prompt under attention_entropy: its mean decode-step entropy and, per budget, whether
    the needle was found."""

    context: int
    entropy: float
    found: dict[int, bool]


@dataclass(slots=True)
class Tally:
    correct: int = 0
    total: int = 0
    hits: float = 0.0
    ddr_evicts: int = 0


def prompts(engine: Engine, context: int, needles: int, depths: list[float], seed: int) -> list[tuple[list[int], str]]:
    rng = random.Random(seed + context)
    hay = engine.tokenizer.encode(corpus(), add_special_tokens=False)
    out = []
    for i in range(needles):
        place, code = PLACES[i % len(PLACES)], f"{rng.randrange(10000, 99999)}"
        needle = engine.tokenizer.encode(
            f" The access code for the {place} archive is {code}. ", add_special_tokens=False
        )
        question = engine.tokenizer.encode(
            f"\n\nQuestion: What is the access code for the {place} archive?\nAnswer: The access code for the "
            f"{place} archive is",
            add_special_tokens=False,
        )
        body = context - len(needle) - len(question)
        start = rng.randrange(0, len(hay) - body)
        text = hay[start : start + body]
        for depth in depths:
            at = int(depth * body)
            out.append((text[:at] + needle + text[at:] + question, code))
    return out


def run(args: argparse.Namespace, probes: list[Probe]) -> dict[tuple[int, str, int], Tally]:
    engine = Engine(
        EngineConfig.build(
            model=args.model, policy="layerwise", hbm_mb=args.hbm_mb, ddr_mb=4096, anchor_share=args.anchor_share
        )
    )
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results: dict[tuple[int, str, int], Tally] = {}
    for context in args.contexts:
        for n, (ids, code) in enumerate(prompts(engine, context, args.needles, args.depths, args.seed)):
            session = engine.create_session(policy="layerwise")
            engine.append(session, token_ids=ids)
            seq = engine.session(session).seq
            configs = [("exact", context)] + [(p, b) for p in args.policies for b in args.budgets]
            probe = Probe(context, 0.0, {})
            for policy, budget in configs:
                engine.set_policy(session, policy)
                state = engine.kv.selection(seq)
                state.window_tokens = budget
                state.entropies.clear()
                # Count this run's steps from 0: with the earlier runs' steps, `resize_every` could be
                # reached during it (after exact's 8 steps, at its 8th), resizing and clearing the
                # entropies that the calibration reads.
                state.steps = 0
                before = engine.tier_stats()
                done = engine.complete(session, "", params)
                if policy == "attention_entropy":
                    probe.found[budget] = code in done.text
                    if budget == max(args.budgets) and state.entropies:
                        probe.entropy = float(sum(state.entropies)) / len(state.entropies)
                after = engine.tier_stats()
                tally = results.setdefault((context, policy, budget), Tally())
                tally.total += 1
                tally.correct += int(code in done.text)
                if args.show:
                    print(
                        f"  {policy} {budget}: {'found' if code in done.text else 'missed'} {done.text!r}", flush=True
                    )
                needed = (after.hbm_hits + after.hbm_misses) - (before.hbm_hits + before.hbm_misses)
                tally.hits += (after.hbm_hits - before.hbm_hits) / needed if needed else 1.0
                tally.ddr_evicts += after.ddr_evict_count - before.ddr_evict_count
                engine.rewind(session, len(ids))
            engine.close_session(session)
            probes.append(probe)
            exact = results[(context, "exact", context)]
            print(f"context {context}, prompt {n + 1}: exact so far {exact.correct}/{exact.total}", flush=True)
    return results


def table(results: dict[tuple[int, str, int], Tally]) -> str:
    lines = [
        "| context | policy | budget (tokens) | accuracy | vs exact | hbm_hit_rate | ddr_evict_count |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (context, policy, budget), t in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1] != "exact", kv[0])):
        exact = results[(context, "exact", context)]
        rel = t.correct / exact.correct if exact.correct else float("nan")
        lines.append(
            f"| {context} | {policy} | {budget} | {t.correct}/{t.total} | {rel:.2f} | {t.hits / t.total:.3f} "
            f"| {t.ddr_evicts} |"
        )
    return "\n".join(lines)


def calibration(probes: list[Probe], budgets: list[int]) -> str:
    """Mean decode-step entropy of the prompts, grouped by the smallest budget that found the needle."""
    lines = [
        "| context | ln(blocks) | entropy p10 / p50 / p90 (nats) | "
        + " | ".join(f"found from {b}" for b in sorted(budgets))
        + " | never found |",
        "|---:|---:|---|" + "---|" * (len(budgets) + 1),
    ]
    for context in sorted({p.context for p in probes}):
        mine = sorted(p.entropy for p in probes if p.context == context)
        q = [mine[min(len(mine) - 1, int(f * len(mine)))] for f in (0.1, 0.5, 0.9)]
        groups: dict[int | None, list[float]] = {}
        for p in probes:
            if p.context == context:
                first = next((b for b in sorted(budgets) if p.found.get(b)), None)
                groups.setdefault(first, []).append(p.entropy)
        cells = []
        for b in [*sorted(budgets), None]:
            g = groups.get(b, [])
            cells.append(f"{len(g)} prompts, mean {sum(g) / len(g):.2f}" if g else "-")
        nb = -(-context // 32)
        lines.append(
            f"| {context} | {math.log(nb):.2f} | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot(results: dict[tuple[int, str, int], Tally], path: Path) -> None:
    """Accuracy vs budget per policy, one panel per context length (needs matplotlib: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({c for c, _, _ in results})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        exact = results[(context, "exact", context)]
        ax.axhline(exact.correct / exact.total, color="black", linestyle="--", label="exact")
        for policy in SPARSE:
            points = sorted(
                (b, t.correct / t.total) for (c, p, b), t in results.items() if c == context and p == policy
            )
            ax.plot([b for b, _ in points], [a for _, a in points], marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{context}-token context")
        ax.set_xlabel("token budget per layer")
        ax.set_ylabel("needles found")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--needles", type=int, default=5)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--policies", nargs="+", choices=SPARSE, default=list(SPARSE))
    parser.add_argument("--hbm-mb", type=float, default=64.0, help="HBM budget of the runs (hit rates)")
    parser.add_argument("--anchor-share", type=float, default=None, help="attention_entropy's anchor_share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", default=None)
    parser.add_argument("--show", action="store_true", help="print each run's answer (found or missed)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of accuracy vs budget here")
    parser.add_argument("--json", type=Path, default=None, help="write every prompt's entropy and findings here")
    args = parser.parse_args()
    probes: list[Probe] = []
    results = run(args, probes)
    out = table(results)
    calib = calibration(probes, args.budgets)
    print(out)
    print()
    print(calib)
    if args.plot:
        plot(results, args.plot)
    if args.json:
        rows = [{"context": p.context, "entropy": round(p.entropy, 4), "found": p.found} for p in probes]
        tallies = [
            {"context": c, "policy": pol, "budget": b, **asdict(t)} for (c, pol, b), t in sorted(results.items())
        ]
        args.json.write_text(json.dumps({"prompts": rows, "results": tallies}, indent=1) + "\n")
    if args.write:
        meta = (
            f"Measured {dt.date.today().isoformat()} on the 2-core CPU host, embedded model (fp32), greedy.\n\n"
            f"Command: `python -m h3d.bench.retrieval --model MODEL --contexts {' '.join(map(str, args.contexts))} "
            f"--needles {args.needles} --depths {' '.join(map(str, args.depths))} "
            f"--budgets {' '.join(map(str, args.budgets))}"
            + (f" --policies {' '.join(args.policies)}" if list(args.policies) != list(SPARSE) else "")
            + f" --hbm-mb {args.hbm_mb}"
            + (f" --anchor-share {args.anchor_share}" if args.anchor_share is not None else "")
            + "`"
        )
        write_section(Path(args.write), f"{meta}\n\n{out}", "retrieval")
        write_section(Path(args.write), f"{meta}\n\n{calib}", "calibration")


if __name__ == "__main__":
    main()
