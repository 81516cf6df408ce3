"""Process mode, parent side: one generation of rank processes, and what the pool reads from
ranks still running: their collective logs while the test runs (a certain deadlock ends it:
``wait_watch.py``), their stacks and the modules they imported when the deadline comes (see
[Note: importing is not hanging] in ``fsdp_testing/_report/imports.py``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from multiprocessing.connection import Connection

from fsdp_testing._launch.deadline import Deadline
from fsdp_testing._launch.rank_process import IMPORTS_SIGNAL, STACK_SIGNAL, imports_file
from fsdp_testing._report import collective_log
from fsdp_testing._report.imports import IMPORT_GRACE_S, IMPORT_LIMIT_S

__all__ = [
    "STACK_DUMP_WAIT_S",
    "Generation",
    "ImportWait",
    "dump_stacks",
    "imports_of",
    "read_logs",
]

STACK_DUMP_WAIT_S = 0.3
"""How long faulthandler gets to write a rank's stack after the signal."""


@dataclasses.dataclass
class Generation:
    world_size: int
    backend: str
    gen_dir: str
    conns: list[Connection]
    pids: list[int]
    pg_timeout_s: float

    def log_path(self, rank: int) -> str:
        return os.path.join(self.gen_dir, f"rank{rank}.log")

    def log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.log_path(rank))
        except OSError:
            return 0

    def read_log(self, rank: int, offset: int, limit: int = 20000, end: int | None = None) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(offset)
                data = f.read() if end is None else f.read(max(0, end - offset))
        except OSError:
            return ""
        text = data.decode(errors="replace")
        return text if len(text) <= limit else "...\n" + text[-limit:]


def read_logs(
    gen: Generation,
) -> tuple[dict[int, list[dict]], dict[int, dict[str, int] | None]]:
    records: dict[int, list[dict]] = {}
    channels: dict[int, dict[str, int] | None] = {}
    for rank in range(gen.world_size):
        path = os.path.join(gen.gen_dir, f"rank{rank}.flight")
        records[rank], channels[rank] = collective_log.read_record_file(path)
    return records, channels


def dump_stacks(
    gen: Generation, ranks: list[int], *, imports_too: bool
) -> dict[int, tuple[int, str]]:
    """Each rank's stack dump (faulthandler's, on ``STACK_SIGNAL``) and the log size before it;
    ``imports_too``: also ask each rank to write the modules it imported."""
    sizes = {r: gen.log_size(r) for r in ranks}
    for rank in ranks:
        for sig in (STACK_SIGNAL, IMPORTS_SIGNAL) if imports_too else (STACK_SIGNAL,):
            try:
                os.kill(gen.pids[rank], sig)
            except OSError:
                pass
    time.sleep(STACK_DUMP_WAIT_S)
    return {r: (sizes[r], gen.read_log(r, sizes[r])) for r in ranks}


def imports_of(gen: Generation, ranks: set[int]) -> list[str]:
    names: list[str] = []
    for rank in sorted(ranks):
        try:
            with open(imports_file(gen.gen_dir, rank)) as f:
                names.extend(line.strip() for line in f if line.strip())
        except OSError:
            continue
    return names


class ImportWait:
    """The extra time a test's deadline got because ranks were importing (see [Note: importing
    is not hanging]): ``IMPORT_GRACE_S`` at a time while some rank's import moves on, up to
    ``IMPORT_LIMIT_S``."""

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline
        self.extended = 0.0
        self.first_dump: dict[int, int] = {}
        """Each rank's log size before its first dump (its output ends there)."""
        self._last: dict[int, object] = {}

    def budget(self) -> bool:
        return self.extended < IMPORT_LIMIT_S

    def extend(self, stacks: dict[int, str]) -> bool:
        now = {r: _importing_now(text) for r, text in stacks.items()}
        moving = any(imp is not None and imp != self._last.get(r) for r, imp in now.items())
        self._last = dict(now)
        if not moving:
            return False
        grace = min(IMPORT_GRACE_S, IMPORT_LIMIT_S - self.extended)
        self._deadline.extend(grace)
        self.extended += grace
        return True


def _importing_now(stack: str) -> object:
    """What the rank's main stack imports, to compare two looks (None: no import)."""
    from fsdp_testing._report.hang_report import importing_in

    found = importing_in(stack)
    return None if found is None else (found.module, found.now, stack.count("\n"))
