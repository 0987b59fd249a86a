"""The daemon's configuration (TOML + flags), its metrics text and the Grafana dashboard that reads it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from live_daemon import running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.config import RELOADABLE, DaemonConfig, key_types, load
from h3d.daemon.metrics import Histogram, Metrics
from h3d.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "h3d.toml"
    path.write_text(text)
    return str(path)


def test_file_then_flags_flags_win(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'model = "m"\nhbm_mb = 64.0\nblock_size = 16\nlog_level = "debug"\n'
        "[sampling]\ntemperature = 0.5\nmax_tokens = 9\n",
    )
    cfg = load(path, {"hbm_mb": 32.0, "sampling_max_tokens": 7, "data_dir": str(tmp_path)})
    assert cfg.engine.hbm_mb == 32.0 and cfg.engine.block_size == 16 and cfg.log_level == "debug"
    assert cfg.engine.sampling.temperature == 0.5 and cfg.engine.sampling.max_tokens == 7
    # The archive defaults to the data dir; the socket too.
    assert cfg.engine.ssd_path == str(tmp_path / "archive") and cfg.socket_path == tmp_path / "h3d.sock"


@pytest.mark.parametrize(
    ("text", "overrides", "names"),
    [
        ('model = "m"\nbogus = 1\n', {}, "bogus"),
        ('model = "m"\n[sampling]\nbogus = 1\n', {}, "sampling.bogus"),
        ('model = "m"\nhbm_mb = "lots"\n', {}, "hbm_mb: expected a number or 'auto'"),
        ('model = "m"\nprefill_chunk_tokens = 1.5\n', {}, "prefill_chunk_tokens: expected an integer or 'auto'"),
        ('model = "m"\n', {"ddr_mb": "big"}, "ddr_mb: expected a number or 'auto'"),
        ('model = "m"\nblock_size = 1.5\n', {}, "block_size"),
        ('model = "m"\n[sampling]\ntop_p = 0\n', {}, "sampling.top_p"),
        ('model = "m"\nlog_level = "loud"\n', {}, "log_level"),
        ('model = "m"\nsocket_mode = "rw"\n', {}, "socket_mode"),
        ('model = "m"\nlisten = "0.0.0.0:50051"\n', {}, "listen"),
        ('model = "m"\nlisten = "nonsense"\n', {}, "listen"),
        ('model = "m"\nmax_tokens_limit = 0\n', {}, "max_tokens_limit"),
        ('model = "m"\ncpu_threads = -2\n', {}, "cpu_threads: must be >= 1"),
        ('model = "m"\ncpu_threads = 1.5\n', {}, "cpu_threads: expected an integer"),
        ('model = "m"\ntls_cert_file = "/nonexistent"\ntls_key_file = "/nonexistent"\n', {}, "tls_cert_file"),
        ("model = [\n", {}, "TOML"),
        ('model = "m"\n', {"nonsense_key": 1}, "nonsense_key"),
        ("", {}, "model"),
    ],
)
def test_bad_configuration_names_the_key(tmp_path: Path, text: str, overrides: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(names)):
        load(_toml(tmp_path, text), {"data_dir": str(tmp_path), **overrides})


def test_tcp_beyond_loopback_needs_tls_or_a_token(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# clients\nsecret-1\n\n")
    cfg = load(None, {"model": "m", "data_dir": str(tmp_path), "listen": "0.0.0.0:0", "auth_token_file": str(tokens)})
    assert cfg.listen == "0.0.0.0:0"
    assert load(None, {"model": "m", "data_dir": str(tmp_path), "listen": "127.0.0.1:0"}).listen == "127.0.0.1:0"
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="auth_token_file"):
        load(None, {"model": "m", "data_dir": str(tmp_path), "auth_token_file": str(empty)})


@pytest.mark.parametrize("key", ["listen", "http_listen"])
def test_both_listeners_follow_one_rule_beyond_loopback(tmp_path: Path, key: str) -> None:
    base = {"model": "m", "data_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=rf"^{key}: 0.0.0.0:8000 is reachable beyond this host"):
        load(None, {**base, key: "0.0.0.0:8000"})
    assert getattr(load(None, {**base, key: "[::1]:0"}), key) == "[::1]:0"
    cert, pem = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    pem.write_text("x")
    tls = load(None, {**base, key: "0.0.0.0:8000", "tls_cert_file": str(cert), "tls_key_file": str(pem)})
    assert getattr(tls, key) == "0.0.0.0:8000"
    with pytest.raises(ConfigError, match=rf"^{key}: 'localhost' is not HOST:PORT"):
        load(None, {**base, key: "localhost"})


def test_every_key_is_a_flag_and_reloadable_keys_exist() -> None:
    from h3d.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for key in key_types():
        assert "--" + key.replace("_", "-") in flags, key
    assert set(RELOADABLE) <= set(DaemonConfig.__dataclass_fields__)


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        h.observe(v)
    lines = h.lines("x")
    assert lines[:3] == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 5']
    assert lines[3] == "x_sum 5.65" and lines[4] == "x_count 5"


def _rendered() -> str:
    m = Metrics()
    m.rpc("Generate", "OK", 0.2)
    m.token(0.1, first=True)
    m.token(0.02, first=False)
    stats = pb.Stats(uptime_s=5.0)
    stats.__getattribute__("global").hbm_hit_rate = 0.75
    stats.__getattribute__("global").ddr_evict_count = 12
    stats.throughput.generated_tokens_total = 40
    stats.throughput.queued_requests = 2
    return m.render(stats, in_flight=3)


def test_metrics_text_carries_the_figures() -> None:
    text = _rendered()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert values["h3d_hbm_hit_rate"] == "0.75" and values["h3d_ddr_evict_total"] == "12"
    assert values["h3d_generated_tokens_total"] == "40" and values["h3d_requests_in_flight"] == "3"
    assert values["h3d_requests_queued"] == "2"
    assert values['h3d_rpc_total{api="grpc",method="Generate",code="OK"}'] == "1"
    assert values["h3d_ttft_seconds_count"] == "1" and values["h3d_inter_token_seconds_count"] == "1"
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert all(n.startswith("h3d_") for n in names)


def test_dashboard_queries_only_exported_metrics() -> None:
    dash = json.loads((ROOT / "docs/grafana-dashboard.json").read_text())
    exported = {
        re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
        for line in _rendered().splitlines()
        if line and not line.startswith("#")
    }
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"\bh3d_[a-z_]+", t["expr"])}
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    assert used and used <= exported, used - exported


def test_digest_tokens_must_divide_the_block() -> None:
    """digest_tokens splits each block into equal parts (or covers it whole); anything else is refused by name."""
    from h3d.config import ConfigError, EngineConfig

    assert EngineConfig.build(model="m", block_size=32, digest_tokens=8).hbf.digest_tokens == 8
    assert EngineConfig.build(model="m", block_size=16, digest_tokens=32).digest_tokens == 32
    with pytest.raises(ConfigError, match="digest_tokens"):
        EngineConfig.build(model="m", block_size=32, digest_tokens=12)
    with pytest.raises(ConfigError, match="digest_tokens"):
        EngineConfig.build(model="m", block_size=32, digest_tokens=0)


def test_anchor_share_is_a_fraction() -> None:
    """anchor_share reaches the HBF config; outside [0, 1] it is refused by name."""
    from h3d.config import ConfigError, EngineConfig

    assert EngineConfig.build(model="m", anchor_share=0.0).hbf.anchor_share == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="anchor_share"):
            EngineConfig.build(model="m", anchor_share=bad)


# ---- cpu_threads --------------------------------------------------------------------------


def test_cpu_threads_auto_is_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or 0: OMP_NUM_THREADS when the user set it, else the cores this process may run on."""
    from h3d.config import EngineConfig
    from h3d.engine.threads import resolve_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    auto = EngineConfig.build(model="m")
    assert auto.cpu_threads is None
    assert resolve_cpu_threads(auto) == len(os.sched_getaffinity(0))
    assert resolve_cpu_threads(EngineConfig.build(model="m", cpu_threads=0)) == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # as under `taskset -c 0`
    assert resolve_cpu_threads(auto) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert resolve_cpu_threads(auto) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolve_cpu_threads(auto) == 2
    assert resolve_cpu_threads(EngineConfig.build(model="m", cpu_threads=5)) == 5  # the key wins


def test_cpu_threads_is_applied_to_torch() -> None:
    import torch

    from h3d.config import EngineConfig
    from h3d.engine.threads import apply_cpu_threads

    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        assert apply_cpu_threads(EngineConfig.build(model="m", cpu_threads=want)) == want
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_omp_wait_policy_is_passive_unless_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from h3d.engine.threads import omp_environment

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")  # so that the test's end restores what was there, or nothing
        monkeypatch.delenv(name)
    omp_environment()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    omp_environment()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # libgomp's own default spin, asked for
    omp_environment()
    assert "OMP_WAIT_POLICY" not in os.environ


def test_bad_cpu_threads_names_the_key() -> None:
    from h3d.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="cpu_threads: must be >= 1"):
        EngineConfig.build(model="m", cpu_threads=-1)
    with pytest.raises(ConfigError, match="cpu_threads: expected an integer"):
        load(None, {"model": "m", "cpu_threads": "4"})
    assert load(None, {"model": "m", "cpu_threads": 3}).engine.cpu_threads == 3


def test_serve_logs_its_cpu_threads(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    with running_daemon(checkpoint("llama_gqa4_tied"), tmp_path / "d", extra=["--cpu-threads", "1"], tcp=False) as d:
        (starting,) = d.events("starting")
        assert starting["cpu_threads"] == 1
        (sized,) = d.events("tiers_sized")  # every `auto` key (the defaults) at the CPU's figure
        assert (sized["hbm_mb"], sized["ddr_mb"], sized["prefill_chunk_tokens"]) == (1024.0, 4096.0, 512)
        assert sized["auto"] == ["hbm_mb", "ddr_mb", "prefill_chunk_tokens"]
        assert sized["ddr_slots"] == 4096 * 2**20 // (2 * 32 * 2 * 16 * 4)  # llama_gqa4_tied: 8 KiB slots
        # Compiled kernels kept under the data folder (0700), and the time to ready.
        cache = tmp_path / "d" / "triton-cache"
        assert starting["triton_cache_dir"] == str(cache) and cache.is_dir() and cache.stat().st_mode & 0o777 == 0o700
        (listening,) = d.events("listening")
        assert 0 < listening["ready_s"] < 120


def test_serve_keeps_the_environments_triton_cache(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    mine = tmp_path / "kernels"
    with running_daemon(
        checkpoint("llama_gqa4_tied"), tmp_path / "d", tcp=False, env={"TRITON_CACHE_DIR": str(mine)}
    ) as d:
        (starting,) = d.events("starting")
        assert starting["triton_cache_dir"] == str(mine) and not (tmp_path / "d" / "triton-cache").exists()


def test_auto_keys_take_auto_or_a_number_in_toml_and_flags(tmp_path: Path) -> None:
    """`hbm_mb`, `ddr_mb` and `prefill_chunk_tokens` default to `auto` and take it, or a number,
    in h3d.toml and as flags."""
    from h3d.cli import build_parser

    assert load(None, {"model": "m"}).engine.hbm_mb == "auto"
    cfg = load(_toml(tmp_path, 'model = "m"\nhbm_mb = 3072\nddr_mb = "auto"\nprefill_chunk_tokens = 8192\n'), {})
    assert (cfg.engine.hbm_mb, cfg.engine.ddr_mb, cfg.engine.prefill_chunk_tokens) == (3072, "auto", 8192)
    args = build_parser().parse_args(["serve", "--model", "m", "--hbm-mb", "auto", "--ddr-mb", "2048.5"])
    assert (args.hbm_mb, args.ddr_mb) == ("auto", 2048.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--prefill-chunk-tokens", "lots"])


def test_cli_imports_no_torch_before_the_configuration() -> None:
    """OMP_NUM_THREADS and OMP_WAIT_POLICY count only if set before torch loads libgomp."""
    code = "import sys, h3d.cli, h3d.keys; assert 'torch' not in sys.modules, 'h3d.cli imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_generate_applies_and_reports_its_cpu_threads(checkpoint: Callable[[str], Path]) -> None:
    code = (
        "import json, os, sys\n"
        "from h3d.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "import torch\n"
        "print(json.dumps({'torch': torch.get_num_threads(), 'omp': os.environ.get('OMP_NUM_THREADS'),"
        " 'wait': os.environ.get('OMP_WAIT_POLICY')}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    args = ["generate", "--model", str(checkpoint("llama_gqa4_tied")), "--prompt", "hello", "--max-tokens", "2"]
    out = subprocess.run(
        [sys.executable, "-c", code, *args, "--json", "--cpu-threads", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    )  # fmt: skip
    result, after = (json.loads(line) for line in out.stdout.splitlines()[-2:])
    assert result["stats"]["cpu_threads"] == 1
    assert after == {"torch": 1, "omp": "1", "wait": "PASSIVE"}
