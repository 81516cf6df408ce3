"""Where a hang report is written: a test that hit its timeout is reported with where the ranks'
collectives diverge (on top), each rank's last communication (collectives, sends and receives),
and the stack of every rank still running, with the harness's own frames trimmed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import linecache
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.collective_log import call_name
from fsdp_testing._report.deadlock import blocking_entry, p2p_cycle
from fsdp_testing._report.divergence import (
    describe_divergence,
    format_records,
    injected_faults,
    never_entered,
)
from fsdp_testing._report.failure import USER_FACING_PRIVATE, mask, message_of
from fsdp_testing._report.grouping import group_ranks
from fsdp_testing._report.imports import Importing, importing
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.p2p import (
    describe_p2p,
    never_reached,
    pending_p2p,
    tag_mismatch,
    unmatched,
)
from fsdp_testing._report.text import rank_label, ranks_heading, ranks_phrase, short_place

__all__ = [
    "P2P_CYCLE_ADVICE",
    "P2P_MATCH_ADVICE",
    "calls_section",
    "importing_in",
    "readable_stack",
    "stack_key",
    "stack_sources",
    "timeout_report",
]

_HARNESS_MARKERS = ("/fsdp_testing/_", "<frozen runpy>", "/threading.py")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")
_TORCH_DIR = os.sep + "torch" + os.sep


class _Frame(NamedTuple):
    path: str
    line: int
    func: str


_USER_FACING = tuple(os.path.join(os.sep + "fsdp_testing", p) for p in USER_FACING_PRIVATE)


def _is_harness(path: str) -> bool:
    """Whether ``path`` (or a stack dump's ``File "..."`` line) is the harness's own code; not
    torch's DTensor helpers that the test calls (``with_comms``, ``destroy_pg``, ...)."""
    if any(module in path for module in _USER_FACING):
        return False
    return any(m in path for m in _HARNESS_MARKERS)


@functools.cache
def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")  # where torch lives, without importing it
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.join(locations[0], "") if locations else _TORCH_DIR


def _is_torch(path: str) -> bool:
    return path.startswith(_torch_dir()) or path.startswith("<frozen")


def _whose(frames: list[_Frame]) -> str:
    """Whose code a run of folded frames is: torch's, Python's (``<frozen importlib...>``: an
    import), or both."""
    frozen = sum(f.path.startswith("<frozen") for f in frames)
    return "torch" if not frozen else "Python" if frozen == len(frames) else "torch and Python"


def _threads(text: str) -> list[tuple[str, list[_Frame]]]:
    """Split a stack dump into (heading, frames outermost first). faulthandler writes each
    thread most recent call first; ``traceback.format_stack`` writes one stack outermost first."""
    threads: list[tuple[str, list[_Frame]]] = []
    heading, recent_first = "", False
    frames: list[_Frame] = []
    for raw in text.splitlines():
        if _THREAD.match(raw.strip()):
            if frames or heading:
                threads.append((heading, frames[::-1] if recent_first else frames))
            heading, frames, recent_first = raw.strip(), [], True
            continue
        match = _FRAME.match(raw)
        if match:
            frames.append(_Frame(match["path"], int(match["line"]), match["func"]))
    if frames or heading:
        threads.append((heading, frames[::-1] if recent_first else frames))
    return threads


def importing_in(text: str) -> Importing | None:
    """The import in progress on the thread of a stack dump that runs the test (the first
    thread whose frames are not all torch's and the harness's), if any."""
    for _, frames in _threads(text):
        found = importing([(f.path, f.line, f.func) for f in frames])
        if found is not None:
            return found
    return None


def _importing_lines(obs: Observation) -> tuple[list[str], set[int]]:
    """One line per import the ranks still running were in at the deadline, and those ranks."""
    by_import: dict[Importing, list[int]] = {}
    for rank in sorted(obs.stragglers):
        found = importing_in(obs.stacks.get(rank, ""))
        if found is not None:
            by_import.setdefault(found, []).append(rank)
    lines = []
    for found, ranks in by_import.items():
        who = ranks_phrase(ranks, obs.where)
        now = f", now in {found.now}" if found.now != found.module else ""
        at = f" (imported at {short_place(found.at)})" if found.at else ""
        extra = f", and {obs.import_wait:g} s more for imports" if obs.import_wait else ""
        lines.append(
            f"{who} {'is' if len(ranks) == 1 else 'are'} still importing {found.module}{now}"
            f"{at} after the test's {obs.timeout:g} s{extra}: not a hang, a module's first "
            "import on a busy machine. The next ranks start with it imported (the fork server "
            "preloads what ranks imported); give the first test that needs it a longer timeout "
            "(@pytest.mark.distributed(timeout=...)) or raise --dist-timeout."
        )
    return lines, {r for ranks in by_import.values() for r in ranks}


def stack_sources(text: str) -> dict[str, str]:
    """The source line of every frame of a stack dump, by ``"path:line"``, read from this
    machine's files: a rank on another node sends them with its stack (see
    :func:`readable_stack`)."""
    found: dict[str, str] = {}
    for _, frames in _threads(text):
        for frame in frames:
            source = linecache.getline(frame.path, frame.line).strip()
            if source:
                found[f"{frame.path}:{frame.line}"] = source
    return found


def readable_stack(text: str, sources: Mapping[str, str] | None = None) -> str:
    """A stack dump as a person reads it: outermost call first, as in a traceback; the source
    line under every frame (the dump is written from C while the rank is blocked, so the lines
    are added here, from ``sources`` (see :func:`stack_sources`) where the rank ran on another
    machine, else from this machine's files); the harness's frames dropped; runs of torch's own
    frames folded into one line naming the outermost and innermost call. The thread that was
    running the test (the one with test frames) comes first. Text that holds no frames is
    returned as it is."""
    threads = _threads(text)
    if not any(frames for _, frames in threads):
        return text
    rendered: list[tuple[bool, str]] = []
    for heading, frames in threads:
        kept = [f for f in frames if not _is_harness(f.path)]
        if not kept:
            continue
        # Frames are now outermost first, as in a traceback.
        lines = (
            [heading.replace("most recent call first", "most recent call last")] if heading else []
        )
        i = 0
        while i < len(kept):
            frame = kept[i]
            if _is_torch(frame.path):
                j = i
                while j < len(kept) and _is_torch(kept[j].path):
                    j += 1
                if j - i > 1:
                    inner = kept[j - 1]
                    lines.append(
                        f"  ... {j - i} frames in {_whose(kept[i:j])}: {frame.func} "
                        f"({os.path.basename(frame.path)}:{frame.line}) -> {inner.func} "
                        f"({os.path.basename(inner.path)}:{inner.line})"
                    )
                    i = j
                    continue
            lines.append(f'  File "{frame.path}", line {frame.line} in {frame.func}')
            source = (sources or {}).get(f"{frame.path}:{frame.line}") or linecache.getline(
                frame.path, frame.line
            ).strip()
            if source:
                lines.append(f"    {source}")
            i += 1
        has_test = any(not _is_torch(f.path) for f in kept)
        rendered.append((has_test, "\n".join(lines)))
    rendered.sort(key=lambda item: not item[0])  # stable: threads with test frames first
    return "\n".join(text for _, text in rendered)


_THREAD_ID = re.compile(r"thread 0x[0-9a-f]+", re.IGNORECASE)


def stack_key(stack: str) -> str:
    """What two ranks' stacks share when they stopped at the same place (thread ids and
    addresses masked): ranks with equal keys show one stack."""
    return mask(_THREAD_ID.sub("thread 0x?", stack))


def _finished_phrase(result: RankResult) -> str:
    """How a rank that reported ended its test, in the report's words."""
    if result.outcome is Outcome.PASSED:
        return "finished the test (returned)"
    if result.outcome is Outcome.FAILED:
        return f"finished the test (failed: {result.summary})"
    return f"finished the test ({result.outcome.value})"


def _callee(source: str) -> str | None:
    """``time.sleep`` for ``time.sleep(60)  # ...``: the outermost call of a line of source
    (None: the line is no whole statement, or calls nothing by a plain name)."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError:
        return None
    for node in ast.walk(tree):  # breadth first: the outermost call comes first
        if isinstance(node, ast.Call):
            return (
                ast.unparse(node.func) if isinstance(node.func, ast.Name | ast.Attribute) else None
            )
    return None


def _place_in(stack: str, sources: Mapping[str, str] | None) -> str | None:
    """``in time.sleep at tests/test_pipe.py:14``: where a rank's stack dump shows the test
    thread, in the innermost frame outside the harness (None: the dump shows no frame)."""
    for _, frames in _threads(stack):
        kept = [f for f in frames if not _is_harness(f.path)]
        mine = [f for f in kept if not _is_torch(f.path)]
        if not mine:
            continue
        user, inner = mine[-1], kept[-1]
        place = short_place(f"{user.path}:{user.line}")
        if inner is not user:
            torch_at = f"{os.path.basename(inner.path)}:{inner.line}"
            return f"in torch's {inner.func} ({torch_at}), called at {place}"
        source = (sources or {}).get(f"{user.path}:{user.line}") or linecache.getline(
            user.path, user.line
        )
        callee = _callee(source) if source else None
        return f"in {callee} at {place}" if callee else f"at {place}"
    return None


def _busy(obs: Observation, skip: set[int] | frozenset[int] = frozenset()) -> set[int]:
    """Ranks still running that their logs show in no call: busy in their own code."""
    return {
        r
        for r in obs.stragglers - skip
        if r in obs.records and blocking_entry(obs.records[r]) is None
    }


def _p2p_holdups(obs: Observation, skip: set[int] | frozenset[int]) -> list[str]:
    """``rank 1 hangs: it never reached a send to rank 0, which rank 0's recv #1 waits for; rank
    1 is in time.sleep at tests/test_pipe.py:14``: ranks still running, in none of their calls,
    whose peers wait in a message to or from them."""
    where = obs.where
    lines = []
    for rank, waits in sorted(never_reached(obs.records, obs.channels, _busy(obs, skip)).items()):
        clauses = []
        for waiter, e in waits[:WAITS_SHOWN]:
            partner = "a send to" if e["family"] == "recv" else "a recv from"
            clauses.append(
                f"{partner} {rank_label(waiter, where)}, which {rank_label(waiter, where)}'s "
                f"{e['op']} #{e['n']} waits for"
            )
        more = len(waits) - WAITS_SHOWN
        line = f"{rank_label(rank, where)} hangs: it never reached " + ", nor ".join(clauses)
        if more > 0:
            line += f" (and {more} more ops wait on it)"
        place = _place_in(obs.stacks.get(rank, ""), obs.sources.get(rank))
        lines.append(line + (f"; {rank_label(rank, where)} is {place}" if place else ""))
    return lines


#: The most waits on one rank a hold-up line spells out.
WAITS_SHOWN = 3


def _holdups(obs: Observation, skip: set[int] | frozenset[int] = frozenset()) -> list[str]:
    """The ranks that hold the others up, grouped: those still running that never entered the
    collective their peers wait in ("hang"), and those that ended their test without it; then
    those still running, in no call, that never reached the message a peer waits for. Ranks in
    ``skip`` (still importing) are said to be elsewhere."""
    where = obs.where
    keys: dict[int, tuple[str, str, tuple[int, ...]]] = {}
    for rank, (what, waiters) in never_entered(obs.records).items():
        if rank in skip:
            continue
        result = obs.results.get(rank)
        state = _finished_phrase(result) if result is not None else "hangs"
        keys[rank] = (state, what, tuple(waiters))
    lines = []
    for ranks in group_ranks(keys):
        state, what, waiting = keys[ranks[0]]
        who = ranks_phrase(ranks, where)
        wait = "waits" if len(waiting) == 1 else "wait"
        if state == "hangs":
            lines.append(
                f"{who} {'hangs' if len(ranks) == 1 else 'hang'}: "
                f"{'it' if len(ranks) == 1 else 'they'} never entered {what}, which "
                f"{ranks_phrase(waiting, where)} {wait} in"
            )
        else:
            lines.append(
                f"{who} {state} without entering {what}, which "
                f"{ranks_phrase(waiting, where)} {wait} in"
            )
    return lines + _p2p_holdups(obs, skip)


def calls_section(obs: Observation, *, hung: bool = True) -> list[str]:
    """What the ranks' logs say about a hang (``hung``) or a crash: where their collectives
    diverge, what their point-to-point ops wait for, the advice that fits the kind of call that
    hung, and each rank's last calls."""
    where = obs.where
    finished = {
        r: _finished_phrase(res).removeprefix("finished the test ")
        for r, res in obs.results.items()
    }
    finished = {r: text.strip("()") for r, text in finished.items()}
    parts: list[str] = []
    collective = describe_divergence(obs.records, where)
    if collective:
        parts.append("\ncollective divergence:")
        parts.extend("  " + line for line in collective)
    p2p = describe_p2p(obs.records, obs.channels, finished=finished, where=where)
    pending = pending_p2p(obs.records)
    if p2p or pending:
        parts.append("\npoint-to-point:")
        parts.extend("  " + line for line in p2p)
        for rank, ops in sorted(pending.items())[:PENDING_SHOWN]:
            shown = ", ".join(f"{call_name(e)} [{e['state']}]" for e in ops[-4:])
            parts.append(f"  {rank_label(rank, where)} pending: {shown}")
        if len(pending) > PENDING_SHOWN:
            more = sorted(pending)[PENDING_SHOWN:]
            parts.append(f"  ({ranks_phrase(more, where)} have pending ops too)")
        parts.extend(f"  {line}" for line in _p2p_advice(obs))
    blocked = [r for r, es in obs.records.items() if blocking_entry(es) is not None]
    importing = any(importing_in(obs.stacks.get(r, "")) for r in obs.stragglers)
    if hung and not blocked and not obs.deadlock and not importing:
        parts.append(
            "\nno rank is inside a recorded call (collective or point-to-point): the hang is "
            "in user code"
        )
    parts.append("\nlast communication per rank:")  # collectives, sends and receives
    parts.extend(format_records(obs.records, where=where))
    return parts


#: What a report says where ranks' point-to-point ops wait on each other in a cycle.
P2P_CYCLE_ADVICE = (
    "A blocking send waits until its receive is posted (gloo, nccl): two ranks that both send "
    "first, or both receive first, wait for each other; use isend/irecv or batch_isend_irecv, "
    "or order the calls by rank."
)
#: What a report says where a rank waits in a message whose peer issued no partner for it.
P2P_MATCH_ADVICE = "Each send needs a receive of the same size and tag on its peer."


def _p2p_advice(obs: Observation) -> list[str]:
    """The advice that fits the ranks' waits: a mismatch's where a rank's op and its peer's
    partner differ in tag (a cycle of sends whose receives wait under another tag is not undone
    by ordering the calls), else a cycle's (the order of the calls), else a mismatch's where a
    rank waits on a peer that is not just busy elsewhere (see :func:`_p2p_holdups`), else
    none."""
    records, channels = obs.records, obs.channels
    unmet = [
        (rank, e)
        for rank, ops in pending_p2p(records).items()
        for e in ops
        if unmatched(records, channels, rank, e)
    ]
    if any(tag_mismatch(records, rank, e) for rank, e in unmet):
        return [P2P_MATCH_ADVICE]
    if p2p_cycle(records, channels):
        return [P2P_CYCLE_ADVICE]
    busy = _busy(obs)
    if any(e.get("peer") not in busy for _, e in unmet):
        return [P2P_MATCH_ADVICE]
    return []


#: The most ranks whose pending point-to-point ops a report lists one by one.
PENDING_SHOWN = 8


def timeout_report(obs: Observation) -> str:
    """The report of a test that hit its timeout, or that a certain deadlock ended before it
    (``obs.deadlock``): the wait cycle and the collective and point-to-point divergence on top,
    then the stacks of the ranks still running, ranks stopped at the same place sharing one."""
    running = sorted(obs.stragglers)
    where = obs.where
    if obs.deadlock:
        stuck = obs.deadlock_ranks or tuple(running)
        parts = [
            f"deadlock: {ranks_phrase(stuck, where)} can never go on (of world size "
            f"{obs.world_size}); found {obs.deadlock_after:.1f} s into the test and ended "
            f"there, before the timeout ({obs.timeout:g} s)"
        ]
        parts.extend(obs.deadlock)
    else:
        parts = [
            f"timed out after {obs.timeout:g} s: {ranks_phrase(running, where)} "
            f"still running (of world size {obs.world_size})"
        ]
        imports, importing_ranks = _importing_lines(obs)
        parts.extend(imports)
        parts.extend(_holdups(obs, skip=importing_ranks))
    for rank, faults in sorted(injected_faults(obs.records).items()):
        for fault in faults:
            if fault["fault"] == "hang":
                parts.append(f"rank {rank} hangs at {fault['where']} (injected by faults.hang)")
    if obs.unstoppable:
        parts.append(
            f"{ranks_phrase(sorted(obs.unstoppable))} could not be stopped (blocked outside Python)"
        )
    if obs.records:
        parts.extend(calls_section(obs))
    stacks = {
        r: readable_stack(obs.stacks.get(r, "(none)"), obs.sources.get(r)).rstrip() for r in running
    }
    for ranks in group_ranks({r: stack_key(text) for r, text in stacks.items()}):
        heading = ranks_heading(ranks, where, of=obs.world_size)
        when = "the deadlock was found" if obs.deadlock else "the timeout hit"
        parts.append(f"\n{heading} stack when {when}:\n{stacks[ranks[0]]}")
    failed = {r: res for r, res in obs.results.items() if res.outcome is Outcome.FAILED}
    keys = {r: res.fingerprint or mask(res.summary) for r, res in failed.items()}
    for ranks in group_ranks(keys, {r: res.finished_at for r, res in failed.items()}):
        heading = ranks_heading(ranks, where, of=obs.world_size)
        parts.append(
            f"\n{heading} failed before the timeout:\n{message_of(failed[ranks[0]]).rstrip()}"
        )
    return "\n".join(parts)
