"""Real English text for benchmarks, from files every Debian/Python host carries.

The licence texts under /usr/share/common-licenses and CPython's own LICENSE are long, varied
prose, on disk on every machine this project runs on (no download). Deterministic order.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

_SOURCES = (
    *sorted(Path("/usr/share/common-licenses").glob("*")),
    Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
)


def corpus() -> str:
    """All available source texts, concatenated (about 300 KB on a Debian host)."""
    parts = []
    for path in _SOURCES:
        if path.is_file():
            try:
                parts.append(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError):
                continue
    if not parts:
        raise RuntimeError("no benchmark text found under /usr/share/common-licenses")
    return "\n\n".join(parts)
