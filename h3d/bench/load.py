"""Load test of the daemon over loopback: many clients, streaming Generate, latency and leaks.

    python -m h3d.bench.load --model DIR [--tiny] [--clients 64] [--requests 20] [--max-tokens 16]
        [--api grpc|http|both] [--time-limit-s 900] [--write docs/BENCHMARKS.md] [--json FILE]

Starts `h3d serve` on a temporary data dir (Unix socket), runs a warm-up round, reads the daemon's
RSS, then `--clients` concurrent clients (one grpc.aio channel and session each) send
`--requests` Generate calls each: a short fresh prompt, then `--max-tokens` greedy tokens
(ignore_eos). Client-side it records time to first token (call start to first delta) and the
time between deltas. RSS is read again after the run (and after a settle pause).

The same work is then run in-process on an `Engine` of the daemon's own configuration (its
GetConfig, `auto` keys as it resolved them, with an archive and token logs of its own, so that it
does the same durable writes: a token log per session, the KV parked on close): every client's
requests in flight together, one step loop. `grpc overhead per token` is the difference of the
wall times per generated token, daemon minus engine, measured side by side in this one run.
Both sides count their engine steps (the daemon's GetStats `steps_total`): tokens per step is how
full the steps were, wall per step what each cost.
`--api http` runs the same load through the daemon's OpenAI API instead (`--http-listen`): each
client (one aiohttp session) sends streaming `POST /v1/completions` requests (the same prompts,
`ignore_eos`), each on a session the daemon makes and deletes for it. `--api both` runs the gRPC
round, then the HTTP round, on one daemon, against one in-process baseline: the two paths' per
token overheads side by side, and their ratio.
`--tiny` runs on the first two layers of the model (same tokenizer and widths), which makes the
model cheap so that the daemon's own cost shows. Loopback only; the clients share the host's
cores with the daemon, so the figures are upper bounds on the daemon's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h3d.bench.report import write_section
from h3d.bench.serve import engine_config
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams

PROMPTS = [
    "Summarize why the key-value cache of a transformer grows with the length of the conversation.",
    "List three ways to keep a long context on a small accelerator.",
    "Explain paged attention to a new engineer in a few sentences.",
    "What is the difference between host memory and device memory for inference?",
]


def tiny_model(src: Path, out: Path, layers: int = 2) -> Path:
    """The first `layers` layers of `src` (config, weights, tokenizer files) in `out`."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(src / "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"))
    return out


def daemon_config(sock: str) -> dict[str, object]:
    """The daemon's configuration as GetConfig reports it (its `auto` keys resolved)."""
    import grpc

    from h3d._proto.h3.v1 import h3_pb2 as pb
    from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return dict(json.loads(rpc.H3AdminStub(ch).GetConfig(pb.GetConfigRequest()).json))


def daemon_steps(sock: str) -> int:
    """The daemon's engine steps since start (GetStats `throughput.steps_total`)."""
    import grpc

    from h3d._proto.h3.v1 import h3_pb2 as pb
    from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

    with grpc.insecure_channel(f"unix:{sock}") as ch:
        return int(rpc.H3Stub(ch).GetStats(pb.GetStatsRequest()).throughput.steps_total)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _client(sock: str, n: int, idx: int, max_tokens: int, ttft: list[float], gaps: list[float]) -> int:
    import grpc

    from h3d._proto.h3.v1 import h3_pb2 as pb
    from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

    tokens = 0
    async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
        stub = rpc.H3Stub(ch)
        for r in range(n):
            session = await stub.CreateSession(pb.CreateSessionRequest())
            prompt = f"{PROMPTS[(idx + r) % len(PROMPTS)]} (client {idx}, request {r})"
            sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            t0 = last = time.perf_counter()
            first = True
            async for msg in stub.Generate(
                pb.GenerateRequest(session_id=session.session_id, prompt=prompt, sampling=sampling)
            ):
                if msg.HasField("delta"):
                    now = time.perf_counter()
                    (ttft if first else gaps).append(now - (t0 if first else last))
                    first, last = False, now
                    tokens += len(msg.delta.token_ids)
            await stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))
    return tokens


async def _http_client(
    url: str, model: str, n: int, idx: int, max_tokens: int, ttft: list[float], gaps: list[float]
) -> int:
    """A client of the OpenAI API: streaming completions, one after another (one HTTP session)."""
    import aiohttp

    tokens = 0
    async with aiohttp.ClientSession() as http:
        for r in range(n):
            prompt = f"{PROMPTS[(idx + r) % len(PROMPTS)]} (client {idx}, request {r})"
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            t0 = last = time.perf_counter()
            first = True
            async with http.post(f"{url}/completions", json=body) as resp:
                if resp.status != 200:
                    raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                        now = time.perf_counter()
                        (ttft if first else gaps).append(now - (t0 if first else last))
                        first, last = False, now
                    elif chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
    return tokens


@dataclass(frozen=True)
class Target:
    """Where the clients go: the daemon's socket (gRPC) or its OpenAI API (`url`, `model`)."""

    api: str
    sock: str
    url: str = ""
    model: str = ""


async def _round(
    target: Target, clients: int, requests: int, max_tokens: int
) -> tuple[float, int, list[float], list[float]]:
    ttft: list[float] = []
    gaps: list[float] = []
    t0 = time.perf_counter()
    if target.api == "grpc":
        runs = [_client(target.sock, requests, i, max_tokens, ttft, gaps) for i in range(clients)]
    else:
        runs = [_http_client(target.url, target.model, requests, i, max_tokens, ttft, gaps) for i in range(clients)]
    counts = await asyncio.gather(*runs)
    return time.perf_counter() - t0, sum(counts), ttft, gaps


def in_process(config: EngineConfig, clients: int, requests: int, max_tokens: int) -> tuple[float, int, int]:
    """The same requests through an Engine in this process, every client's requests in flight
    together as in the daemon: wall seconds, tokens generated and engine steps."""
    engine = Engine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _batches(engine, clients, 2, params)  # warm-up, as the daemon had
    steps = engine.counters.steps
    t0 = time.perf_counter()
    tokens = _batches(engine, clients, requests, params)
    wall = time.perf_counter() - t0
    steps = engine.counters.steps - steps
    engine.close()
    return wall, tokens, steps


def _batches(engine: Engine, clients: int, requests: int, params: SamplingParams) -> int:
    """Each client as the daemon's: open a session, append its prompt, generate, close; next."""
    from h3d.engine.session import AppendDone, GenerationDone, TokenDelta

    owner: dict[int, int] = {}  # request id -> client
    done = [0] * clients
    sessions = [engine.create_session() for _ in range(clients)]

    def start(i: int) -> None:
        text = f"{PROMPTS[(i + done[i]) % len(PROMPTS)]} (client {i}, request {done[i]})"
        owner[engine.submit(sessions[i], text=text, generate=False)] = i

    for i in range(clients):
        start(i)
    tokens = 0
    while engine.has_work:
        for event in engine.step():
            i = owner.pop(event.request_id, -1)
            if isinstance(event, TokenDelta):
                tokens += 1
                owner[event.request_id] = i
            elif isinstance(event, AppendDone):
                owner[engine.submit(sessions[i], generate=True, params=params)] = i
            elif isinstance(event, GenerationDone):
                engine.close_session(sessions[i])
                done[i] += 1
                if done[i] < requests:
                    sessions[i] = engine.create_session()
                    start(i)
            elif i >= 0:
                owner[event.request_id] = i
    return tokens


@dataclass
class Measured:
    """One API's round against the daemon."""

    api: str
    wall: float
    tokens: int
    ttft: list[float]
    gaps: list[float]
    steps: int
    cpu_daemon: float
    cpu_client: float


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> tuple[str, dict[str, object]]:
    model = Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="h3d-load-"))
    if args.tiny:
        model = tiny_model(model, work / "tiny")
    sock = str(work / "h3d.sock")
    apis = ["grpc", "http"] if args.api == "both" else [args.api]
    port = free_port()
    cmd = [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(work / "data"),
           "--socket", sock, "--log-level", "warning", "--max-pending-requests", str(4 * args.clients)]  # fmt: skip
    if "http" in apis:
        cmd += ["--http-listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    runs: list[Measured] = []
    try:
        deadline = time.monotonic() + 300
        while not Path(sock).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"h3d serve did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.2)
        time.sleep(0.5)
        config = engine_config(daemon_config(sock), work / "inproc")
        rss_warm = 0.0
        for api in apis:
            target = Target(api, sock, f"http://127.0.0.1:{port}/v1", model.name)
            asyncio.run(_round(target, args.clients, 2, args.max_tokens))  # warm-up
            rss_warm = rss_warm or rss_mb(proc.pid)
            cpu_daemon0, cpu_client0 = cpu_s(proc.pid), time.process_time()
            steps0 = daemon_steps(sock)
            print(f"{api}: warm-up done, daemon RSS {rss_mb(proc.pid):.0f} MiB; running {args.clients} x "
                  f"{args.requests}", flush=True)  # fmt: skip
            wall, tokens, ttft, gaps = asyncio.run(
                asyncio.wait_for(_round(target, args.clients, args.requests, args.max_tokens), args.time_limit_s)
            )
            cpu_daemon, cpu_client = cpu_s(proc.pid) - cpu_daemon0, time.process_time() - cpu_client0
            runs.append(Measured(api, wall, tokens, ttft, gaps, daemon_steps(sock) - steps0, cpu_daemon, cpu_client))
        time.sleep(2)
        rss_after = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    print(f"daemon exited {code}; in-process baseline ...", flush=True)
    base_wall, base_tokens, base_steps = in_process(config, args.clients, args.requests, args.max_tokens)
    shutil.rmtree(work, ignore_errors=True)
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3)  # noqa: E731
    base_ms = base_wall / base_tokens * 1e3
    rows: list[tuple[str, str]] = [
        ("requests per API (clients x requests)", f"{args.clients} x {args.requests} = {args.clients * args.requests}"),
        ("wall per token, in-process engine (ms)", f"{base_ms:.3f}"),
        ("engine steps, in-process / tokens per step", f"{base_steps} / {base_tokens / base_steps:.1f}"),
    ]
    figures: dict[str, object] = {
        "date": dt.date.today().isoformat(),
        "model": "tiny (first 2 layers of the embedded model)" if args.tiny else Path(args.model).name,
        "clients": args.clients,
        "requests": args.clients * args.requests,
        "max_tokens": args.max_tokens,
        "inprocess_ms_per_token": round(base_ms, 4),
        "inprocess_tokens_per_s": round(base_tokens / base_wall, 2),
        "inprocess_steps": base_steps,
        "rss_mb_warm": round(rss_warm),
        "rss_mb_after": round(rss_after),
    }
    overhead: dict[str, float] = {}
    for m in runs:
        name = "gRPC" if m.api == "grpc" else "HTTP (OpenAI API)"
        per = m.wall / m.tokens * 1e3
        overhead[m.api] = per - base_ms
        rows += [
            (f"{name}: tokens generated (daemon / in-process)", f"{m.tokens} / {base_tokens}"),
            (f"{name}: time to first token p50 / p99 (ms)", f"{ms(m.ttft, 50):.1f} / {ms(m.ttft, 99):.1f}"),
            (f"{name}: inter-token latency p50 / p99 (ms)", f"{ms(m.gaps, 50):.1f} / {ms(m.gaps, 99):.1f}"),
            (f"{name}: wall per token, daemon (ms)", f"{per:.3f}"),
            (f"{name}: overhead per token, daemon - in-process (ms)", f"{overhead[m.api]:.3f}"),
            (f"{name}: engine steps / tokens per step", f"{m.steps} / {m.tokens / m.steps:.1f}"),
            (f"{name}: throughput (tokens/s)", f"{m.tokens / m.wall:.1f}"),
            (f"{name}: CPU seconds, daemon / clients (wall s)",
             f"{m.cpu_daemon:.0f} / {m.cpu_client:.0f} ({m.wall:.0f})"),
        ]  # fmt: skip
        prefix = "" if m.api == "grpc" else "http_"
        figures |= {
            f"{prefix}tokens": m.tokens,
            f"{prefix}daemon_ms_per_token": round(per, 4),
            f"{prefix}overhead_ms_per_token": round(overhead[m.api], 4),
            f"{prefix}daemon_tokens_per_s": round(m.tokens / m.wall, 2),
            f"{prefix}daemon_steps": m.steps,
            f"{prefix}ttft_ms_p50": round(ms(m.ttft, 50), 2),
            f"{prefix}ttft_ms_p99": round(ms(m.ttft, 99), 2),
            f"{prefix}itl_ms_p50": round(ms(m.gaps, 50), 2),
            f"{prefix}itl_ms_p99": round(ms(m.gaps, 99), 2),
            f"{prefix}daemon_cpu_s": round(m.cpu_daemon, 1),
            f"{prefix}client_cpu_s": round(m.cpu_client, 1),
        }
    if len(overhead) == 2:
        ratio = overhead["http"] / overhead["grpc"] if overhead["grpc"] > 0 else float("nan")
        rows.append(("HTTP overhead / gRPC overhead per token", f"{ratio:.2f}"))
        figures["http_over_grpc_overhead"] = round(ratio, 3)
    rows.append(("daemon RSS after warm-up / after the run (MiB)",
                 f"{rss_warm:.0f} / {rss_after:.0f} ({(rss_after / rss_warm - 1) * 100:+.1f} %)"))  # fmt: skip
    table = "\n".join(["| figure | value |", "|---|---:|", *[f"| {k} | {v} |" for k, v in rows]])
    return table, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tiny", action="store_true", help="use the model's first two layers only")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--api", choices=("grpc", "http", "both"), default="grpc",
        help="the clients' API: gRPC Generate, the OpenAI API's streaming completions, or both side by side",
    )  # fmt: skip
    parser.add_argument("--time-limit-s", type=float, default=900)
    parser.add_argument("--write", default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file as well")
    args = parser.parse_args()
    table, figures = run(args)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if args.write:
        name = "tiny (first 2 layers of the embedded model)" if args.tiny else "embedded model (SmolLM2-135M, fp32)"
        meta = (
            f"Measured {dt.date.today().isoformat()} on the 2-core CPU host (clients and daemon share it), {name}, "
            f"{os.cpu_count()} CPUs.\n\nCommand: `python -m h3d.bench.load --model MODEL{' --tiny' * args.tiny} "
            f"--clients {args.clients} --requests {args.requests} --max-tokens {args.max_tokens} --api {args.api}`"
        )
        marker = ("load-tiny" if args.tiny else "load") + ("-http" if args.api != "grpc" else "")
        write_section(Path(args.write), f"{meta}\n\n{table}", marker)


if __name__ == "__main__":
    main()
