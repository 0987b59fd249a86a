"""The Prometheus endpoint passes `promtool check metrics` (issue 16): every name, type and label.

- In process: `Metrics.render` over a `Stats` with every engine figure set and samples in every
  histogram, checked by promtool; the HBF latency summary is the Stats' microseconds in seconds.
- End to end: a real daemon, scraped over HTTP after a session and a generation (so that the RPC
  counters and the histograms have samples), its `/metrics` checked by promtool.

promtool comes with Debian's `prometheus` package: `make setup` (and so `make test`) installs it
where it is missing. Without it these tests fail, saying so, rather than skip.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from live_daemon import running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.metrics import Metrics

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
T = 120.0  # deadline of every RPC and scrape: generous, the machine may be busy


def promtool_check(text: str) -> None:
    """Assert that `promtool check metrics` accepts `text`: exit 0 and nothing reported."""
    promtool = shutil.which("promtool")
    assert promtool, (
        "promtool not found on PATH: run `make setup` (it installs Debian's `prometheus` package, which "
        "carries /usr/bin/promtool), or `apt-get install --no-install-recommends prometheus`"
    )
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = (check.stdout + check.stderr).strip()
    assert check.returncode == 0 and not problems, (
        f"promtool check metrics exited {check.returncode}:\n{problems}\n--- /metrics ---\n{text}"
    )


def value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} missing from /metrics")


def test_render_passes_promtool() -> None:
    m = Metrics()
    m.rpc("Generate", "OK", 0.3)
    m.rpc("Generate", "CANCELLED", 12.0)
    m.rpc("GetStats", "OK", 0.001)
    m.token(0.2, first=True)
    m.token(0.02, first=False)
    stats = pb.Stats(draining=True, uptime_s=12.5)
    g = getattr(stats, "global")
    for field in g.DESCRIPTOR.fields:  # every engine figure non-zero
        if field.cpp_type == field.CPPTYPE_BOOL:
            setattr(g, field.name, True)
        elif field.cpp_type in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
            setattr(g, field.name, 0.5)
        elif field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64, field.CPPTYPE_INT32, field.CPPTYPE_UINT32):
            setattr(g, field.name, 7)
        elif field.cpp_type == field.CPPTYPE_STRING:
            setattr(g, field.name, "disk full")
    g.hbf_latency_us_p50, g.hbf_latency_us_p99 = 125.0, 2500.0
    stats.throughput.tokens_per_s = 42.0
    stats.throughput.generated_tokens_total = 100
    stats.graphs.captures_after_ready, stats.graphs.captures_ahead = 5, 3
    text = m.render(stats, in_flight=2)

    promtool_check(text)
    assert value(text, 'h3d_hbf_latency_seconds{quantile="0.5"}') == 125e-6
    assert value(text, 'h3d_hbf_latency_seconds{quantile="0.99"}') == 2500e-6
    assert "# TYPE h3d_hbf_latency_seconds summary" in text and "h3d_hbf_latency_us" not in text
    assert value(text, 'h3d_rpc_duration_seconds_count{api="grpc",method="Generate"}') == 2
    assert value(text, "h3d_ttft_seconds_count") == 1
    assert value(text, "h3d_graph_captures_after_ready_total") == 5
    assert value(text, "h3d_graph_captures_ahead_total") == 3


def test_daemon_metrics_pass_promtool(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    model = checkpoint("llama_gqa4_tied")
    with running_daemon(model, tmp_path / "d", extra=["--metrics-listen", "127.0.0.1:0"], env=ENV) as d:
        (listening,) = d.events("metrics_listening")  # logged before `listening`, which running_daemon waited for
        url = f"http://{listening['address']}/metrics"
        h3 = d.h3()
        sid = h3.CreateSession(pb.CreateSessionRequest(), timeout=T).session_id
        append = pb.AppendContextRequest(session_id=sid, text="The quick brown fox jumps over the lazy dog.")
        assert list(h3.AppendContext(append, timeout=T))[-1].HasField("done")
        sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        msgs = list(h3.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling), timeout=T))
        assert msgs[-1].HasField("done") and msgs[-1].done.completion_tokens == 4

        def scrape() -> str:
            with urllib.request.urlopen(url, timeout=T) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                return str(resp.read().decode())

        # The handler records its RPC after the stream's last message: poll until it shows.
        def recorded() -> str | None:
            text = scrape()
            return text if 'h3d_rpc_total{api="grpc",method="Generate",code="OK"}' in text else None

        text = wait_for(recorded, "the Generate in h3d_rpc_total")

    promtool_check(text)
    assert value(text, "h3d_ttft_seconds_count") >= 1
    assert value(text, "h3d_inter_token_seconds_count") >= 3
    assert value(text, 'h3d_hbf_latency_seconds{quantile="0.99"}') >= 0


def wait_for(pred: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result
