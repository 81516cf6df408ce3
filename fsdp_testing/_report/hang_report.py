"""Where a hang report is written: a test that hit its timeout is reported with where the ranks'
collectives diverge (on top), each rank's last collectives, and the stack of every rank still
running, with the harness's own frames trimmed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_testing._protocol import Outcome
from fsdp_testing._report.divergence import (
    describe_divergence,
    format_records,
    injected_faults,
)
from fsdp_testing._report.text import rank_heading, ranks_phrase

if TYPE_CHECKING:
    from fsdp_testing._report.verdict import Observation

__all__ = ["timeout_report", "trim_stack"]

_HARNESS_MARKERS = ("/fsdp_testing/_", "<frozen runpy>", "/threading.py")


def trim_stack(text: str) -> str:
    """Drop the harness's own frames (and their source lines) from a stack dump."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.lstrip().startswith("File "):
            skipping = any(m in line for m in _HARNESS_MARKERS)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


def timeout_report(obs: Observation) -> str:
    """The report of a test that hit its timeout: the collective divergence on top, then each
    running rank's stack."""
    running = sorted(obs.stragglers)
    parts = [
        f"timed out after {obs.timeout:g} s: {ranks_phrase(running)} still running "
        f"(of world size {obs.world_size})"
    ]
    for rank, faults in sorted(injected_faults(obs.records).items()):
        for fault in faults:
            if fault["fault"] == "hang":
                parts.append(f"rank {rank} hangs at {fault['where']} (injected by faults.hang)")
    if obs.unstoppable:
        parts.append(
            f"{ranks_phrase(sorted(obs.unstoppable))} could not be stopped (blocked outside Python)"
        )
    if obs.records:
        parts.append("\ncollective divergence:")
        parts.extend("  " + line for line in describe_divergence(obs.records))
        parts.append("\nlast collectives per rank:")
        parts.extend(format_records(obs.records))
    for rank in running:
        stack = trim_stack(obs.stacks.get(rank, "(none)")).rstrip()
        parts.append(f"\n{rank_heading(rank)} stack when the timeout hit:\n{stack}")
    for rank, res in sorted(obs.results.items()):
        if res.outcome is Outcome.FAILED:
            parts.append(
                f"\n{rank_heading(rank)} failed before the timeout:\n{res.message.rstrip()}"
            )
    return "\n".join(parts)
