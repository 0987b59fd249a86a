"""systemd's notify protocol (sd_notify) without libsystemd: one datagram per message to the
socket in $NOTIFY_SOCKET. Without that variable every call does nothing."""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET") or None
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None

    def send(self, **fields: str) -> None:
        """E.g. send(READY="1", STATUS="serving") sends "READY=1\\nSTATUS=serving"."""
        if self.address is None:
            return
        address = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall(message)
        except OSError:
            pass  # the service manager went away: nothing to tell
