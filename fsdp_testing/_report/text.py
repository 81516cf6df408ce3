"""Small phrases every report uses, written once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["rank_heading", "rank_label", "ranks_phrase"]


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
