"""Run `h3d serve` as a subprocess for tests: a real server on a temporary Unix socket and a TCP port.

    with running_daemon(model_dir, tmp_path, extra=["--hbm-mb", "64"]) as d:
        stub = d.h3()                       # generated stubs over the Unix socket
        d.tcp_address                       # "127.0.0.1:PORT" (port 0 was asked for)
        d.ctl("session", "list")            # h3ctl against this daemon (CompletedProcess)
        d.http_url                          # "http://127.0.0.1:PORT/v1" with extra=["--http-listen", "127.0.0.1:0"]
    # leaving the block sends SIGTERM and asserts the daemon exited 0

The daemon's stdout (JSON log lines) is collected in `d.logs`, parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

START_TIMEOUT_S = 120


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[str]
    socket: Path
    tcp_address: str | None
    data_dir: Path
    http_address: str | None = None  # "127.0.0.1:PORT" with --http-listen
    logs: list[dict[str, Any]] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    _channels: list[grpc.Channel] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        assert self.http_address is not None, "start the daemon with --http-listen"
        return f"http://{self.http_address}/v1"

    def channel(self, tcp: bool = False) -> grpc.Channel:
        target = self.tcp_address if tcp else f"unix:{self.socket}"
        assert target is not None
        ch = grpc.insecure_channel(target)
        self._channels.append(ch)
        return ch

    def h3(self, tcp: bool = False) -> rpc.H3Stub:
        return rpc.H3Stub(self.channel(tcp))

    def admin(self, tcp: bool = False) -> rpc.H3AdminStub:
        return rpc.H3AdminStub(self.channel(tcp))

    def ctl(self, *args: str, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run h3ctl against this daemon's socket; global options may be given in `args` too."""
        cmd = [sys.executable, "-m", "h3d.ctl", "--socket", str(self.socket), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in list(self.logs) if e.get("event") == name]

    def wait_events(self, name: str, count: int = 1, timeout: float = 30) -> list[dict[str, Any]]:
        """`events(name)` once there are `count` of them (the log is read on a thread of its own:
        a line logged just before an RPC's answer may not be read yet), or as many as came."""
        deadline = time.monotonic() + timeout
        while len(got := self.events(name)) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return got

    def close_channels(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait, return the exit code."""
        self.close_channels()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@contextlib.contextmanager
def running_daemon(
    model: Path,
    data_dir: Path,
    extra: list[str] | None = None,
    tcp: bool = True,
    env: dict[str, str] | None = None,
    exit_code: int = 0,
) -> Iterator[RunningDaemon]:
    """`exit_code`: what the daemon must have exited with at the end (-9: the test killed it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    sock = data_dir / "h3d.sock"
    cmd = [
        sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(data_dir),
        "--socket", str(sock), "--stats-interval-s", "1", "--log-level", "debug",
        *(["--listen", "127.0.0.1:0"] if tcp else []), *(extra or []),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}
    )
    d = RunningDaemon(proc=proc, socket=sock, tcp_address=None, data_dir=data_dir)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            d.raw.append(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            d.logs.append(event)
            if event.get("event") == "listening":
                d.tcp_address = event.get("address")
                d.http_address = event.get("http_address")
                ready.set()
        ready.set()  # the process ended

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("h3d serve did not start:\n" + "".join(d.raw))
    if not d.events("listening"):  # (its output ended: it exited, or is exiting)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        raise RuntimeError(f"h3d serve exited with {proc.returncode}:\n" + "".join(d.raw))
    try:
        yield d
    finally:
        code = d.stop()
        assert code == exit_code, f"h3d serve exited with {code}:\n" + "".join(d.raw[-50:])
