"""Where the ranks' collectives diverge: the analysis at the top of a hang report, read from
every rank's collective log (``collective_log.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_testing._report.text import rank_label
from fsdp_testing.collectives import family_of

__all__ = [
    "collectives_only",
    "describe_divergence",
    "format_records",
    "injected_faults",
    "never_entered",
]


def collectives_only(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collective entries of a log, without the notes of injected faults."""
    return [e for e in entries if "fault" not in e]


def injected_faults(records: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the faults that ``fsdp_testing.faults`` injected (``{"fault", "where"}``)."""
    found = {r: [e for e in entries if "fault" in e] for r, entries in records.items()}
    return {r: faults for r, faults in found.items() if faults}


def _family(e: dict[str, Any]) -> str:
    # Two spellings of one collective (all_gather_into_tensor, _all_gather_base) match.
    return family_of(e["op"]) or e["op"]


def _fmt(e: dict[str, Any]) -> str:
    return f"{e['op']} #{e['seq']}" + ("" if e["group"] == "default" else f" on {e['group']}")


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
        waiting = {r: e for r, e in last.items() if e is not None and e["state"] == "entered"}
        for r, e in sorted(waiting.items()):
            for peer, pe in sorted(last.items()):
                if peer != r and (pe is None or pe["seq"] < e["seq"]):
                    what, waiters = found.setdefault(peer, (_fmt(e), []))
                    if what == _fmt(e):
                        waiters.append(r)
    return found


def describe_divergence(
    records: dict[int, list[dict[str, Any]]], where: Mapping[int, str] | None = None
) -> list[str]:
    """Explain where the ranks' collectives diverge, one line per finding.

    Compares, per process group, how far each rank got: a rank blocked in ``op #k`` while a
    peer never entered ``#k`` (or entered another op as ``#k``) is the usual cause of a hang.
    ``where`` places ranks on nodes in a job across nodes (see ``text.rank_label``).
    """
    records = {r: collectives_only(entries) for r, entries in records.items()}

    def name(rank: int) -> str:
        return rank_label(rank, where)

    lines: list[str] = []
    for last in _last_per_group(records):
        waiting = {r: e for r, e in last.items() if e is not None and e["state"] == "entered"}
        for r, e in sorted(waiting.items()):
            for peer, pe in sorted(last.items()):
                if peer == r:
                    continue
                if pe is None or pe["seq"] < e["seq"]:
                    done = "no collective" if pe is None else f"{_fmt(pe)} ({pe['state']})"
                    lines.append(
                        f"{name(r)} waits in {_fmt(e)} but {name(peer)} never entered it "
                        f"(rank {peer}'s last collective: {done})"
                    )
                elif pe["seq"] == e["seq"] and _family(pe) != _family(e) and peer > r:
                    lines.append(
                        f"{name(r)} waits in {_fmt(e)} while {name(peer)} waits in {_fmt(pe)}"
                    )
                elif pe["seq"] == e["seq"] and pe["shapes"] != e["shapes"] and peer > r:
                    lines.append(
                        f"{name(r)} and {name(peer)} are both in {_fmt(e)} with different "
                        f"shapes: {e['shapes']} vs {pe['shapes']}"
                    )
    if not lines:
        inside = [r for r, es in records.items() if es and es[-1]["state"] == "entered"]
        if inside:
            lines.append(
                "ranks " + ", ".join(map(str, inside)) + " wait inside a collective that "
                "every rank entered (a slow or stuck peer outside any recorded collective?)"
            )
        else:
            lines.append("no rank is inside a recorded collective: the hang is in user code")
    return lines


def format_records(
    records: dict[int, list[dict[str, Any]]],
    last: int = 5,
    where: Mapping[int, str] | None = None,
) -> list[str]:
    """The last ``last`` collectives of each rank, one line each (``where``: see
    :func:`describe_divergence`)."""
    out: list[str] = []
    for rank in sorted(records):
        entries = collectives_only(records[rank])[-last:]
        if not entries:
            out.append(f"  {rank_label(rank, where)}: no collectives recorded")
            continue
        out.append(f"  {rank_label(rank, where)}:")
        for e in entries:
            out.append(f"    {_fmt(e)} shapes={e['shapes']} dtype={e['dtype']} [{e['state']}]")
    return out
