"""The benchmark through the daemon (`h3d.bench.serve`) on the CPU (`--tiny`): it starts `h3d serve`
with its defaults, drives it over gRPC, runs the same requests in-process and writes the JSON the
GPU issue specifies, so that it does not rot between runs on a card (its figures on a CPU mean
nothing and are not kept). And its arithmetic: the engine-level configuration, the floor."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from h3d.bench import serve
from h3d.config import EngineConfig

SINGLE = {"append_s", "ttft_s", "itl_ms_p50", "itl_ms_p99", "itl_ms_mean", "engine_itl_ms_p50", "engine_append_s",
          "floor_ms"}  # fmt: skip


def test_tiny_single_phase_through_the_daemon_writes_the_specified_json(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--phase", "single", "--no-hf", "--steps", "4", "--tokenizer", str(checkpoint("llama_gqa4_tied")),
            "--work", str(tmp_path / "work"), "--out", str(out), "--write", str(tmp_path / "B.md")]  # fmt: skip
    assert serve.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data["single"]) == {"exact", "attention_entropy"}
    for mode in data["single"].values():
        assert set(mode) == {"512", "2048"}
        for fields in mode.values():
            assert set(fields) >= SINGLE and fields["tokens"] == 5  # the prompt's token, then 4 more
            assert 0 < fields["ttft_s"] < fields["append_s"] + 5 and fields["floor_ms"] > 0
            # (a gap of 0: tokens coalesced into one message, arriving together)
            assert len(fields["gaps_ms"]) == len(fields["engine_gaps_ms"]) == 4 and min(fields["gaps_ms"]) >= 0
            assert fields["itl_ms_p50"] == pytest.approx(float(np.percentile(fields["gaps_ms"], 50)), abs=0.01)
    assert data["graph_captures_after_ready"] == 0 and data["ready_s"] > 0
    assert data["runs"]["single"]["command"].startswith("python -m h3d.bench.serve --tiny")
    assert "| exact | 2K |" in (tmp_path / "B.md").read_text()


def test_tiny_gemma_shape_runs_through_the_daemon(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """`--shape gemma3-12b` writes a Gemma 3 text folder of random weights (tiny: 3 layers, two of
    them sliding with a 64-token window) that the daemon serves; its sliding layers hold HBM of their own."""
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--shape", "gemma3-12b", "--phase", "single", "--no-hf", "--steps", "4", "--tokenizer",
            str(checkpoint("llama_gqa4_tied")), "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert serve.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["model"]["architectures"] == ["Gemma3ForCausalLM"]
    for mode in data["single"].values():
        (fields,) = mode.values()
        assert fields["tokens"] == 5 and 0 < fields["window_hbm_bytes"] < fields["hbm_used_bytes"]


def test_tiny_many_phase_traces_its_kernels(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """`--trace` runs 8 more in-process steps under torch.profiler: its table written, its figures
    in the JSON (on the CPU there are no device kernels: zero)."""
    out, trace = tmp_path / "serve.json", tmp_path / "trace"
    argv = ["--tiny", "--phase", "many", "--many", "2", "--no-hf", "--steps", "3", "--tokenizer",
            str(checkpoint("llama_gqa4_tied")), "--work", str(tmp_path / "work"), "--out", str(out),
            "--trace", str(trace)]  # fmt: skip
    assert serve.main(argv) == 0
    many = json.loads(out.read_text())["many"]
    assert many["sessions"] == 2 and many["engine_tokens_per_s"] > 0
    assert 0 <= many["hbf_latency_us_p50"] <= many["hbf_latency_us_p99"]  # (0: the tiny contexts promote nothing)
    assert 0 <= many["engine_hbf_latency_us_p50"] <= many["engine_hbf_latency_us_p99"]
    phases = many["engine_phases_ms_p50"]
    assert set(phases) == set(serve.STEP_PHASES + serve.COMMIT_PARTS) and phases["copies"] >= 0
    # the in-process engine collected garbage between its steps, as the daemon does, and no longer
    assert phases["gc"] >= 0 and gc.isenabled() and gc.get_freeze_count() == 0
    assert all(len(step) == len(phases) for step in many["engine_steps_phases_ms"])
    assert many["engine_kernels"]["steps"] == 9 and many["engine_kernels"]["kernels_ms_per_step"] == 0
    moves = many["engine_kernels"]["blocks_per_step"]
    assert set(moves) == {"copied_up", "copied_down", "rebalanced", "demoted", "read_below_hbm"}
    assert all(v >= 0 for v in moves.values())
    assert "aten::" in (trace / "many-kernels.txt").read_text()


def test_many_keeps_the_daemons_half_when_the_in_process_half_fails(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's figures are in the JSON before the in-process half starts, marked as such: a
    run cut short there (a time limit, a failure) keeps them."""
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--phase", "many", "--many", "2", "--no-hf", "--steps", "3", "--tokenizer",
            str(checkpoint("llama_gqa4_tied")), "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the in-process half")

    monkeypatch.setattr(serve, "Local", fail)
    with pytest.raises(RuntimeError, match="the in-process half"):
        serve.main(argv)
    many = json.loads(out.read_text())["many"]
    assert many["sessions"] == 2 and many["tokens_per_s"] > 0 and many["in_process"] == "not ended"
    assert "engine_tokens_per_s" not in many


def test_many_leaves_out_the_sessions_the_daemon_refuses(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append or a generation the daemon refuses for want of room (RESOURCE_EXHAUSTED: the
    tiers or the device's digests cannot hold it) leaves its session out, logged and listed in the
    JSON (`refused`), not a traceback; the in-process half runs as many sessions as decoded."""
    import grpc

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "the tiers cannot hold 1.00 GiB more KV"

    calls = {"append": 0, "generate": 0}

    def refusing(name: str, nth: int) -> Any:
        real = getattr(serve.Client, name)

        def call(self: Any, *args: Any) -> Any:
            calls[name] += 1
            if calls[name] == nth:
                raise Refused()
            return real(self, *args)

        return call

    monkeypatch.setattr(serve.Client, "append", refusing("append", 2))  # the second session's append
    monkeypatch.setattr(serve.Client, "generate", refusing("generate", 2))  # one of the other two's generation
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--phase", "many", "--many", "3", "--no-hf", "--steps", "3", "--tokenizer",
            str(checkpoint("llama_gqa4_tied")), "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert serve.main(argv) == 0
    many = json.loads(out.read_text())["many"]
    assert many["sessions"] == 3 and many["decoding"] == 1 and many["tokens_per_s"] > 0
    assert many["refused"]["appends"] == [2] and len(many["refused"]["generates"]) == 1
    assert many["refused"]["generates"][0] in (1, 3) and len(many["hbm_hit_rates"]) == 1
    assert many["engine_tokens_per_s"] > 0


RESTART = {
    "sigterm_s", "blocks_left_to_recompute", "ready_s", "resume_first_token_s_128k", "resume_warm_s_128k",
    "reprefill_s_128k", "archive_resume_share", "tokens_lost", "ddr_pinned_gb", "write_behind_itl_p99_ratio",
    "park_s_128k",
}  # fmt: skip


def test_tiny_restart_phase_writes_the_specified_json(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """SIGTERM with no stream in flight, then a restart on the same data folder: nothing lost,
    nothing left to recompute, every block back from the archive."""
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--phase", "restart", "--steps", "4", "--tokenizer", str(checkpoint("llama_gqa4_tied")),
            "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert serve.main(argv) == 0
    r = json.loads(out.read_text())["restart"]
    assert set(r) >= RESTART
    assert r["tokens_lost"] == 0 and r["blocks_left_to_recompute"] == 0 and r["archive_resume_share"] == 1.0
    assert r["kv_rebuild_blocks"] == 0 and r["ssd_read_count"] > 0  # the sessions' KV came from the archive
    assert r["disk"]["write_gbps"] > 0 and r["sessions"] == [2048, 512, 512, 512, 512]
    assert r["reprefill_reused_tokens"] == 0  # the re-prefill computes its prompt: no cached prefix matches it
    assert len(r["window_tokens_at_sigterm"]) == 5 and all(w > 0 for w in r["window_tokens_at_sigterm"])


def test_the_engine_level_run_takes_the_daemons_resolved_configuration(tmp_path: Path) -> None:
    daemon = {
        "model": "/m", "device": "auto", "hbm_mb": "auto", "ddr_mb": "auto", "prefill_chunk_tokens": "auto",
        "policy": "exact", "block_size": 16, "quantize_skip_layers": [], "socket": "/s", "listen": None,
        "resolved": {"hbm_mb": 97435.0, "ddr_mb": 51547.6, "prefill_chunk_tokens": 131072, "device": "cuda"},
    }  # fmt: skip
    cfg = serve.engine_config(daemon, tmp_path)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.hbm_mb, cfg.ddr_mb, cfg.prefill_chunk_tokens, cfg.device) == (97435.0, 51547.6, 131072, "cuda")
    assert (cfg.policy, cfg.block_size, cfg.model) == ("exact", 16, "/m")
    assert cfg.ssd_path == str(tmp_path / "archive") and cfg.session_log_path == str(tmp_path / "sessions")


def test_the_floor_is_the_bytes_a_step_read_at_the_measured_bandwidths() -> None:
    def stats(hits: int, fetched: int, up: int = 0, down: int = 0) -> SimpleNamespace:
        g = SimpleNamespace(hbm_hits=hits, fetch_bytes=fetched, copy_up_bytes=up, copy_down_bytes=down)
        return SimpleNamespace(**{"global": g})

    block = serve.block_bytes({"block_size": 32}, {"num_key_value_heads": 8, "head_dim": 128}, 2)
    assert block == 2 * 32 * 8 * 128 * 2
    f = serve.floor_fields(stats(100, 0, 7, 3), stats(100 + 10 * 64, 10 * 2_000_000, 7 + 10 * block, 3), 10,
                           4_000_000_000, block, {"hbm_gbps": 4000.0, "pcie_gbps": 50.0})  # fmt: skip
    assert f["hbm_kv_bytes_read"] == 64 * block and f["pcie_bytes"] == 2_000_000
    assert (f["copy_up_bytes"], f["copy_down_bytes"]) == (block, 0)  # per step, beside the floor
    want = (4e9 + 64 * block) / 4000e9 + 2e6 / 50e9  # (the copies are not in it)
    assert f["floor_ms"] == pytest.approx(want * 1e3, abs=1e-3)


def test_many_counts_the_sessions_that_the_daemons_memory_holds() -> None:
    """An H100 host's `auto` sizing (45.9 GB of HBM and 51.5 GB of DDR for KV) holds 23 sessions
    of 32K of the Llama-3-8B shape (4.3 GB each): `many`'s default of 32 is refused there."""
    shape = serve.Shape.pick(False, {"vocab_size": 128256})
    config = {"block_size": 32, "resolved": {"hbm_mb": 45933.1, "ddr_mb": 51547.6}}
    assert serve.sessions_in_memory(config, shape, 32768) == 23
    assert serve.sessions_in_memory(config, shape, 32768 - 31) == 23  # partial blocks count whole
    assert serve.sessions_in_memory({"block_size": 32, "resolved": {}}, shape, 32768) == 0


def test_inter_token_figures_and_the_window_of_a_stream() -> None:
    s = serve.Stream(sent=10.0, arrivals=[10.5, 10.51, 10.53, 11.53])
    assert s.ttft_s == pytest.approx(0.5)
    assert s.gaps_ms() == pytest.approx([10.0, 20.0, 1000.0])
    assert s.gaps_ms(10.52, 11.0) == pytest.approx([20.0])  # the tokens that arrived within the window
    f = serve.itl([10.0, 20.0, 1000.0])
    assert f["itl_ms_p50"] == 20.0 and f["itl_ms_mean"] == pytest.approx(343.333, abs=1e-3)
    assert serve.itl([]) == {"itl_ms_p50": None, "itl_ms_p99": None, "itl_ms_mean": None}


def test_parallel_streams_raise_the_first_error_once_all_ended() -> None:
    ended: list[int] = []

    def fn(i: int) -> int:
        if i == 2:
            raise ValueError("stream 2")
        ended.append(i)
        return i * 10

    assert serve.parallel(lambda i: i * 10, [0, 1, 2]) == [0, 10, 20]
    with pytest.raises(ValueError, match="stream 2"):
        serve.parallel(fn, [0, 1, 2, 3])
    assert sorted(ended) == [0, 1, 3]


def test_a_phase_the_daemon_refuses_ends_with_its_status(
    checkpoint: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A phase whose requests the daemon refuses (32 sessions' digests on a card too small: RESOURCE_EXHAUSTED)
    exits 1 with the status in one line and in the JSON, not a traceback."""
    import grpc

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "the device cannot hold the digests"

    def phase(run: object) -> None:
        raise Refused()

    monkeypatch.setattr(serve, "phase_single", phase)
    out = tmp_path / "serve.json"
    argv = ["--tiny", "--phase", "single", "--no-hf", "--tokenizer", str(checkpoint("llama_gqa4_tied")),
            "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert serve.main(argv) == 1
    assert "phase single: the daemon answered RESOURCE_EXHAUSTED" in capsys.readouterr().err
    assert json.loads(out.read_text())["single"] == {"error": "RESOURCE_EXHAUSTED: the device cannot hold the digests"}
