"""How the command line and the benchmarks write to the terminal.

On a terminal: ``rich`` tables with aligned numbers, a live progress bar and colour. Anywhere
else (a pipe, a file, a CI log): plain lines with no control codes, so logs stay greppable and
tests can match them.

[Note: plain output] The layout follows the stream alone: rich output when stdout is a TTY (or
``TTY_COMPATIBLE=1`` says to treat it as one; ``TTY_COMPATIBLE=0`` asks for the plain lines on a
TTY), plain lines otherwise. ``FORCE_COLOR``, which CI systems often set to colour their logs,
does not turn a log into a terminal; ``NO_COLOR`` turns colour off; a dumb terminal
(``TERM=dumb``) gets the plain lines.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TextIO

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

__all__ = [
    "STATUS_STYLES",
    "ProgressDisplay",
    "echo",
    "format_table",
    "is_rich",
    "make_console",
    "new_table",
    "print_table",
]

#: Colours of the check's row statuses (and the benchmarks' verdicts) on a terminal.
STATUS_STYLES = {
    "ok": "green",
    "exact": "green",
    "MISMATCH": "bold red",
    "FAIL": "bold red",
    "DIFFERS": "bold red",
    "differs": "red",
    "ERROR": "bold magenta",
    "unavailable": "yellow",
}


def make_console(
    file: TextIO | None = None, *, width: int | None = None, force_terminal: bool | None = None
) -> Console:
    """A console on ``file`` (default: ``sys.stdout`` as it is when called).

    Args:
        file: the stream (default ``sys.stdout``).
        width: columns (default: the terminal's, or 80).
        force_terminal: treat ``file`` as a terminal, or not (default: see [Note: plain
            output]).
    """
    stream = file if file is not None else sys.stdout
    if force_terminal is None:
        force_terminal = _is_tty(stream)
    return Console(file=stream, width=width, force_terminal=force_terminal, highlight=False)


def _is_tty(stream: TextIO) -> bool:
    override = os.environ.get("TTY_COMPATIBLE", "")
    if override in ("0", "1"):
        return override == "1"
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def is_rich(console: Console) -> bool:
    """Whether ``console`` gets rich output (see [Note: plain output])."""
    return console.is_terminal and not console.is_dumb_terminal


def echo(console: Console, text: str, style: str = "") -> None:
    """One line, never wrapped or interpreted as markup; ``style`` applies on a terminal."""
    if is_rich(console):
        console.print(Text(text, style=style), soft_wrap=True)
    else:
        print(text, file=console.file, flush=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain text: columns padded to their widest cell, numbers right-aligned, a rule under the
    header."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(cells, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "+-.") and cell != "-"


def new_table(
    headers: Sequence[str], *, numeric: Sequence[bool], title: str | None = None
) -> Table:
    """An empty rich table in the house layout: no vertical rules, one space between columns,
    numeric columns right-aligned.

    Args:
        headers: column headers (a ``\\n`` splits one over two lines).
        numeric: per column, whether it holds numbers.
        title: a line above the table (default none).
    """
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        collapse_padding=True,
        title=title,
        title_justify="left",
        title_style="bold",
        header_style="bold",
    )
    for header, is_number in zip(headers, numeric, strict=True):
        table.add_column(header, justify="right" if is_number else "left")
    return table


def print_table(
    console: Console,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
) -> None:
    """``rows`` as a rich table on a terminal, as :func:`format_table` text elsewhere.

    Args:
        console: where to print (see :func:`make_console`).
        headers: column headers.
        rows: the cells, as text; a column is numeric when its cells (other than ``-``) are.
        title: a line above the table (default none).
    """
    if not is_rich(console):
        if title:
            print(title, file=console.file)
        print(format_table(headers, rows), file=console.file)
        return
    numeric = [
        any(_numeric(row[i]) for row in rows) and all(_numeric(r[i]) or r[i] in "-" for r in rows)
        for i in range(len(headers))
    ]
    table = new_table(headers, numeric=numeric, title=title)
    for row in rows:
        table.add_row(*(Text(cell, style=STATUS_STYLES.get(cell, "")) for cell in row))
    console.print(table)


class ProgressDisplay:
    """Progress over a known number of items, as a context manager.

    On a terminal, a live bar with the item in progress, elapsed time and an estimate of what
    is left; finished items that are not ``ok`` are printed above it as they happen. Elsewhere,
    one plain line per finished item: ``[ 3/32] ok            0.16 s  label``.

    Args:
        total: number of items.
        console: where to write (default :func:`make_console`).
    """

    def __init__(self, total: int, console: Console | None = None) -> None:
        self.total = total
        self.console = console if console is not None else make_console()
        self.done = 0
        self._started = time.monotonic()
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressDisplay:
        if is_rich(self.console):
            self._bar = RichProgress(
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.description}", markup=False),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.total)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _prefix(self) -> str:
        width = len(str(self.total))
        return f"[{self.done + 1:>{width}}/{self.total}]"

    def start(self, label: str) -> None:
        """``label`` is now running."""
        if self._bar is not None and self._task is not None:
            # The bar, counts and times take a fixed width; the label gets the rest.
            room = self.console.width - (30 + 2 * len(str(self.total)) + 1 + 7 + 3 + 7 + 5)
            if len(label) > room:
                label = label[: max(room - 1, 0)] + "…"
            self._bar.update(self._task, description=label)

    def finish(self, label: str, status: str, seconds: float, note: str = "") -> None:
        """``label`` ended with ``status`` after ``seconds``; ``note`` says why, if not ok."""
        line = Text(f"{self._prefix()} ")
        line.append(f"{status:<11}", style=STATUS_STYLES.get(status, ""))
        line.append(f" {seconds:6.2f} s  {label}")
        if note:
            line.append(f"  {note}", style="dim")
        if self._bar is not None and self._task is not None:
            if status != "ok":
                self.console.print(line, no_wrap=True, overflow="ellipsis")
            self._bar.advance(self._task)
        else:
            print(line.plain, file=self.console.file, flush=True)
        self.done += 1

    @property
    def elapsed(self) -> float:
        """Seconds since the display was made."""
        return time.monotonic() - self._started
