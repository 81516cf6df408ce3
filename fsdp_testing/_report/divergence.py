"""Where the ranks' collectives diverge: the analysis at the top of a hang report, read from
every rank's collective log (``collective_log.py``)."""

from __future__ import annotations

from typing import Any

from fsdp_testing.collectives import family_of

__all__ = ["collectives_only", "describe_divergence", "format_records", "injected_faults"]


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


def describe_divergence(records: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Explain where the ranks' collectives diverge, one line per finding.

    Compares, per process group, how far each rank got: a rank blocked in ``op #k`` while a
    peer never entered ``#k`` (or entered another op as ``#k``) is the usual cause of a hang.
    """
    records = {r: collectives_only(entries) for r, entries in records.items()}
    lines: list[str] = []
    groups = sorted({e["group"] for entries in records.values() for e in entries})
    for group in groups:
        last: dict[int, dict[str, Any] | None] = {}
        for rank, entries in records.items():
            mine = [e for e in entries if e["group"] == group]
            last[rank] = mine[-1] if mine else None
        waiting = {r: e for r, e in last.items() if e is not None and e["state"] == "entered"}
        for r, e in sorted(waiting.items()):
            for peer, pe in sorted(last.items()):
                if peer == r:
                    continue
                if pe is None or pe["seq"] < e["seq"]:
                    done = "no collective" if pe is None else f"{_fmt(pe)} ({pe['state']})"
                    lines.append(
                        f"rank {r} waits in {_fmt(e)} but rank {peer} never entered it "
                        f"(rank {peer}'s last collective: {done})"
                    )
                elif pe["seq"] == e["seq"] and _family(pe) != _family(e) and peer > r:
                    lines.append(
                        f"rank {r} waits in {_fmt(e)} while rank {peer} waits in {_fmt(pe)}"
                    )
                elif pe["seq"] == e["seq"] and pe["shapes"] != e["shapes"] and peer > r:
                    lines.append(
                        f"rank {r} and rank {peer} are both in {_fmt(e)} with different "
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


def format_records(records: dict[int, list[dict[str, Any]]], last: int = 5) -> list[str]:
    """The last ``last`` collectives of each rank, one line each."""
    out: list[str] = []
    for rank in sorted(records):
        entries = collectives_only(records[rank])[-last:]
        if not entries:
            out.append(f"  rank {rank}: no collectives recorded")
            continue
        out.append(f"  rank {rank}:")
        for e in entries:
            out.append(f"    {_fmt(e)} shapes={e['shapes']} dtype={e['dtype']} [{e['state']}]")
    return out
