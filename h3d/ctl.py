"""h3ctl: the operator's command line (talks to the daemon; see its own issue)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("h3ctl: the daemon's control plane is not built yet; use `h3d generate` for one-off runs", file=sys.stderr)
    return 2
