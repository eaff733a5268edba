"""Plain-text tables for terminal reports (the benchmarks print them).

Text columns are left-aligned and numeric ones right-aligned; missing values
show as '-', and floats keep more decimals the smaller they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def cell(value: Any, digits: int | None = None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan"
        if digits is None:
            digits = 1 if abs(value) >= 1000 else 2 if abs(value) >= 1 else 4
        return f"{value:.{digits}f}"
    return str(value)


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) or r[i] is None for r in rows)
               for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths),
                      *(line(r) for r in cells)])
