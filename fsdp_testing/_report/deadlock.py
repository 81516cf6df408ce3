"""A certain deadlock in the ranks' collective logs: ranks blocked in calls that only other blocked
(or finished) ranks could complete, so no rank of them can ever go on.

[Note: a certain deadlock]
A rank is blocked when its log shows it inside a call (``entered``) or waiting on a call's work
(``waiting``). Its call waits on some ranks: a receive on its source, a send on its destination
(gloo, nccl and the in-process worlds hand a message over only once the receiver posted its
receive), a collective on the members of its group that have not entered it. A call that the
ops its peers already issued complete (the matching send was issued, every member entered the
collective) waits on nobody. A rank blocked on ranks that are running may be released; one
blocked only on blocked or finished ranks is stuck if they are. So: start from every blocked
rank, drop the ones waiting on a running rank or on a dropped one, until nothing changes; the
ranks left are stuck for good (a receive from any rank, a collective whose members' logs lost
the count, or a log that cannot tell, always count as possibly released: the rule never guesses).
The launchers call this while a test runs and end it at once when the same ranks are found
stuck, unchanged, in consecutive looks, their threads asleep (``_launch/wait_watch.py``), instead
of waiting for the timeout. Local mode's scheduler knows the moment no rank can go on; it words
that deadlock with this rule where the logs show it (``_launch/local.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fsdp_testing._report.collective_log import call_name, expand_ranks, is_inside
from fsdp_testing._report.p2p import PENDING, channel_count, channel_of, is_p2p
from fsdp_testing._report.text import rank_label, ranks_phrase, short_place

__all__ = ["Deadlock", "blocking_entry", "find_deadlock", "p2p_cycle"]

#: The most ranks of one wait cycle a report spells out.
CYCLE_SHOWN = 4
#: The most lines a deadlock's description takes.
LINES_SHOWN = 8

Records = Mapping[int, list[dict[str, Any]]]
Channels = Mapping[int, Mapping[str, int] | None]


@dataclasses.dataclass(frozen=True)
class Deadlock:
    """Ranks that can never go on, and what each waits in."""

    ranks: tuple[int, ...]
    """The stuck ranks."""
    waits: dict[int, tuple[dict[str, Any], tuple[int, ...]]]
    """Per stuck rank: its blocking call's log entry and the ranks it waits on."""
    key: tuple[Any, ...]
    """Equal for two looks that found the same ranks stuck in the same calls."""

    def lines(
        self, finished: Mapping[int, str] | None = None, where: Mapping[int, str] | None = None
    ) -> list[str]:
        """The deadlock in words: each wait cycle as one line (``rank 0 waits in recv #1 from
        rank 1 while rank 1 waits in recv #1 from rank 0``), then ranks waiting on a rank that
        finished its test, then the rest."""
        finished = finished or {}
        done: set[int] = set()
        out: list[str] = []
        for start in self.ranks:
            cycle = _cycle_from(start, self.waits)
            if cycle and not set(cycle) & done:
                done.update(cycle)
                shown = [self._waiting(r, where) for r in cycle[:CYCLE_SHOWN]]
                if len(cycle) > CYCLE_SHOWN:
                    shown.append(
                        f"{len(cycle) - CYCLE_SHOWN} more ranks, each waiting on the next, "
                        f"back to {rank_label(cycle[0], where)} (a cycle of {len(cycle)} ranks)"
                    )
                out.append(" while ".join(shown))
        # The rest, ranks that wait alike as one line: ``ranks 0-62 wait in all_reduce #1 (at
        # ...) for rank 63 to enter it, and rank 63 finished the test (returned)``.
        alike: dict[tuple[str, ...], list[int]] = {}
        for rank in self.ranks:
            if rank in done:
                continue
            entry, on = self.waits[rank]
            gone = [p for p in on if p in finished]
            if gone:
                tail = f", and {ranks_phrase(gone, where)} finished the test ({finished[gone[0]]})"
            else:
                verb = "is" if len(on) == 1 else "are"
                tail = f", and {ranks_phrase(on, where)} {verb} stuck too"
            key = (call_name(entry), entry.get("at", ""), self._for(entry, on, where), tail)
            alike.setdefault(key, []).append(rank)
        for (name, at, waits_for, tail), ranks in alike.items():
            verb = "waits" if len(ranks) == 1 else "wait"
            place = f" (at {short_place(at)})" if at else ""
            out.append(f"{ranks_phrase(ranks, where)} {verb} in {name}{place}{waits_for}{tail}")
        if len(out) > LINES_SHOWN:
            out[LINES_SHOWN - 1 :] = [f"... and {len(out) - LINES_SHOWN + 1} more like these"]
        return out

    def _waiting(self, rank: int, where: Mapping[int, str] | None) -> str:
        entry, on = self.waits[rank]
        at = f" (at {short_place(entry['at'])})" if entry.get("at") else ""
        return f"{rank_label(rank, where)} waits in {call_name(entry)}{at}" + self._for(
            entry, on, where
        )

    @staticmethod
    def _for(entry: dict[str, Any], on: tuple[int, ...], where: Mapping[int, str] | None) -> str:
        """`` for rank 3 to enter it``: whom a collective waits for (a message's peer is in its
        name already)."""
        return "" if is_p2p(entry) else f" for {ranks_phrase(on, where)} to enter it"


def _cycle_from(
    start: int, waits: Mapping[int, tuple[dict[str, Any], tuple[int, ...]]]
) -> list[int]:
    """A cycle of the wait-for graph through ``start`` (following each rank's first wait)."""
    path = [start]
    rank = start
    while True:
        on = [p for p in waits[rank][1] if p in waits]
        if not on:
            return []
        rank = on[0]
        if rank == start:
            return path
        if rank in path:
            return []
        path.append(rank)


def blocking_entry(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The call the rank is blocked in: its newest entry inside a call or waiting on one."""
    for entry in reversed(entries):
        if "fault" in entry:
            return None  # an injected fault holds the rank: not a call's wait
        if is_inside(entry):
            return entry
    return None


def _waits_on(
    rank: int, entry: dict[str, Any], records: Records, channels: Channels
) -> tuple[int, ...] | None:
    """The ranks whose future calls ``entry`` (rank's blocking call) needs; () when calls
    already issued complete it; None when the logs cannot tell."""
    if is_p2p(entry):
        key = channel_of(entry, rank)
        if key is None or "seq" not in entry:
            return None  # a receive from any rank: never counted as stuck
        peer = int(entry["peer"])
        want = "recv" if entry["family"] == "send" else "send"
        count = channel_count(records, channels, peer, key, want)
        if count is None:
            return None
        return () if count >= int(entry["seq"]) else (peer,)
    members = expand_ranks(entry.get("ranks", ""))
    group, seq = entry["group"], int(entry["seq"])
    missing = []
    for member in members:
        if member == rank:
            continue
        mine = [e for e in records.get(member, []) if "seq" in e and not is_p2p(e)]
        on_group = [e for e in mine if e["group"] == group and "fault" not in e]
        if not on_group:
            if len(records.get(member, [])) >= 32:
                return None  # its ring may have lost its entries on the group
            missing.append(member)
            continue
        last = on_group[-1]
        if int(last["seq"]) < seq:
            missing.append(member)
        elif int(last["seq"]) > seq or last["family"] != entry["family"]:
            return None  # it went past, or issued another call there: not a plain wait
    return tuple(missing)


def find_deadlock(
    records: Records, channels: Channels, finished: set[int] | frozenset[int]
) -> Deadlock | None:
    """The ranks stuck for good in ``records`` (see [Note: a certain deadlock]), or None.

    Args:
        records: each rank's collective log.
        channels: each rank's message counts (None: unknown).
        finished: ranks that ended their test (they issue nothing more).
    """
    waits: dict[int, tuple[dict[str, Any], tuple[int, ...]]] = {}
    for rank, entries in records.items():
        if rank in finished:
            continue
        entry = blocking_entry(entries)
        if entry is None or entry.get("state") not in PENDING:
            continue
        on = _waits_on(rank, entry, records, channels)
        if on:  # None (cannot tell) and () (released by what was issued) are not stuck
            waits[rank] = (entry, on)
    stuck = set(waits)
    changed = True
    while changed:
        changed = False
        for rank in sorted(stuck):
            if any(p not in stuck and p not in finished for p in waits[rank][1]):
                stuck.discard(rank)
                changed = True
    if not stuck:
        return None
    kept = {r: waits[r] for r in sorted(stuck)}
    key = tuple(
        (r, e.get("family"), e.get("n"), e.get("seq"), e.get("group")) for r, (e, _) in kept.items()
    )
    return Deadlock(tuple(sorted(stuck)), kept, key)


def p2p_cycle(records: Records, channels: Channels) -> bool:
    """Whether some ranks' blocking calls wait on each other in a cycle whose point-to-point ops
    are all sends or all receives (two ranks that both send first, or both receive first; a
    ring whose ranks all send first): the cycles that ordering the calls undoes. A cycle of a
    send and a receive is a mismatch instead (another tag, another peer): they would have met."""
    waits: dict[int, tuple[dict[str, Any], tuple[int, ...]]] = {}
    for rank, entries in records.items():
        entry = blocking_entry(entries)
        if entry is None or entry.get("state") not in PENDING:
            continue
        on = _waits_on(rank, entry, records, channels)
        if on:
            waits[rank] = (entry, on)
    for start in waits:
        kinds = {waits[r][0]["family"] for r in _cycle_from(start, waits) if is_p2p(waits[r][0])}
        if len(kinds) == 1:
            return True
    return False
