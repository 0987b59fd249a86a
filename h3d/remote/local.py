"""A redis-server of one's own, for the tests and the benchmarks of the remote tier: a free port on
127.0.0.1, its data in a given folder, every write persisted before it is acknowledged (appendonly
yes, appendfsync always: what `remote_log = sync` asks of a store). Debian's `redis-server`
package provides the binary (`make test` installs it where it is missing). Not used by the daemon.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A redis-server process on a port of its own and `folder`; `start` starts it (again, on the
    same port and folder: what it persisted comes back), `stop` ends it cleanly, `kill` as a crash."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is missing: install Debian's redis-server package (make test does)")
        self.binary, self.folder = binary, folder.resolve()  # (redis-server opens its log after moving into --dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        log = self.folder / "redis.log"
        raise RuntimeError(f"redis-server did not start on port {self.port}: {log.read_text() if log.exists() else ''}")

    def kill(self) -> None:
        """As a crash: SIGKILL, nothing flushed that was not already."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
