"""Where benchmarks put their figures: a marked section of a markdown file (docs/BENCHMARKS.md).

Imports nothing beyond the standard library, so that every bench (the GPU one on a host with
torch alone too) can use it.
"""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, section: str, mark: str) -> None:
    """Replace the text between `<!-- mark:start -->` and `<!-- mark:end -->` (or append it)."""
    start, end = f"<!-- {mark}:start -->", f"<!-- {mark}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{section}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
