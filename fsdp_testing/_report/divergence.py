"""Where the ranks' collectives diverge: the analysis at the top of a hang report, read from
every rank's collective log (``collective_log.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_testing._report.collective_log import call_name, is_inside
from fsdp_testing._report.grouping import group_ranks
from fsdp_testing._report.text import ranks_phrase
from fsdp_testing.collectives import family_of

__all__ = [
    "collectives_only",
    "describe_divergence",
    "format_records",
    "injected_faults",
    "never_entered",
]


def collectives_only(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collective entries of a log, without its point-to-point ops (``p2p.py`` reads them)
    and the notes of injected faults."""
    return [e for e in entries if "fault" not in e and not e.get("p2p")]


def injected_faults(records: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the faults that ``fsdp_testing.faults`` injected (``{"fault", "where"}``)."""
    found = {r: [e for e in entries if "fault" in e] for r, entries in records.items()}
    return {r: faults for r, faults in found.items() if faults}


def _family(e: dict[str, Any]) -> str:
    # Two spellings of one collective (all_gather_into_tensor, _all_gather_base) match.
    return str(e.get("family") or family_of(e["op"]) or e["op"])


def _fmt(e: dict[str, Any]) -> str:
    return call_name(e)


def _last_per_group(
    records: dict[int, list[dict[str, Any]]],
) -> list[dict[int, dict[str, Any] | None]]:
    """Per process group, each rank's last collective on it (None: none)."""
    groups = sorted({e["group"] for entries in records.values() for e in entries})
    found = []
    for group in groups:
        last: dict[int, dict[str, Any] | None] = {}
        for rank, entries in records.items():
            mine = [e for e in entries if e["group"] == group]
            last[rank] = mine[-1] if mine else None
        found.append(last)
    return found


def never_entered(records: dict[int, list[dict[str, Any]]]) -> dict[int, tuple[str, list[int]]]:
    """The ranks that hold the others up: for each rank that never entered a collective its
    peers wait in, that collective (``"all_reduce #1"``) and the ranks waiting in it."""
    records = {r: collectives_only(entries) for r, entries in records.items()}
    found: dict[int, tuple[str, list[int]]] = {}
    for last in _last_per_group(records):
        waiting = {r: e for r, e in last.items() if e is not None and is_inside(e)}
        for r, e in sorted(waiting.items()):
            for peer, pe in sorted(last.items()):
                if peer != r and (pe is None or pe["seq"] < e["seq"]):
                    what, waiters = found.setdefault(peer, (_fmt(e), []))
                    if what == _fmt(e):
                        waiters.append(r)
    return found


_PLURAL = {"shapes": "shapes", "dtype": "dtypes"}


def _wait(ranks: set[int] | list[int]) -> str:
    return "waits" if len(set(ranks)) == 1 else "wait"


def describe_divergence(
    records: dict[int, list[dict[str, Any]]], where: Mapping[int, str] | None = None
) -> list[str]:
    """Explain where the ranks' collectives diverge, one line per finding; ranks that diverge
    alike share a line (``ranks 0-62 wait in all_reduce #1 but rank 63 never entered it``).

    Compares, per process group, how far each rank got: a rank blocked in ``op #k`` while a
    peer never entered ``#k`` (or entered another op as ``#k``) is the usual cause of a hang.
    ``where`` places ranks on nodes in a job across nodes (see ``text.rank_label``).
    """
    if not any(collectives_only(entries) for entries in records.values()):
        return []
    records = {r: collectives_only(entries) for r, entries in records.items()}
    # finding -> (waiting ranks, peers), in the order first found
    found: dict[tuple[str, ...], tuple[set[int], set[int]]] = {}

    def note(key: tuple[str, ...], rank: int, peer: int) -> None:
        waiters, peers = found.setdefault(key, (set(), set()))
        waiters.add(rank)
        peers.add(peer)

    for last in _last_per_group(records):
        waiting = {r: e for r, e in last.items() if e is not None and is_inside(e)}
        for r, e in sorted(waiting.items()):
            for peer, pe in sorted(last.items()):
                if peer == r:
                    continue
                if pe is None or pe["seq"] < e["seq"]:
                    done = "no collective" if pe is None else f"{_fmt(pe)} ({pe['state']})"
                    note(("never", _fmt(e), done), r, peer)
                    continue
                if pe["seq"] != e["seq"] or (peer in waiting and peer < r):
                    continue  # two waiting ranks are compared once
                # A peer that left the collective (gloo let it through, or it raised) is
                # compared too: a crash on a mismatch leaves one rank inside, one out.
                both = "both" if peer in waiting else "one"
                if _family(pe) != _family(e):
                    note(("other", _fmt(e), _fmt(pe), both, pe["state"]), r, peer)
                elif pe["shapes"] != e["shapes"]:
                    note(("shapes", _fmt(e), str(e["shapes"]), str(pe["shapes"]), both), r, peer)
                elif pe.get("dtype") != e.get("dtype"):
                    note(
                        ("dtype", _fmt(e), str(e.get("dtype")), str(pe.get("dtype")), both), r, peer
                    )
    lines: list[str] = []
    for key, (waiters, peers) in found.items():
        who, them = ranks_phrase(waiters, where), ranks_phrase(peers, where)
        if key[0] == "never":
            owner = f"rank {min(peers)}'s" if len(peers) == 1 else "their"
            theirs = f"{owner} last collective: {key[2]}"
            lines.append(
                f"{who} {_wait(waiters)} in {key[1]} but {them} never entered it ({theirs})"
            )
        elif key[0] == "other" and key[3] == "both":
            lines.append(
                f"{who} {_wait(waiters)} in {key[1]} while {them} {_wait(peers)} in {key[2]}"
            )
        elif key[0] == "other":
            lines.append(
                f"{who} {_wait(waiters)} in {key[1]} while {them} issued {key[2]} ({key[4]})"
            )
        elif key[4] == "both":
            lines.append(
                f"{who} and {them} are both in {key[1]} with different {_PLURAL[key[0]]}: "
                f"{key[2]} vs {key[3]}"
            )
        else:
            lines.append(
                f"{who} {_wait(waiters)} in {key[1]} with {key[0]} {key[2]} but {them} issued it "
                f"with {key[3]}"
            )
    if not lines:
        inside = [r for r, es in records.items() if es and is_inside(es[-1])]
        if inside:
            lines.append(
                f"{ranks_phrase(inside, where)} {_wait(inside)} inside a collective that every "
                "rank entered (a slow or stuck peer outside any recorded collective?)"
            )
    return lines


def format_records(
    records: dict[int, list[dict[str, Any]]],
    last: int = 5,
    where: Mapping[int, str] | None = None,
) -> list[str]:
    """The last ``last`` calls of each rank (collectives and point-to-point ops), one line each;
    ranks whose logs are the same share one entry (``where``: see :func:`describe_divergence`)."""

    def line(e: dict[str, Any]) -> str:
        return f"    {_fmt(e)} shapes={e['shapes']} dtype={e['dtype']} [{e['state']}]"

    calls = {r: [e for e in es if "fault" not in e] for r, es in records.items()}
    shown = {r: tuple(line(e) for e in es[-last:]) for r, es in calls.items()}
    out: list[str] = []
    for ranks in group_ranks(shown):
        lines = shown[ranks[0]]
        if not lines:
            out.append(f"  {ranks_phrase(ranks, where)}: no calls recorded")
            continue
        out.append(f"  {ranks_phrase(ranks, where)}:")
        out.extend(lines)
    return out
