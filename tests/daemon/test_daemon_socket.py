"""The daemon's Unix socket: a live daemon's socket is never taken, a stale one is, and a daemon
removes only its own socket when it stops."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
from live_daemon import running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb

MODEL = "llama_gqa4_tied"


def serve(model: Path, data_dir: Path, sock: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(data_dir),
           "--socket", str(sock)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_second_daemon_refuses_a_live_socket(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    model = checkpoint(MODEL)
    with running_daemon(model, tmp_path / "one", tcp=False) as first:
        sid = first.h3().CreateSession(pb.CreateSessionRequest()).session_id
        second = serve(model, tmp_path / "two", first.socket)  # another data dir, the same socket
        assert second.returncode == 1, second.stdout + second.stderr
        assert "in use by a running daemon" in second.stdout + second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        # The first daemon still answers on its socket, and knows its session.
        with grpc.insecure_channel(f"unix:{first.socket}") as ch:
            from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

            got = rpc.H3Stub(ch).GetSession(pb.GetSessionRequest(session_id=sid))
            assert got.session_id == sid


def test_a_stale_socket_is_replaced(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    sock = tmp_path / "d" / "h3d.sock"
    sock.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))  # bound, never listening: a connect is refused, as after kill -9
    dead.close()
    assert sock.is_socket()
    with running_daemon(checkpoint(MODEL), tmp_path / "d", tcp=False) as d:
        assert d.h3().CreateSession(pb.CreateSessionRequest()).session_id


def test_a_daemon_removes_only_its_own_socket(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """If the path was taken over while it ran (its socket unlinked and another bound there),
    stopping leaves the other one's socket in place."""
    with running_daemon(checkpoint(MODEL), tmp_path / "d", tcp=False) as d:
        d.socket.unlink()
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(d.socket))
        other.listen(1)
    try:
        assert d.socket.is_socket()
        assert d.events("socket_replaced")
    finally:
        other.close()
    with running_daemon(checkpoint(MODEL), tmp_path / "e", tcp=False) as e:
        pass
    assert not e.socket.exists()  # its own socket: removed
