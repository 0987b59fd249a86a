"""The GPU benchmark's report: its saved runs (`h3d.bench.gpu`'s JSON) as tables and as the
markdown section of docs/BENCHMARKS.md. Measures nothing and imports the standard library only, so
that saved runs render anywhere (`python -m h3d.bench.gpu --from-json ...`).
"""

from __future__ import annotations

import json
from typing import Any

WARMUP = 4  # untimed decode steps before the timed ones
H3D_MODES = ("exact_full", "exact_full_eager", "exact_25pct", "exact_25pct_eager", "attention_entropy_3GiB")
HF_MODES = ("hf_dynamic", "hf_offloaded")
MODES = ("floor", *H3D_MODES, *HF_MODES)  # the table's order
MARK = "gpu-bench"  # the section's marks in the markdown file


def summary(f: dict[str, Any]) -> str:
    """A mode's main figures on one line (the bench's log)."""
    keys = ("prefill_s", "decode_ms_per_tok", "peak_gpu_gb_beyond_weights", "hbm_hit_rate", "error", "skipped")
    return ", ".join(f"{k}={f[k]}" for k in keys if f.get(k) is not None)


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _ratio(x: float | None, ref: float | None) -> str:
    return f"{x / ref:.2f}x" if x is not None and ref else "—"


def _notes(f: dict[str, Any]) -> str:
    notes = []
    for key, text in (("error", "error: {}"), ("skipped", "skipped: {}")):
        if key in f:
            notes.append(text.format(str(f[key])[:90].replace("|", "/").replace("\n", " ")))
    if "kv_gb" in f:
        notes.append(f"weights {f['weight_gb']:.2f} GB + KV {f['kv_gb']:.2f} GB")
    if f.get("pcie_floor_ms") is not None:
        notes.append(f"PCIe floor {_num(f['pcie_floor_ms'])} ms")
    if f.get("reads_floor_ms") is not None:
        notes.append(f"floor of its reads {_num(f['reads_floor_ms'])} ms")
    if f.get("peak_decode_gb_beyond_weights") is not None and f.get("hbm_regions"):
        notes.append(f"decode peak {_num(f['peak_decode_gb_beyond_weights'])} GB")
    if f.get("promote_gb_per_step"):
        notes.append(f"promoted {_num(f['promote_gb_per_step'])} GB/step")
    if f.get("graph_steps") is not None and f.get("steps") and f.get("hbm_regions"):
        notes.append(f"graph steps {f['graph_steps']}/{f['steps']}")
    if f.get("hbf_latency_us_p50") is not None:
        notes.append(f"HBF planning p50 {_num(f['hbf_latency_us_p50'])} µs")
    if "argmax_agree_exact_full" in f:
        notes.append(
            f"fed exact_full's tokens: same argmax {f['argmax_agree_exact_full']:.0%}, logits within "
            f"{f['logits_max_diff_exact_full']} (of {f['logits_max_abs_exact_full']})"
        )
    elif "tokens_agree_exact_full" in f:  # a saved run without teacher forcing: its tokens compared
        notes.append(f"tokens = exact_full's: {f['tokens_agree_exact_full']:.0%}")
    if "prefill_chunk_halved_from" in f:
        notes.append(f"prefill OOM at chunk {f['prefill_chunk_halved_from']}, ran at {f['prefill_chunk']}")
    if "prefill_vs_chunked" in f:
        c = f["prefill_vs_chunked"]
        notes.append(
            f"prefill in {c['chunk']}-token chunks: {_num(c['prefill_s_chunked'])} s, last logits within "
            f"{c['logits_max_diff']} (of {c['logits_max_abs']}), same argmax: {'yes' if c['same_argmax'] else 'no'}"
        )
    return "; ".join(notes)


def table(data: dict[str, Any]) -> str:
    modes = data["modes"]
    lines = [
        "| mode | context | prefill s | decode ms/tok | × floor | × hf_dynamic | peak GB beyond weights "
        "| HBM hit rate | fetch GB/step | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in sorted({int(c) for per in modes.values() for c in per}):
        floor = modes.get("floor", {}).get(str(t), {}).get("decode_ms_per_tok")
        hf = modes.get("hf_dynamic", {}).get(str(t), {}).get("decode_ms_per_tok")
        for mode in MODES:
            f = modes.get(mode, {}).get(str(t))
            if f is None:
                continue
            ms = f.get("decode_ms_per_tok")
            hit = f.get("hbm_hit_rate")
            lines.append(
                f"| {mode} | {t} | {_num(f.get('prefill_s'))} | {_num(ms)} "
                f"| {_ratio(ms, floor) if mode != 'floor' else '1.00x'} | {_ratio(ms, hf)} "
                f"| {_num(f.get('peak_gpu_gb_beyond_weights'))} | {'—' if hit is None else f'{hit:.3f}'} "
                f"| {_num(f.get('fetch_gb_per_step'))} | {_notes(f)} |"
            )
    many = data.get("many_sessions")
    if many:
        lines += ["", "| sessions × context | tokens/s | step ms p50 | step ms p99 | HBM hit rate | notes |"]
        lines.append("|---|---:|---:|---:|---:|---|")
        if "error" in many or "skipped" in many:
            lines.append(f"| — | — | — | — | — | {_notes(many)} |")
        else:
            lines.append(
                f"| {many['sessions']} × {many['context']} | {_num(many['tokens_per_s'])} "
                f"| {_num(many['step_ms_p50'])} | {_num(many['step_ms_p99'])} | {_num(many['hbm_hit_rate'])} "
                f"| HBM for KV {many['hbm_budget_gb']} GB; fetch {_num(many['fetch_gb_per_step'])} GB/step; "
                f"HBF planning p50 {_num(many['hbf_latency_us_p50'])} µs"
                + (f"; pinned DDR {many['ddr_gb']} GB" if "ddr_gb" in many else "")
                + (f"; graph steps {many['graph_steps']}/{many['steps']}" if "graph_steps" in many else "")
                + " |"
            )
    return "\n".join(lines)


def command(data: dict[str, Any]) -> str:
    """The command that made a saved run, from what it holds."""
    contexts = sorted({int(c) for per in data["modes"].values() for c in per})
    steps = max((f.get("steps", 0) for per in data["modes"].values() for f in per.values()), default=0)
    cmd = "python -m h3d.bench.gpu" + (" --tiny" if data["card"] == "cpu" else "")
    cmd += f" --contexts {' '.join(map(str, contexts))}" + (f" --steps {steps}" if steps and steps != 32 else "")
    many = data.get("many_sessions") or {}
    if "sessions" in many:
        cmd += f" --many-sessions {many['sessions']} --many-context {many['context']}"
    return f"`{cmd}`"


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Saved runs (say 32K and 128K, one device call each) as one: later runs' cells win."""
    data = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        for mode, per in run["modes"].items():
            data["modes"].setdefault(mode, {}).update(per)
        data["many_sessions"] = run.get("many_sessions") or data.get("many_sessions")
        for key in ("date", "card"):
            if run[key] not in str(data[key]).split(", "):
                data[key] = f"{data[key]}, {run[key]}"
    return data


def section(data: dict[str, Any], commands: list[str]) -> str:
    c = data["ceilings"]
    shape = (
        "the --tiny shape (4 layers, hidden 256), fp32 on the CPU"
        if data["card"] == "cpu"
        else "Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256), "
        "random bf16 weights"
    )
    meta = (
        f"Measured {data['date']} on {data['card']}, torch {data['torch']}, Triton {data['triton']}, "
        f"transformers {data['transformers']}; {shape}; batch 1, block_size 32, random prompt ids. Decode is the "
        f"median of the timed greedy steps (after {WARMUP} warm-up steps), each synchronized. Ceilings: HBM copy "
        f"{c['hbm_copy_gbps']} GB/s (read + write), pinned H2D {c['h2d_gbps']} GB/s. `floor` = (weights + KV bytes) / "
        "HBM copy bandwidth; × floor and × hf_dynamic are ratios of decode time (lower is better); peak GB beyond "
        "weights is torch's peak allocation minus what was resident before the mode. GB = 1e9 bytes."
    )
    return f"{meta}\n\nCommand: {', '.join(commands)}\n\n{table(data)}"
