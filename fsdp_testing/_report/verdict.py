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
from fsdp_testing._report.collective_log import call_name
from fsdp_testing._report.divergence import injected_faults
from fsdp_testing._report.failure import explanation, mask, message_of
from fsdp_testing._report.grouping import group_ranks
from fsdp_testing._report.hang_report import (
    calls_section,
    readable_stack,
    stack_key,
    timeout_report,
)
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.p2p import describe_p2p, dtype_mismatches, unmatched
from fsdp_testing._report.text import rank_label, ranks_heading, ranks_phrase, short_place

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
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the report mentions without failing the test (the plugin warns with each)."""


def judge(obs: Observation) -> Verdict:
    """Decide the test's outcome from ``obs``."""
    verdict = _judge(obs)
    by_note: dict[str, list[int]] = {}
    for rank, res in sorted(obs.results.items()):
        for note in res.notes:
            by_note.setdefault(note, []).append(rank)
    verdict.notes = [f"{ranks_phrase(ranks, obs.where)}: {note}" for note, ranks in by_note.items()]
    # Messages received as another dtype of the same size: gloo allows it, code may mean it.
    verdict.notes += dtype_mismatches(obs.records, obs.where)
    return verdict


def _judge(obs: Observation) -> Verdict:
    printed = {r: res.stdout for r, res in obs.results.items() if res.stdout}
    sections = [
        (f"output {ranks_heading(ranks, obs.where)}", printed[ranks[0]])
        for ranks in group_ranks(printed)
    ]
    _fail_unmet_messages(obs)
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


def _fail_unmet_messages(obs: Observation) -> None:
    """A rank whose body returned with a send or receive that no peer's op will ever meet fails
    (a message to the wrong rank, or a receive nobody sends): gloo would keep it in flight
    until the process ends, and the next test on the same ranks would meet it."""
    for rank, res in sorted(obs.results.items()):
        if res.outcome is not Outcome.PASSED or not res.open_p2p:
            continue
        records = {**obs.records, rank: [*obs.records.get(rank, []), *res.open_p2p]}
        unmet = [e for e in res.open_p2p if unmatched(records, obs.channels, rank, e)]
        if not unmet:
            continue
        lines = []
        for e in unmet:
            peer = rank_label(int(e["peer"]))
            never = "received" if e["family"] == "send" else "sent"
            at = f" (at {short_place(e['at'])})" if e.get("at") else ""
            lines.append(
                f"rank {rank} ended its test with {call_name(e)}{at} never {never}: {peer} "
                f"posted no matching {'receive' if never == 'received' else 'send'}"
            )
        res.outcome = Outcome.FAILED
        res.summary = lines[0] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
        res.message = "\n".join(lines) + (
            "\nA message to the wrong rank, or one nobody receives, is a bug a real run hides "
            "until it hangs: check each peer's arithmetic and that every send has its receive."
        )
        res.finished_at = res.finished_at or 0.0


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


#: The longest first line of a failure report: the distinct errors, each cut to fit.
HEADLINE_CHARS = 300
#: The longest line of a report that the report itself writes (a summary, a message).
LINE_CHARS = 300
#: Ranks that failed at the same place with other messages: how many messages are shown.
VARIANTS_SHOWN = 2


#: The summary of a rank that the harness stopped in a collective (``rank_threads.Aborted``).
_STOPPED = "Aborted: aborted by the harness"


def _cut(text: str, limit: int = LINE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def _variant(result: RankResult, shown: RankResult) -> str:
    """The one line of a rank that failed at the place of ``shown`` with another message; with
    pytest's explanation where the summaries are the same (``assert t.item() == 0, msg`` with
    other values)."""
    text = result.summary
    if text == shown.summary and (why := explanation(result)):
        text += f" ({why})"
    return _cut(text, LINE_CHARS - 2)


def _headline(entries: list[tuple[str, str]], suffix: str) -> str:
    """``who failed: what; who failed: what (suffix)`` within ``HEADLINE_CHARS``: each entry is
    ``(who, what)``; ``what`` is cut to fit, and entries that do not fit are counted."""
    room = HEADLINE_CHARS - len(suffix)
    parts: list[str] = []
    for i, (who, what) in enumerate(entries):
        left = len(entries) - i - 1
        more = f"; {left} more below" if left else ""
        used = len("; ".join(parts)) + (2 if parts else 0)
        space = room - used - len(more) - len(who)
        if space < 40 and parts:
            parts.append(f"{len(entries) - i} more below")
            break
        parts.append(who + _cut(what, max(space, 20)))
    return "; ".join(parts) + suffix


def _who_died(rank_group: list[int], obs: Observation, faults: dict[int, list[dict]]) -> str:
    first = rank_group[0]
    who = ranks_phrase(rank_group, obs.where, of=obs.world_size)
    died = f"{who} {obs.exit_status.get(first, 'exited')}"
    kills = [f for f in faults.get(first, ()) if f["fault"] == "kill"]
    if kills and len(rank_group) == 1:
        died += f" at {kills[-1]['where']} (injected by faults.kill)"
    elif mismatch := _size_mismatch(obs, first):
        died += f": {mismatch}"
    return died


def _last_call(obs: Observation, rank: int) -> str | None:
    """``all_reduce #2 [entered]``: the rank's last recorded call (None: no log)."""
    if rank not in obs.records:
        return None
    entries = [e for e in obs.records[rank] if "fault" not in e]
    if not entries:
        return "no collective"
    e = entries[-1]
    return f"{call_name(e)} [{e['state']}]"


def _size_mismatch(obs: Observation, rank: int) -> str:
    """The size mismatch of a message ``rank`` received or sent, as the point-to-point section
    words it (empty: none): gloo aborts a rank whose receive gets another size."""
    for line in describe_p2p(obs.records, obs.channels, where=obs.where):
        if line.startswith("size mismatch") and f"rank {rank}'s" in line:
            return line
    return ""


def _failure_report(obs: Observation, failed: dict[int, RankResult]) -> str:
    causes = set(obs.dead) | {r for r, res in failed.items() if not res.comm_error}
    if not causes and failed:
        causes = {min(failed, key=lambda r: failed[r].finished_at)}
    aborted = (set(failed) | obs.stragglers) - causes
    where, world = obs.where, obs.world_size
    faults = injected_faults(obs.records)

    dead = sorted(r for r in causes if r in obs.dead)
    dead_keys = {
        r: (obs.exit_status.get(r, "exited"), stack_key(_last_words(obs.last_output.get(r, ""))))
        for r in dead
    }
    dead_groups = group_ranks(dead_keys)
    raised = {r: failed[r] for r in causes if r not in obs.dead}
    error_groups = group_ranks(
        {r: res.fingerprint or mask(res.summary) for r, res in raised.items()},
        {r: res.finished_at for r, res in raised.items()},
    )
    # Errors at the same place (type and frames) with other messages: a family, shown once.
    families: dict[str, list[list[int]]] = {}
    for ranks in error_groups:
        res = raised[ranks[0]]
        families.setdefault(res.place or res.fingerprint or mask(res.summary), []).append(ranks)

    entries = [(_who_died(g, obs, faults), "") for g in dead_groups]
    for groups in families.values():
        ranks = sorted(r for g in groups for r in g)
        what = raised[groups[0][0]].summary
        if len(groups) > 1:
            others = sorted(r for g in groups[1:] for r in g)
            # The same message with other values in pytest's explanation (assert 1 == 5).
            same = all(raised[g[0]].summary == what for g in groups[1:])
            what += f" (other {'values' if same else 'messages'} on {ranks_phrase(others)})"
        entries.append((f"{ranks_phrase(ranks, where, of=world)} failed: ", what))
    suffix = f" ({ranks_phrase(sorted(aborted))} aborted)" if aborted else ""
    parts = [_headline(entries, suffix)]

    for ranks in dead_groups:
        rank = ranks[0]
        out = obs.last_output.get(rank, "").rstrip()
        parts.append(
            f"\n{ranks_heading(ranks, where, of=world)} {obs.exit_status.get(rank, 'exited')} "
            "without reporting a result; "
            + ("its last output" if len(ranks) == 1 else f"the last output of rank {rank}")
            + ":\n"
            + (_last_words(out) or "(none)")
        )
    for groups in families.values():
        first = groups[0]
        shown = min(first, key=lambda r: (raised[r].finished_at, r))
        heading = ranks_heading(first, where, of=world)
        if len(first) > 1:
            heading += f" the same error; the traceback of rank {shown}, the first to fail:"
        parts.append(f"\n{heading}\n{message_of(raised[shown]).rstrip()}")
        # One message more (one rank, or ranks failing alike) is shown as the others are; more
        # than one are summed up by an example.
        shown_count = VARIANTS_SHOWN + (len(groups) == 2 + VARIANTS_SHOWN)
        variants = groups[1 : 1 + shown_count]
        rest = sorted(r for g in groups[1 + shown_count :] for r in g)
        for ranks in variants:
            same = raised[ranks[0]].summary == raised[shown].summary
            parts.append(
                f"\n{ranks_heading(ranks, where, of=world)} failed at the same place with "
                f"{'other values' if same else 'another message'}:\n"
                f"  {_variant(raised[ranks[0]], raised[shown])}"
            )
        if rest:
            parts.append(
                f"\n{ranks_heading(rest, where, of=world)} failed at the same place with other "
                f"messages, e.g. rank {rest[0]}:\n  {_variant(raised[rest[0]], raised[shown])}"
            )

    stragglers = sorted(r for r in aborted if r in obs.stragglers)
    # As a hang report shows them: outermost call first, torch's frames folded.
    stacks = {
        r: readable_stack(obs.stacks.get(r, ""), obs.sources.get(r)).rstrip() for r in stragglers
    }
    for ranks in group_ranks({r: stack_key(text) for r, text in stacks.items()}):
        parts.append(
            f"\n{ranks_heading(ranks, where, of=world)} aborted: still running after "
            f"{ranks_phrase(sorted(causes))} failed; "
            f"{'it was' if len(ranks) == 1 else 'they were'} stopped. Where "
            + ("it was" if len(ranks) == 1 else f"they were (the stack of rank {ranks[0]})")
            + ":\n"
            + (stacks[ranks[0]] or "(no stack dump)")
        )
    broken = {r: failed[r] for r in aborted if r not in obs.stragglers}
    calls = {c: call for c in causes if (call := _last_call(obs, c)) is not None}
    peers = ", ".join(
        f"{ranks_phrase(ranks, where)}: {calls[ranks[0]]}" for ranks in group_ranks(calls)[:4]
    )
    # Grouped by the error's type and the collective: gloo's messages name ports and addresses.
    keys = {r: (res.summary.split(":")[0], _last_call(obs, r)) for r, res in broken.items()}
    for ranks in group_ranks(keys):
        call = keys[ranks[0]][1]
        their = "its" if len(ranks) == 1 else "their"
        what = f"{their} collective ({call})" if call else f"{their} collective"
        because = ranks_phrase(sorted(causes), where)
        named = f" (last collective of {peers})" if peers else ""
        summary = failed[ranks[0]].summary
        # A peer the harness stopped (an in-process world's wake) has no error of its own.
        error = "" if summary.startswith(_STOPPED) else f": {summary}"
        if error and len(ranks) > 1:
            error += f" (rank {ranks[0]}'s error)"
        line = f"{ranks_heading(ranks, where, of=world)} aborted: {what} broke because {because} "
        tail = _cut(named + error, max(60, LINE_CHARS - len(line) - len("failed ")))
        parts.append(f"\n{line}failed{' ' if named else ''}{tail}")
    if dead and any(obs.records.values()):
        # A crash inside a call (gloo's abort on a mismatch): as a hang report shows it.
        parts.extend(calls_section(obs, hung=False))
    return "\n".join(parts)
