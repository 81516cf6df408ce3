"""Ranks that did the same thing are one entry of a report: the one rule every report follows
(failures, crashes, aborted peers, hang stacks, collective logs), in every mode.

A report at 64 ranks must read like one at 2: 64 ranks failing the same assert are one entry,
"ranks 0-63 (64 of 64)", with one traceback. What counts as "the same" is the caller's key
(a failure's fingerprint: type, message and frames, see ``failure.py``; a stack's text; a
collective log's entries); this module only groups and orders.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

__all__ = ["group_ranks"]


def group_ranks(
    keys: Mapping[int, Hashable], first: Mapping[int, float] | None = None
) -> list[list[int]]:
    """The ranks of ``keys`` with equal keys, one sorted list per key.

    Args:
        keys: each rank's key.
        first: when each rank did it (e.g. when its body ended); the lists are ordered by their
            earliest member's time, so the group that failed first is on top. Default: by
            lowest rank.
    """
    groups: dict[Hashable, list[int]] = {}
    for rank in sorted(keys):
        groups.setdefault(keys[rank], []).append(rank)
    when = first or {}

    def order(ranks: list[int]) -> tuple[float, int]:
        return (min(when.get(r, float("inf")) for r in ranks), ranks[0])

    return sorted(groups.values(), key=order)
