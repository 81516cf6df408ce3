"""Small phrases every report uses, written once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["add_note", "rank_heading", "rank_label", "ranks_phrase"]


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 0, 2"``."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def rank_label(rank: int, where: Mapping[int, str] | None = None) -> str:
    """``"rank 3"``, or ``"rank 3 (node 1, local rank 1)"`` where ``where`` places the rank (a
    job across nodes)."""
    place = (where or {}).get(rank)
    return f"rank {rank} ({place})" if place else f"rank {rank}"


def rank_heading(rank: int, where: Mapping[int, str] | None = None) -> str:
    """The ``[rank N]`` heading a per-rank section or message starts with (``[rank 3 (node 1,
    local rank 1)]`` in a job across nodes)."""
    return f"[{rank_label(rank, where)}]"


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10, which has no ``add_note``: there the note
    goes to ``__notes__`` all the same, which the rank reports show (3.10's tracebacks do not)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        notes = getattr(exc, "__notes__", None)
        exc.__notes__ = [*(notes or []), note]
