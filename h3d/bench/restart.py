"""Restart cost: time to ready and time to first token after a restart, archive vs re-prefill.

    python -m h3d.bench.restart --model DIR [--sessions 1 4] [--tokens 1000 4000] [--write docs/BENCHMARKS.md]

For each (sessions, tokens): start `h3d serve` on a fresh data dir, open the sessions, append
`tokens` tokens of real text to each and generate one token; SIGTERM (the checkpoint writes every
session's KV to the archive). Then two restarts of copies of that data dir:
- **archive**: as it is; each session's KV comes back from the archive when first read;
- **re-prefill**: the archive folder removed, as after a crash before any block was written; the
  token logs rebuild every session by prefill.
Time to ready is from spawning the process to its `listening` event (the model load included);
time to first token is a one-token Generate per session, one after the other. The HBM hit rate
is each session's (GetStats, since that daemon started) after three more 16-token generations,
mean of the sessions: in the first daemon, and after the archive restart (whose blocks come back
through DDR and must return to HBM).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from h3d.bench.report import write_section
from h3d.bench.text import corpus


class Daemon:
    def __init__(self, model: Path, data: Path) -> None:
        self.sock = data / "h3d.sock"
        cmd = [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(data),
               "--socket", str(self.sock), "--log-level", "info"]  # fmt: skip
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.events: list[dict[str, Any]] = []
        self.ready_s = self._until("listening") - self.t0

    def _until(self, name: str) -> float:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.append(event)
            if event.get("event") == name:
                return time.perf_counter()
        raise SystemExit(f"h3d serve ended before {name!r}: {self.events[-3:]}")

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        self._until("stopped")
        self.proc.wait(120)
        return next((e for e in self.events if e.get("event") == "checkpoint"), {})


def _stubs(sock: Path) -> tuple[Any, Any]:
    import grpc

    from h3d._proto.h3.v1 import h3_pb2 as pb
    from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

    return rpc.H3Stub(grpc.insecure_channel(f"unix:{sock}")), pb


def first_tokens(sock: Path, sids: list[str]) -> float:
    """Mean seconds to the first token of a one-token Generate per session."""
    h3, pb = _stubs(sock)
    times = []
    for sid in sids:
        t0 = time.perf_counter()
        for _ in h3.Generate(pb.GenerateRequest(session_id=sid, sampling=pb.SamplingParams(max_tokens=1))):
            times.append(time.perf_counter() - t0)
            break
    return sum(times) / len(times)


def hit_rate(sock: Path, sids: list[str], generations: int = 3) -> float:
    """Mean of the sessions' HBM hit rates (GetStats: since the daemon started) after
    `generations` more 16-token generations each."""
    h3, pb = _stubs(sock)
    for sid in sids:
        for _ in range(generations):
            for _ in h3.Generate(pb.GenerateRequest(session_id=sid, sampling=pb.SamplingParams(max_tokens=16))):
                pass
    stats = h3.GetStats(pb.GetStatsRequest()).sessions
    return sum(s.hbm_hit_rate for s in stats if s.session_id in sids) / len(sids)


def run_one(model: Path, sessions: int, tokens: int, work: Path) -> dict[str, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(corpus()).ids
    data = work / f"s{sessions}-t{tokens}"
    d = Daemon(model, data)
    h3, pb = _stubs(d.sock)
    sids = []
    t0 = time.perf_counter()
    for i in range(sessions):
        sid = h3.CreateSession(pb.CreateSessionRequest()).session_id
        start = (i * 7919) % (len(ids) - tokens)
        for _ in h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=ids[start : start + tokens])):
            pass
        sids.append(sid)
    prefill_s = time.perf_counter() - t0
    first_tokens(d.sock, sids)
    uninterrupted = hit_rate(d.sock, sids)
    checkpoint = d.stop()
    out = {"prefill_s": prefill_s, "checkpoint_s": float(checkpoint.get("seconds", 0.0)), "hit_rate": uninterrupted}
    for name, drop_archive in (("archive", False), ("reprefill", True)):
        copy = work / f"{data.name}-{name}"
        shutil.copytree(data, copy)
        if drop_archive:
            shutil.rmtree(copy / "archive")
        d = Daemon(model, copy)
        out[f"{name}_ready_s"] = d.ready_s
        out[f"{name}_ttft_s"] = first_tokens(d.sock, sids)
        restored = next((e for e in d.events if e.get("event") == "sessions_restored"), {})
        out[f"{name}_rebuild_blocks"] = float(restored.get("kv_rebuild_blocks", 0))
        if not drop_archive:
            out["restarted_hit_rate"] = hit_rate(d.sock, sids)
        d.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="h3d-restart-"))
    lines = [
        "| sessions x tokens | first prefill (s) | checkpoint at SIGTERM (s) | ready: archive / re-prefill (s) "
        "| first token per session: archive / re-prefill (s) | blocks rebuilt: archive / re-prefill "
        "| HBM hit rate, 3 generations: uninterrupted / after the restart |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    try:
        for s in args.sessions:
            for t in args.tokens:
                r = run_one(Path(args.model), s, t, work)
                lines.append(
                    f"| {s} x {t} | {r['prefill_s']:.2f} | {r['checkpoint_s']:.2f} "
                    f"| {r['archive_ready_s']:.2f} / {r['reprefill_ready_s']:.2f} "
                    f"| {r['archive_ttft_s']:.3f} / {r['reprefill_ttft_s']:.3f} "
                    f"| {r['archive_rebuild_blocks']:.0f} / {r['reprefill_rebuild_blocks']:.0f} "
                    f"| {r['hit_rate']:.3f} / {r['restarted_hit_rate']:.3f} |"
                )
                print(lines[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = "\n".join(lines)
    print(table)
    if args.write:
        meta = (
            f"Measured {dt.date.today().isoformat()} on the 2-core CPU host, embedded model (fp32).\n\n"
            f"Command: `python -m h3d.bench.restart --model MODEL --sessions {' '.join(map(str, args.sessions))} "
            f"--tokens {' '.join(map(str, args.tokens))}`"
        )
        write_section(Path(args.write), f"{meta}\n\n{table}", "restart")


if __name__ == "__main__":
    main()
