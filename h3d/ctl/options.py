"""The argument types and help that several command groups share.

- A type is a `number`: a bad value is an `ArgumentTypeError`, which argparse reports (exit 2); its
  `__name__` is its Python type's (`float`, `int`), as argparse's "invalid <name> value" says it.
- `UINT32_MAX` and `UINT64_MAX` are the ranges of the proto's unsigned fields.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

ID_HELP = "the session's id, or a prefix of it that no other session's id has"

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def number(kind: type, low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], Any]:
    """An argparse type: a `kind` from `low` (excluded if `low_open`) to `high`; NaN refused."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = (value > low if low_open else value >= low) and value <= high and not math.isnan(value)
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and <= {high:g}" if high != math.inf else ""))
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value"
    return parse


positive = number(float, 0.0, low_open=True)
non_negative = number(float, 0.0)
uint32 = number(int, 0, UINT32_MAX)
uint64 = number(int, 0, UINT64_MAX)
