"""A job slot's rank processes as the slot sees them: each one's log, collective record and
stack dump (see ``job_slot.py``)."""

from __future__ import annotations

import dataclasses
import os
from multiprocessing.connection import Connection
from typing import Any

from fsdp_testing._report import collective_log

__all__ = ["RankChild", "split_dump"]

_THIS_FILE = os.path.join("fsdp_testing", "_launch", "job_slot.py")
"""Frames in this file belong to the slot the rank was forked from, not to the rank."""


@dataclasses.dataclass
class RankChild:
    """A rank process a slot forked for one world, and where its log and collective record are."""

    gen: int
    pid: int
    conn: Connection | None
    gen_dir: str
    rank: int
    offset: int = 0
    """Size of the rank's log when its current task started."""
    reset_pending: bool = False
    """It ran a task and will say whether it reset itself (:class:`RankReset`)."""

    def read_log(self, limit: int = 20000) -> str:
        try:
            with open(os.path.join(self.gen_dir, f"rank{self.rank}.log"), "rb") as f:
                f.seek(self.offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text if len(text) <= limit else "...\n" + text[-limit:]

    def log_size(self) -> int:
        try:
            return os.path.getsize(os.path.join(self.gen_dir, f"rank{self.rank}.log"))
        except OSError:
            return 0

    def records(self) -> list[dict[str, Any]]:
        return collective_log.read_record_file(
            os.path.join(self.gen_dir, f"rank{self.rank}.flight")
        )[0]


def split_dump(log: str) -> tuple[str, str]:
    """A straggler's log: (what it printed, its SIGUSR1 stack dump) without the frames it
    inherited from its slot, which forked it deep inside pytest's own ``main``."""
    output, stack = log, ""
    for marker in ("Thread 0x", "Current thread 0x"):
        at = log.find(marker)
        if at >= 0:
            output, stack = log[:at], log[at:]
            break
    kept: list[str] = []
    forked = False
    for line in stack.splitlines():
        if not line.startswith(" "):
            forked = False  # a thread's heading: its frames follow, innermost first
        elif _THIS_FILE in line:
            forked = True
        if not forked:
            kept.append(line)
    return output, "\n".join(kept)
