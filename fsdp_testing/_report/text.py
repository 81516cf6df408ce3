"""Small phrases every report uses, written once."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

__all__ = [
    "add_note",
    "rank_heading",
    "rank_label",
    "rank_ranges",
    "ranks_heading",
    "ranks_phrase",
    "short_place",
]


def rank_ranges(ranks: Iterable[int]) -> str:
    """``"0-62"``, ``"0, 1, 5-7"``: runs of three or more consecutive ranks as ranges."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            runs.append(f"{ordered[i]}-{ordered[j]}")
        else:
            runs.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ", ".join(runs)


#: The longest list of rank ranges a phrase spells out; a longer one keeps its ends.
RANGES_CHARS = 100


def _bounded(ranges: str) -> str:
    """``ranges`` within ``RANGES_CHARS``: ``"9, 12, 15, ..., 63"`` (the count says how many);
    ranks a step apart (every other rank) as their first three and last: ``"1, 3, 5, ..., 63"``."""
    runs = ranges.split(", ")
    if len(runs) > 5 and all(run.isdigit() for run in runs):
        steps = {int(b) - int(a) for a, b in itertools.pairwise(runs)}
        if len(steps) == 1:
            return ", ".join([*runs[:3], "...", runs[-1]])
    if len(ranges) <= RANGES_CHARS:
        return ranges
    kept: list[str] = []
    for run in runs[:-1]:
        if len(", ".join([*kept, run, "...", runs[-1]])) > RANGES_CHARS:
            break
        kept.append(run)
    return ", ".join([*kept, "...", runs[-1]])


def _nodes(ranks: list[int], where: Mapping[int, str] | None) -> str:
    """``" (node 1)"`` or ``" (nodes 0-1)"`` for ranks that ``where`` places (``"node N, local
    rank M"``); empty when it places none."""
    nodes = set()
    for rank in ranks:
        place = (where or {}).get(rank, "")
        head = place.split(",")[0].strip()
        if head.startswith("node ") and head[5:].isdigit():
            nodes.add(int(head[5:]))
    if not nodes:
        return ""
    return f" ({'node' if len(nodes) == 1 else 'nodes'} {rank_ranges(nodes)})"


def ranks_phrase(
    ranks: Iterable[int],
    where: Mapping[int, str] | None = None,
    *,
    of: int | None = None,
) -> str:
    """``"rank 1"``, ``"ranks 0-62, 63"``; ``of``: the world size, to add the count
    (``"ranks 0-62 (63 of 64)"``); ``where``: the rank's place (one rank) or the nodes (several)
    in a job across nodes (see :func:`rank_label`)."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return rank_label(ordered[0], where)
    text = "ranks " + _bounded(rank_ranges(ordered))
    if of is not None:
        text += f" ({len(ordered)} of {of})"
    return text + _nodes(ordered, where)


def ranks_heading(
    ranks: Iterable[int], where: Mapping[int, str] | None = None, *, of: int | None = None
) -> str:
    """``[rank 3]`` or ``[ranks 0-62 (63 of 64)]``: the heading of a section for some ranks."""
    return f"[{ranks_phrase(ranks, where, of=of)}]"


def rank_label(rank: int, where: Mapping[int, str] | None = None) -> str:
    """``"rank 3"``, or ``"rank 3 (node 1, local rank 1)"`` where ``where`` places the rank (a
    job across nodes)."""
    place = (where or {}).get(rank)
    return f"rank {rank} ({place})" if place else f"rank {rank}"


def rank_heading(rank: int, where: Mapping[int, str] | None = None) -> str:
    """The ``[rank N]`` heading a per-rank section or message starts with (``[rank 3 (node 1,
    local rank 1)]`` in a job across nodes)."""
    return f"[{rank_label(rank, where)}]"


def short_place(at: str) -> str:
    """``path:line`` of a call as reports show it: the file's folder and name
    (``tests/test_pipe.py:42``)."""
    path, _, line = at.rpartition(":")
    parts = path.split("/")
    return f"{'/'.join(parts[-2:])}:{line}" if len(parts) > 2 else at


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10, which has no ``add_note``: there the note
    goes to ``__notes__`` all the same, which the rank reports show (3.10's tracebacks do not)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        notes = getattr(exc, "__notes__", None)
        exc.__notes__ = [*(notes or []), note]
