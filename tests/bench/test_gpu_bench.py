"""The GPU benchmark's own path on the CPU (`--tiny`): it runs end to end, writes the JSON the GPU
issue specifies and its markdown section, so that it does not rot between runs on a card. (Its
figures on a CPU mean nothing and are not kept.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from h3d.bench.gpu import BLOCK, H3D_MODES, WARMUP, Sizes, plan
from h3d.config import EngineConfig
from h3d.errors import ConfigError
from h3d.hbf.policy import HbfConfig
from h3d.kv.pool import KVPool
from h3d.kv.sizing import plan_pools, region_sizes, slot_bytes
from h3d.model.config import parse_model_config

FIELDS = {"prefill_s", "decode_ms_per_tok", "peak_gpu_gb_beyond_weights", "hbm_hit_rate", "fetch_gb_per_step"}


def test_tiny_run_writes_the_specified_json_and_section(tmp_path: Path) -> None:
    out, doc = tmp_path / "run.json", tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    cmd = [sys.executable, "-m", "h3d.bench.gpu", "--tiny", "--steps", "2", "--no-hf", "--out", str(out)]
    cmd += ["--modes", "exact_full", "exact_25pct", "attention_entropy_3GiB", "--write", str(doc)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {"date", "card", "ceilings", "modes", "many_sessions"} <= set(data)
    contexts = {"512", "1024"}
    for mode in ("floor", "exact_full", "exact_25pct", "attention_entropy_3GiB"):
        assert set(data["modes"][mode]) == contexts, mode
        for entry in data["modes"][mode].values():
            assert set(entry) >= FIELDS, (mode, entry)
    full = data["modes"]["exact_full"]["1024"]
    assert full["decode_ms_per_tok"] > 0 and full["hbm_hit_rate"] == 1.0
    assert data["modes"]["exact_25pct"]["1024"]["hbm_hit_rate"] < 0.5  # a quarter of the blocks in HBM
    change = data["batch_change"]  # the batch-change phase (no graphs on the CPU: nothing captured)
    assert change["steps"] == 12 and change["batch_changes"] == 10 and change["captures_on_batch_change"] == 0
    assert change["graph_buffers_mb"] == 0  # no graphs on the CPU
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n") and "<!-- gpu-bench:start -->" in text
    assert "| exact_full | 1024 |" in text
    # Saved runs render again without measuring.
    again = subprocess.run(
        [sys.executable, "-m", "h3d.bench.gpu", "--from-json", str(out), "--write", str(doc)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert doc.read_text().count("<!-- gpu-bench:start -->") == 1


def test_every_bench_imports_and_writes_its_section(tmp_path: Path) -> None:
    """The benches outside `make test` share `h3d.bench.report`: each imports, and a section is
    replaced in place (not appended twice)."""
    import importlib

    from h3d.bench.report import write_section

    for name in ("ab", "cpu", "codecs", "gpu", "hbf_cost", "load", "restart", "retrieval", "sizing"):
        importlib.import_module(f"h3d.bench.{name}")
    doc = tmp_path / "B.md"
    write_section(doc, "one", "x")
    write_section(doc, "two", "x")
    assert doc.read_text() == "# Benchmarks\n\n<!-- x:start -->\ntwo\n<!-- x:end -->\n"


# ---- the report: fixed runs rendered as before `h3d.bench.gpu_report` held the renderers ----------

META = {"date": "2026-12-01", "card": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0"}
NONE4 = {"peak_gpu_gb_beyond_weights": None, "hbm_hit_rate": None, "fetch_gb_per_step": None}
FLOOR = {"prefill_s": None, "decode_ms_per_tok": 4.843, **NONE4, "weight_gb": 16.061, "kv_gb": 4.295}
H3D = {"prefill_s": 2.404, "decode_ms_per_tok": 6.663, "steps": 32, "graph_steps": 32, "hbm_hit_rate": 1.0}
H3D.update(peak_gpu_gb_beyond_weights=5.378, peak_decode_gb_beyond_weights=4.364, fetch_gb_per_step=0.0)
H3D.update(promote_gb_per_step=0.0, hbf_latency_us_p50=None, hbm_regions=[1028])
CHUNKED = {"chunk": 8192, "prefill_s_chunked": 1.799, "logits_max_diff": 0.2891, "logits_max_abs": 5.656}
AGREE = {"argmax_agree_exact_full": 0.917, "logits_max_diff_exact_full": 0.2891, "logits_max_abs_exact_full": 6.781}
SPARSE = {**H3D, "decode_ms_per_tok": 23.41, "hbm_hit_rate": 0.8123, "fetch_gb_per_step": 0.0521}
SPARSE.update(promote_gb_per_step=0.0123, hbf_latency_us_p50=812.5, reads_floor_ms=5.37, graph_steps=30)
RUN_32K: dict[str, Any] = {
    **META,
    "transformers": "5.17.0",
    "ceilings": {"hbm_copy_gbps": 4203.0, "h2d_gbps": 53.64},
    "modes": {
        "floor": {"32768": FLOOR},
        "exact_full": {"32768": {**H3D, "prefill_vs_chunked": {**CHUNKED, "same_argmax": True}}},
        "exact_25pct": {
            "32768": {**H3D, **AGREE, "decode_ms_per_tok": 70.009, "pcie_floor_ms": 58.21, "hbm_regions": [256]}
        },
        "exact_full_eager": {"32768": {"skipped": "time budget spent (--max-seconds 540)"}},
        "attention_entropy_3GiB": {"32768": {**SPARSE, "tokens_agree_exact_full": 0.5}},
        "hf_dynamic": {"32768": {"prefill_s": 1.39, "decode_ms_per_tok": 49.6, "steps": 32, **NONE4}},
        "hf_offloaded": {"32768": {"error": "OutOfMemoryError: CUDA out of memory | tried 2.00 GiB\nagain"}},
    },
    "many_sessions": {"error": "RuntimeError: cudaHostRegister failed"},
}
MANY = {"sessions": 16, "context": 32768, "tokens_per_s": 812.3, "step_ms_p50": 19.7, "step_ms_p99": 25.04}
MANY.update(hbm_hit_rate=0.91, hbm_budget_gb=40.0, fetch_gb_per_step=0.52, hbf_latency_us_p50=1412.0)
RUN_128K: dict[str, Any] = {
    **META,
    "date": "2026-12-02",
    "transformers": "5.17.0",
    "ceilings": {"hbm_copy_gbps": 4190.0, "h2d_gbps": 53.1},
    "modes": {
        "floor": {"131072": {**FLOOR, "decode_ms_per_tok": 7.909, "kv_gb": 17.18}},
        "exact_25pct": {
            "131072": {
                **H3D,
                **AGREE,
                "steps": 16,
                "decode_ms_per_tok": 269.4,
                "prefill_chunk_halved_from": 131072,
                "prefill_chunk": 65536,
                "prefill_vs_chunked": {**CHUNKED, "same_argmax": False},
            }
        },
        "attention_entropy_3GiB": {"131072": {**SPARSE, **AGREE, "steps": 16}},
    },
    "many_sessions": {**MANY, "ddr_gb": 187.5, "graph_steps": 31, "steps": 32},
}
RUN_TINY: dict[str, Any] = {
    **META,
    "card": "cpu",
    "triton": None,
    "transformers": None,
    "ceilings": {"hbm_copy_gbps": 41.2, "h2d_gbps": None},
    "modes": {"floor": {"512": {**FLOOR, "decode_ms_per_tok": 0.00123}}, "exact_full": {"512": {**H3D, "steps": 2}}},
    "many_sessions": {"error": "ConfigError: hbm_mb: 0.9 MiB holds fewer than one KV block per layer"},
}
# What `h3d.bench.gpu` rendered of these runs before its report moved (captured from that code).
REPORT = """Measured 2026-12-01, 2026-12-02 on NVIDIA H200, torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17.0; Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256), random bf16 weights; batch 1, block_size 32, random prompt ids. Decode is the median of the timed greedy steps (after 4 warm-up steps), each synchronized. Ceilings: HBM copy 4203.0 GB/s (read + write), pinned H2D 53.64 GB/s. `floor` = (weights + KV bytes) / HBM copy bandwidth; × floor and × hf_dynamic are ratios of decode time (lower is better); peak GB beyond weights is torch's peak allocation minus what was resident before the mode. GB = 1e9 bytes.

Command: `python -m h3d.bench.gpu --contexts 32768`, `python -m h3d.bench.gpu --contexts 131072 --steps 16 --many-sessions 16 --many-context 32768`

| mode | context | prefill s | decode ms/tok | × floor | × hf_dynamic | peak GB beyond weights | HBM hit rate | fetch GB/step | notes |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---|
| floor | 32768 | — | 4.84 | 1.00x | 0.10x | — | — | — | weights 16.06 GB + KV 4.29 GB |
| exact_full | 32768 | 2.4 | 6.66 | 1.38x | 0.13x | 5.38 | 1.000 | 0 | decode peak 4.36 GB; graph steps 32/32; prefill in 8192-token chunks: 1.8 s, last logits within 0.2891 (of 5.656), same argmax: yes |
| exact_full_eager | 32768 | — | — | — | — | — | — | — | skipped: time budget spent (--max-seconds 540) |
| exact_25pct | 32768 | 2.4 | 70.0 | 14.46x | 1.41x | 5.38 | 1.000 | 0 | PCIe floor 58.2 ms; decode peak 4.36 GB; graph steps 32/32; fed exact_full's tokens: same argmax 92%, logits within 0.2891 (of 6.781) |
| attention_entropy_3GiB | 32768 | 2.4 | 23.4 | 4.83x | 0.47x | 5.38 | 0.812 | 0.0521 | floor of its reads 5.37 ms; decode peak 4.36 GB; promoted 0.0123 GB/step; graph steps 30/32; HBF planning p50 812 µs; tokens = exact_full's: 50% |
| hf_dynamic | 32768 | 1.39 | 49.6 | 10.24x | 1.00x | — | — | — |  |
| hf_offloaded | 32768 | — | — | — | — | — | — | — | error: OutOfMemoryError: CUDA out of memory / tried 2.00 GiB again |
| floor | 131072 | — | 7.91 | 1.00x | — | — | — | — | weights 16.06 GB + KV 17.18 GB |
| exact_25pct | 131072 | 2.4 | 269 | 34.06x | — | 5.38 | 1.000 | 0 | decode peak 4.36 GB; graph steps 32/16; fed exact_full's tokens: same argmax 92%, logits within 0.2891 (of 6.781); prefill OOM at chunk 131072, ran at 65536; prefill in 8192-token chunks: 1.8 s, last logits within 0.2891 (of 5.656), same argmax: no |
| attention_entropy_3GiB | 131072 | 2.4 | 23.4 | 2.96x | — | 5.38 | 0.812 | 0.0521 | floor of its reads 5.37 ms; decode peak 4.36 GB; promoted 0.0123 GB/step; graph steps 30/16; HBF planning p50 812 µs; fed exact_full's tokens: same argmax 92%, logits within 0.2891 (of 6.781) |

| sessions × context | tokens/s | step ms p50 | step ms p99 | HBM hit rate | notes |
|---|---:|---:|---:|---:|---|
| 16 × 32768 | 812 | 19.7 | 25.0 | 0.91 | HBM for KV 40.0 GB; fetch 0.52 GB/step; HBF planning p50 1412 µs; pinned DDR 187.5 GB; graph steps 31/32 |

Measured 2026-12-01 on cpu, torch 2.11.0+cu130, Triton None, transformers None; the --tiny shape (4 layers, hidden 256), fp32 on the CPU; batch 1, block_size 32, random prompt ids. Decode is the median of the timed greedy steps (after 4 warm-up steps), each synchronized. Ceilings: HBM copy 41.2 GB/s (read + write), pinned H2D None GB/s. `floor` = (weights + KV bytes) / HBM copy bandwidth; × floor and × hf_dynamic are ratios of decode time (lower is better); peak GB beyond weights is torch's peak allocation minus what was resident before the mode. GB = 1e9 bytes.

Command: `python -m h3d.bench.gpu --tiny --contexts 512 --steps 2`

| mode | context | prefill s | decode ms/tok | × floor | × hf_dynamic | peak GB beyond weights | HBM hit rate | fetch GB/step | notes |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---|
| floor | 512 | — | 0.00123 | 1.00x | — | — | — | — | weights 16.06 GB + KV 4.29 GB |
| exact_full | 512 | 2.4 | 6.66 | 5417.07x | — | 5.38 | 1.000 | 0 | decode peak 4.36 GB; graph steps 32/2 |

| sessions × context | tokens/s | step ms p50 | step ms p99 | HBM hit rate | notes |
|---|---:|---:|---:|---:|---|
| — | — | — | — | — | error: ConfigError: hbm_mb: 0.9 MiB holds fewer than one KV block per layer |
decode_ms_per_tok=4.843
decode_ms_per_tok=7.909
prefill_s=2.404, decode_ms_per_tok=6.663, peak_gpu_gb_beyond_weights=5.378, hbm_hit_rate=1.0
prefill_s=2.404, decode_ms_per_tok=70.009, peak_gpu_gb_beyond_weights=5.378, hbm_hit_rate=1.0
prefill_s=2.404, decode_ms_per_tok=269.4, peak_gpu_gb_beyond_weights=5.378, hbm_hit_rate=1.0
skipped=time budget spent (--max-seconds 540)
prefill_s=2.404, decode_ms_per_tok=23.41, peak_gpu_gb_beyond_weights=5.378, hbm_hit_rate=0.8123
prefill_s=2.404, decode_ms_per_tok=23.41, peak_gpu_gb_beyond_weights=5.378, hbm_hit_rate=0.8123
prefill_s=1.39, decode_ms_per_tok=49.6
error=OutOfMemoryError: CUDA out of memory | tried 2.00 GiB
again
"""  # noqa: E501


def test_saved_runs_render_as_the_bench_rendered_them() -> None:
    """Two runs merged and a --tiny one, every note and both many-sessions rows: the markdown
    section, the commands and the log's summaries, byte for byte."""
    from h3d.bench.gpu_report import command, merge, section, summary

    runs = [RUN_32K, RUN_128K]
    merged = merge(runs)
    text = section(merged, [command(r) for r in runs]) + "\n\n" + section(RUN_TINY, [command(RUN_TINY)]) + "\n"
    text += "\n".join(summary(f) for per in merged["modes"].values() for f in per.values()) + "\n"
    assert text == REPORT
    assert merged["modes"]["floor"].keys() == {"32768", "131072"} and RUN_32K["date"] == "2026-12-01"  # not mutated


# ---- planning: each mode's pools through the engine's sizing, as the previous formula made them ---


def old_plan(
    b: Any, mode: str, tokens: int, steps: int, sessions: int = 1, hbm_bytes: int = 0
) -> tuple[list[int], int, HbfConfig]:
    """(HBM slots of each layer's region, DDR slots, HBF config) of a mode for `sessions` of
    `tokens` tokens that then decode `steps` (+ warm-up) tokens.

    The previous formula: `h3d.bench.gpu.plan` as it was before it sized the pools through the
    engine's `h3d.kv.sizing.plan_pools`, copied unchanged (`b` needs `cfg` and `sizes` only)."""
    cfg, nl = b.cfg, b.cfg.num_layers
    nb_ctx = -(-tokens // BLOCK)
    nb = sessions * -(-(tokens + WARMUP + steps + 1) // BLOCK)  # every block the run writes
    mode = mode.removesuffix("_eager")
    if mode == "exact_full":
        return [nb + 2] * nl, 4 * nl, replace(EngineConfig(), policy="exact").hbf
    if mode == "exact_25pct":
        hbm = max(1, math.ceil(nb_ctx / 4))
        return [hbm] * nl, (nb - hbm) * nl + 4 * nl, replace(EngineConfig(), policy="exact").hbf
    # The budget holds the digests too (they stay in HBM): the pool gets what they leave.
    hbf = replace(EngineConfig(), policy="attention_entropy", **b.sizes.hbf).hbf
    parts = max(1, BLOCK // hbf.digest_tokens)
    elem = torch.empty((), dtype=b.sizes.dtype).element_size()
    digest_bytes = nb * parts * nl * cfg.num_kv_heads * 2 * cfg.head_dim * elem
    budget = (hbm_bytes or b.sizes.entropy_hbm_bytes) - digest_bytes
    slots = KVPool.slots_for_budget(budget / 2**20, BLOCK, cfg.num_kv_heads, cfg.head_dim, b.sizes.dtype)
    # The dense layers read every block at every step: their regions hold all of them (at most
    # half of the pool, `dense_hbm_share`), the other layers share the rest.
    dense = min(hbf.dense_layers, nl - 1)
    dense_slots = min(nb + 2, slots // (2 * dense)) if dense else 0
    sparse = max(1, min((slots - dense_slots * dense) // (nl - dense), nb + 2))
    regions = [dense_slots] * dense + [sparse] * (nl - dense)
    # DDR: every block HBM does not hold, plus room for copies of half of HBM's (HBF's victims keep
    # one); a 32nd with many sessions, whose DDR (pinned) must fit in the host's memory (a victim
    # with no room for its copy stays in HBM).
    share = 2 if sessions == 1 else 32
    held = sum(min(r, nb) for r in regions)
    ddr = nb * nl - held + math.ceil(held / share) + 4 * nl * sessions
    return regions, ddr, hbf


def _inputs(tiny: bool) -> tuple[Any, Any]:
    """What `plan` reads of a `Bench`: the sizes and the model's config (no model, no GPU)."""
    sizes = Sizes.pick(tiny)
    return sizes, parse_model_config({**sizes.model, "max_position_embeddings": 1 << 18})


@pytest.mark.parametrize("tiny", [True, False])
def test_every_mode_plans_the_pools_the_previous_formula_planned(tiny: bool) -> None:
    """Every h3d mode at each context, at the warm-up's prompt and at the chunked-prefill check's
    (0 steps), and the many-sessions runs: the same regions and DDR slots, and the same HBF config,
    from `plan_pools`."""
    sizes, cfg = _inputs(tiny)
    b = SimpleNamespace(cfg=cfg, sizes=sizes)
    warm = 2 * sizes.hbf["window_tokens"] + BLOCK
    cases = [(m, t, s, 1, 0) for m in H3D_MODES for t in (*sizes.contexts, warm) for s in (0, 2, 16, 32)]
    gbs = (sizes.many_hbm_gb, 2 * sizes.many_hbm_gb)
    cases += [
        ("attention_entropy", sizes.many_context, s, n, int(gb * 1e9)) for n in (1, 2, 4) for s in (8, 32) for gb in gbs
    ]
    if not tiny:
        cases += [("attention_entropy", sizes.many_context, 16, n, int(40e9)) for n in (8, 16, 32)]
    for mode, tokens, steps, sessions, hbm_bytes in cases:
        regions, ddr, hbf = old_plan(b, mode, tokens, steps, sessions, hbm_bytes)
        pools, new_hbf = plan(cfg, sizes, mode, tokens, steps, sessions, hbm_bytes)
        assert (list(pools.regions), pools.ddr_slots, new_hbf) == (regions, ddr, hbf), (mode, tokens, steps, sessions)


def test_the_figures_saved_runs_report_do_not_move() -> None:
    """hbm_regions, hbm_budget_gb and ddr_gb of bench/results/2026-12-01i-h200.json's h3d modes and
    of the 32-session run (2026-12-01g-h200-many32.json, 16 steps, 40 GB), planned again."""
    sizes, cfg = _inputs(False)
    slot = slot_bytes(BLOCK, cfg.num_kv_heads, cfg.head_dim, 2)
    saved = {
        ("exact_full", 32768): ([1028], 4.312, 0.017),
        ("exact_full", 131072): ([4100], 17.197, 0.017),
        ("exact_25pct", 32768): ([256], 1.074, 3.246),
        ("exact_25pct", 131072): ([1024], 4.295, 12.91),
        ("attention_entropy_3GiB", 32768): ([682, 1028], 2.951, 2.845),
        ("attention_entropy_3GiB", 131072): ([273, 4095], 2.147, 16.132),
    }
    for (mode, t), figures in saved.items():
        pools, _ = plan(cfg, sizes, mode, t, 32)
        got = sorted(set(pools.regions)), round(pools.hbm_slots * slot / 1e9, 3), round(pools.ddr_slots * slot / 1e9, 3)
        assert got == figures, (mode, t)
    pools, _ = plan(cfg, sizes, "attention_entropy", 32768, 16, 32, int(40e9))
    assert (round(pools.hbm_slots * slot / 1e9, 3), round(pools.ddr_slots * slot / 1e9, 3)) == (31.401, 107.69)


def test_plan_pools_sizes_the_engine_pools_as_it_sized_them() -> None:
    """`plan_pools` against the engine's own sizing (`KVPool.slots_for_budget` for both tiers, then
    the regions): several budgets and dense shares, and the ConfigError of an HBM budget below one
    block per layer."""
    for hbm_mb, ddr_mb, share, dense, dtype in [
        (1024.0, 4096.0, None, 2, torch.bfloat16),
        (1024.0, 0.0, 0.6, 2, torch.bfloat16),
        (3.5, 7.25, 0.5, 1, torch.float32),
        (100.0, 1.0, 0.99, 2, torch.float16),
        (100.0, 1.0, 0.3, 4, torch.float16),  # no sparse layer left: equal regions
    ]:
        hbm = KVPool.slots_for_budget(hbm_mb, 32, 8, 128, dtype)
        ddr = KVPool.slots_for_budget(ddr_mb, 32, 8, 128, dtype)
        pools = plan_pools(hbm_mb, ddr_mb, 32, 4, 8, 128, dtype.itemsize, dense, share)
        assert (list(pools.regions), pools.ddr_slots) == (region_sizes(hbm, 4, dense, share), ddr)
        assert pools.hbm_slots <= hbm
    with pytest.raises(ConfigError, match=r"hbm_mb: 0\.25 MiB holds fewer than one KV block per layer$"):
        plan_pools(0.25, 1.0, 32, 4, 8, 128, 2)  # 2 slots of 128 KiB for 4 layers
    assert plan_pools(1.0, 0.0, 32, 4, 8, 128, 2).regions == (2, 2, 2, 2)  # 1 MiB: 8 slots of 128 KiB
    assert region_sizes(100, 4, 2, 0.6, max_slots=28) == [28, 28, 22, 22]  # what the capped dense ones leave
    assert region_sizes(100, 4, 2, 0.6, max_slots=25) == [25, 25, 25, 25]


def test_ab_merges_pairs_into_median_ratios(tmp_path: Path) -> None:
    """`h3d.bench.ab`: the runs of two trees, in pair order, give per mode and context each tree's
    list and the median of the per-pair ratios new / old; the new runs' batch-change captures add
    up; a mode a run lacks is left out of its ratios."""

    def run(ms: float, prefill: float, captures: int | None = None) -> Path:
        modes = {"exact_full": {"32768": {"decode_ms_per_tok": ms, "prefill_s": prefill}}}
        if ms > 9:
            modes["attention_entropy_3GiB"] = {"32768": {"decode_ms_per_tok": 20.0, "prefill_s": 1.0}}
        data: dict[str, Any] = {"date": "2026-12-02", "card": "H200", "modes": modes}
        if captures is not None:
            data["batch_change"] = {"captures_on_batch_change": captures}
        path = tmp_path / f"{ms}-{prefill}-{captures}.json"
        path.write_text(json.dumps(data))
        return path

    old = [run(10.0, 2.0), run(8.0, 2.0), run(10.0, 1.0)]
    new = [run(11.0, 2.0, 0), run(8.0, 1.0, 1), run(12.0, 1.0, 0)]  # ratios 1.1, 1.0, 1.2; 1, 0.5, 1
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "-m", "h3d.bench.ab", "--old", *map(str, old), "--new", *map(str, new), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["old"]["exact_full"]["32768"] == {"decode_ms_per_tok": [10.0, 8.0, 10.0], "prefill_s": [2, 2, 1]}
    assert result["new"]["exact_full"]["32768"]["decode_ms_per_tok"] == [11.0, 8.0, 12.0]
    assert result["ratio"]["decode_ms_per_tok"]["exact_full"]["32768"] == 1.1
    assert result["ratio"]["prefill_s"]["exact_full"]["32768"] == 1.0
    assert result["ratio"]["decode_ms_per_tok"]["attention_entropy_3GiB"]["32768"] == 1.0  # pairs 1 and 3 only
    assert result["new"]["captures_on_batch_change"] == 1
    assert "| exact_full | 32768 | 10.0, 8.0, 10.0 | 11.0, 8.0, 12.0 | 1.1 | 1.0 |" in done.stdout
    mismatched = subprocess.run([*cmd[:6], "--new", str(new[0])], capture_output=True, text=True, timeout=120)
    assert mismatched.returncode == 2 and "one of each per pair" in mismatched.stderr
