"""Plain-text tables and a progress display that also works without a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["Progress", "format_bytes", "format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, numbers right-aligned, with a rule under the
    header."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def numeric(cell: str) -> bool:
        return bool(cell) and (cell[0].isdigit() or cell[0] in "+-.") and cell != "-"

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if numeric(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def format_bytes(n: int) -> str:
    """Exact bytes with thousands separators (the check compares bytes exactly)."""
    return f"{n:,} B"


class Progress:
    """One line per finished item; on a terminal, also the item in progress (overwritten).

    Args:
        total: number of items.
        stream: where to write (default ``sys.stdout``).
    """

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.done = 0
        self._tty = self.stream.isatty()
        self._started = time.monotonic()

    def _prefix(self) -> str:
        width = len(str(self.total))
        return f"[{self.done + 1:>{width}}/{self.total}]"

    def start(self, label: str) -> None:
        if self._tty:
            self.stream.write(f"\r\033[K{self._prefix()} running  {label}")
            self.stream.flush()

    def finish(self, label: str, status: str, seconds: float, note: str = "") -> None:
        if self._tty:
            self.stream.write("\r\033[K")
        tail = f"  {note}" if note else ""
        self.stream.write(f"{self._prefix()} {status:<11} {seconds:6.2f} s  {label}{tail}\n")
        self.stream.flush()
        self.done += 1

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started
