"""Plain-text tables for the terminal (no dependency: the CLI must start fast)."""

from __future__ import annotations

from collections.abc import Sequence


def table(rows: Sequence[Sequence[object]], header: bool = True) -> str:
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    if not cells:
        return ""
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(len(r) for r in cells))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
        if header and n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def gib(num_bytes: int | float | None, digits: int = 1) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**30:.{digits}f} GiB"


def human(n: float) -> str:
    """Bytes in the largest unit below 1024 of it: 512 B, 1.5 KiB, 18.8 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
