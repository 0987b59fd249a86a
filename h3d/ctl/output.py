"""What h3ctl prints: messages as JSON data, `--json`'s one line per object, errors on stderr, and
the small formatters of the human-readable output (sizes, times, tables, redrawn frames).

- `emit_json` writes one single-line JSON object to stdout and flushes it; `report` writes an error
  to stderr as `h3ctl: error: CODE: message`, or `{"error": {"code", "message"}}` with `--json`.
- `to_dict` keeps the proto field names and the fields at their defaults, 64-bit integers as numbers.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from h3d._proto.h3.v1 import h3_pb2 as pb

MIB = 1024 * 1024
CLEAR = "\x1b[H\x1b[2J"


def to_dict(message: Message) -> dict[str, Any]:
    """A message as JSON-ready data: proto field names, fields at their defaults included, 64-bit
    integers as numbers."""
    return json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t > 0 else "-"


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def finish_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


class Frames:
    """Successive views on stdout: redrawn in place on a terminal, else separated by a blank line."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.count = 0

    def show(self, text: str) -> None:
        if self.tty:
            sys.stdout.write(CLEAR + text + "\n")
        else:
            sys.stdout.write(("\n" if self.count else "") + text + "\n")
        sys.stdout.flush()
        self.count += 1


def report(code: str, message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False), file=sys.stderr)
    else:
        print(f"h3ctl: error: {code}: {message}", file=sys.stderr)
