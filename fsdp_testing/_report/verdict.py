"""Turning what every rank did into one test outcome and a report a person can act on.

Rules: a test passes only when every rank passes. A failure names the rank(s) that caused it
(a rank whose body raised, or whose process died) with their tracebacks under ``[rank N]``;
peers that were stopped or whose collectives broke because of it are listed as aborted. A skip
on the ranks (with no failure) is a skip with the rank's reason.
"""

from __future__ import annotations

import dataclasses
import enum

from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.divergence import injected_faults
from fsdp_testing._report.hang_report import timeout_report, trim_stack
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.text import rank_heading, rank_label, ranks_phrase

__all__ = ["Observation", "Verdict", "VerdictOutcome", "judge"]


class VerdictOutcome(str, enum.Enum):
    """The outcome of a whole test (a ``str`` enum: compares equal to pytest's words)."""

    PASSED = "passed"
    """Every rank passed."""
    FAILED = "failed"
    """A rank failed or died, or the test timed out."""
    SKIPPED = "skipped"
    """No rank failed and at least one skipped (a skip on some ranks skips the test)."""
    XFAILED = "xfailed"
    """No rank failed or skipped and at least one called ``pytest.xfail``."""

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class Verdict:
    """The outcome pytest reports for the test."""

    outcome: VerdictOutcome
    message: str = ""
    """The failure report, or the skip/xfail reason."""
    sections: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """Extra report sections: each rank's captured output."""


def judge(obs: Observation) -> Verdict:
    """Decide the test's outcome from ``obs``."""
    sections = [
        (f"output {rank_heading(r, obs.where)}", res.stdout)
        for r, res in sorted(obs.results.items())
        if res.stdout
    ]
    failed = {r: res for r, res in obs.results.items() if res.outcome is Outcome.FAILED}
    if obs.timed_out:
        return Verdict(VerdictOutcome.FAILED, timeout_report(obs), sections)
    if failed or obs.dead:
        return Verdict(VerdictOutcome.FAILED, _failure_report(obs, failed), sections)
    skipped = [res for _, res in sorted(obs.results.items()) if res.outcome is Outcome.SKIPPED]
    if skipped:
        return Verdict(VerdictOutcome.SKIPPED, skipped[0].message, sections)
    xfailed = [res for _, res in sorted(obs.results.items()) if res.outcome is Outcome.XFAILED]
    if xfailed:
        return Verdict(VerdictOutcome.XFAILED, xfailed[0].message, sections)
    return Verdict(VerdictOutcome.PASSED, "", sections)


#: How much of a dead rank's output the report shows, and of faulthandler's dump of its threads.
LAST_OUTPUT_CHARS = 3000
FAULT_DUMP_CHARS = 12000
#: Lines of output kept before faulthandler's dump: what a native crash printed first (C++'s
#: "terminate called after throwing ...", gloo's enforce message).
LINES_BEFORE_DUMP = 10
_FAULT = "Fatal Python error:"


def _last_words(out: str) -> str:
    """The end of a dead rank's output: from faulthandler's last ``Fatal Python error`` on (its
    dump of every Python thread, up to ``FAULT_DUMP_CHARS``) with the ``LINES_BEFORE_DUMP``
    lines before it, else the last ``LAST_OUTPUT_CHARS``. faulthandler marks the faulting
    thread "Current thread" only when it runs Python; when none is marked, the report says the
    fault was in a native thread."""
    start = out.rfind(_FAULT)
    if start == -1:
        return out[-LAST_OUTPUT_CHARS:]
    before = out[:start].splitlines()[-LINES_BEFORE_DUMP:]
    lead = "\n".join(before)[-LAST_OUTPUT_CHARS:]
    # The faulting thread comes first in the dump.
    tail = (lead + "\n" if lead else "") + out[start : start + FAULT_DUMP_CHARS]
    if "Current thread 0x" not in tail:
        tail += (
            "\n(faulthandler marks no thread as current: the fault was in a thread that runs no "
            "Python, such as a gloo or BLAS worker; the threads above are where Python was)"
        )
    return tail


def _failure_report(obs: Observation, failed: dict[int, RankResult]) -> str:
    causes = set(obs.dead) | {r for r, res in failed.items() if not res.comm_error}
    if not causes and failed:
        causes = {min(failed, key=lambda r: failed[r].finished_at)}
    aborted = (set(failed) | obs.stragglers) - causes
    where = obs.where
    parts: list[str] = []
    headline = []
    faults = injected_faults(obs.records)
    for rank in sorted(causes):
        if rank in obs.dead:
            died = f"{rank_label(rank, where)} {obs.exit_status.get(rank, 'exited')}"
            kills = [f for f in faults.get(rank, ()) if f["fault"] == "kill"]
            if kills:
                died += f" at {kills[-1]['where']} (injected by faults.kill)"
            headline.append(died)
        else:
            headline.append(f"{rank_label(rank, where)} failed: {failed[rank].summary}")
    text = "; ".join(headline)
    if aborted:
        text += f" ({ranks_phrase(sorted(aborted))} aborted)"
    parts.append(text)
    for rank in sorted(causes):
        if rank in obs.dead:
            out = obs.last_output.get(rank, "").rstrip()
            parts.append(
                f"\n{rank_heading(rank, where)} {obs.exit_status.get(rank, 'exited')} without "
                "reporting a result; its last output:\n" + (_last_words(out) or "(none)")
            )
        else:
            parts.append(f"\n{rank_heading(rank, where)}\n{failed[rank].message.rstrip()}")
    for rank in sorted(aborted):
        if rank in obs.stragglers:
            stack = obs.stacks.get(rank, "").rstrip()
            parts.append(
                f"\n{rank_heading(rank, where)} aborted: still running after "
                f"{ranks_phrase(sorted(causes))} failed; it was stopped. Where it was:\n"
                + (trim_stack(stack) or "(no stack dump)")
            )
        else:
            parts.append(
                f"\n{rank_heading(rank, where)} aborted: its collective broke because a peer "
                f"failed: {failed[rank].summary}"
            )
    return "\n".join(parts)
