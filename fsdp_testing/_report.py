"""Turning what every rank did into one test outcome and a report a person can act on.

Rules: a test passes only when every rank passes. A failure names the rank(s) that caused it
(a rank whose body raised, or whose process died) with their tracebacks under ``[rank N]``;
peers that were stopped or whose collectives broke because of it are listed as aborted. A skip
on the ranks (with no failure) is a skip with the rank's reason.
"""

from __future__ import annotations

import dataclasses

from fsdp_testing._flight import describe_divergence, format_records
from fsdp_testing._task import Outcome, RankResult

__all__ = ["Observation", "Verdict", "judge", "trim_stack"]


@dataclasses.dataclass
class Observation:
    """Everything the launcher saw of one distributed task."""

    world_size: int
    timeout: float
    results: dict[int, RankResult] = dataclasses.field(default_factory=dict)
    dead: set[int] = dataclasses.field(default_factory=set)
    """Ranks whose process ended without sending a result."""
    stragglers: set[int] = dataclasses.field(default_factory=set)
    """Ranks still running when the parent gave up on them (timeout or failed peer)."""
    timed_out: bool = False
    exit_status: dict[int, str] = dataclasses.field(default_factory=dict)
    stacks: dict[int, str] = dataclasses.field(default_factory=dict)
    records: dict[int, list[dict]] = dataclasses.field(default_factory=dict)
    last_output: dict[int, str] = dataclasses.field(default_factory=dict)
    unstoppable: set[int] = dataclasses.field(default_factory=set)
    """Thread ranks that could not be stopped (blocked outside Python)."""


@dataclasses.dataclass
class Verdict:
    """The outcome pytest reports for the test."""

    outcome: str
    """``passed``, ``failed``, ``skipped`` or ``xfailed``."""
    message: str = ""
    """The failure report, or the skip/xfail reason."""
    sections: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Extra report sections: each rank's captured output."""


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


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def judge(obs: Observation) -> Verdict:
    """Decide the test's outcome from ``obs``."""
    sections = [
        (f"output [rank {r}]", res.stdout) for r, res in sorted(obs.results.items()) if res.stdout
    ]
    failed = {r: res for r, res in obs.results.items() if res.outcome is Outcome.FAILED}
    if obs.timed_out:
        return Verdict("failed", _timeout_report(obs), sections)
    if failed or obs.dead:
        return Verdict("failed", _failure_report(obs, failed), sections)
    skipped = [res for _, res in sorted(obs.results.items()) if res.outcome is Outcome.SKIPPED]
    if skipped:
        return Verdict("skipped", skipped[0].message, sections)
    xfailed = [res for _, res in sorted(obs.results.items()) if res.outcome is Outcome.XFAILED]
    if xfailed:
        return Verdict("xfailed", xfailed[0].message, sections)
    return Verdict("passed", "", sections)


def _failure_report(obs: Observation, failed: dict[int, RankResult]) -> str:
    causes = set(obs.dead) | {r for r, res in failed.items() if not res.comm_error}
    if not causes and failed:
        causes = {min(failed, key=lambda r: failed[r].finished_at)}
    aborted = (set(failed) | obs.stragglers) - causes
    parts: list[str] = []
    headline = []
    for rank in sorted(causes):
        if rank in obs.dead:
            headline.append(f"rank {rank} {obs.exit_status.get(rank, 'exited')}")
        else:
            headline.append(f"rank {rank} failed: {failed[rank].summary}")
    text = "; ".join(headline)
    if aborted:
        text += f" ({_ranks(sorted(aborted))} aborted)"
    parts.append(text)
    for rank in sorted(causes):
        if rank in obs.dead:
            out = obs.last_output.get(rank, "").rstrip()
            parts.append(
                f"\n[rank {rank}] {obs.exit_status.get(rank, 'exited')} without reporting a "
                "result; its last output:\n" + (out[-3000:] if out else "(none)")
            )
        else:
            parts.append(f"\n[rank {rank}]\n{failed[rank].message.rstrip()}")
    for rank in sorted(aborted):
        if rank in obs.stragglers:
            where = obs.stacks.get(rank, "").rstrip()
            parts.append(
                f"\n[rank {rank}] aborted: still running after {_ranks(sorted(causes))} failed; "
                "it was stopped. Where it was:\n" + (trim_stack(where) or "(no stack dump)")
            )
        else:
            parts.append(
                f"\n[rank {rank}] aborted: its collective broke because a peer failed: "
                f"{failed[rank].summary}"
            )
    return "\n".join(parts)


def _timeout_report(obs: Observation) -> str:
    running = sorted(obs.stragglers)
    parts = [
        f"timed out after {obs.timeout:g} s: {_ranks(running)} still running "
        f"(of world size {obs.world_size})"
    ]
    if obs.unstoppable:
        parts.append(
            f"{_ranks(sorted(obs.unstoppable))} could not be stopped (blocked outside Python)"
        )
    if obs.records:
        parts.append("\ncollective divergence:")
        parts.extend("  " + line for line in describe_divergence(obs.records))
        parts.append("\nlast collectives per rank:")
        parts.extend(format_records(obs.records))
    for rank in running:
        stack = trim_stack(obs.stacks.get(rank, "(none)")).rstrip()
        parts.append(f"\n[rank {rank}] stack when the timeout hit:\n{stack}")
    for rank, res in sorted(obs.results.items()):
        if res.outcome is Outcome.FAILED:
            parts.append(f"\n[rank {rank}] failed before the timeout:\n{res.message.rstrip()}")
    return "\n".join(parts)
