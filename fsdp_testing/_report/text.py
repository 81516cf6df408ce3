"""Small phrases every report uses, written once."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["rank_heading", "ranks_phrase"]


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 0, 2"``."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def rank_heading(rank: int) -> str:
    """The ``[rank N]`` heading a per-rank section or message starts with."""
    return f"[rank {rank}]"
