"""What each rank issued as one collective, and the error when the ranks of a group disagree.

Shared by the in-process worlds that see every rank's call of a collective before any data
moves: local mode (``local_group.py``) and thread mode (``threads.py``). A real backend given
different calls hangs, fails on one rank with a size error, or mixes data silently; these
worlds name what each rank issued instead, so the report blames the rank whose call differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_testing._report.text import ranks_phrase

__all__ = ["describe_call", "group_label", "mismatch_message", "ordinal", "reduce_op_name"]


def describe_call(op: str, tensors: Sequence[Any], extra: str = "") -> str:
    """One rank's call as the reports show it, e.g. ``broadcast(float32[5], src 0)``."""
    shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
    return f"{op}({shapes}{', ' + extra if extra else ''})"


def reduce_op_name(op: Any) -> str:
    """``SUM``, ``AVG``, ... for a ``ReduceOp``, its ``RedOpType``, or an options object holding
    one as ``reduceOp`` (None: SUM, torch's default)."""
    op = getattr(op, "reduceOp", op)
    if op is None:
        return "SUM"
    op = getattr(op, "op", op)
    return str(op).rsplit(".", 1)[-1]


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``, ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def group_label(name: str, global_ranks: Sequence[int], default: bool) -> str:
    """How a message names a group: the default group, or its name and its ranks."""
    if default:
        return "the default group"
    return f"group {name!r} (ranks {list(global_ranks)})"


def mismatch_message(calls: Mapping[int, str], nth: int, label: str) -> str:
    """The error every rank of a group raises when their ``nth`` collective on the group (named
    by ``label``) differs; ``calls`` maps each rank (in the world) to what it issued."""
    by_call: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        by_call.setdefault(call, []).append(rank)
    # The fewest ranks first: the odd one out (``rank 37 issued ...; ranks 0-36, 38-63 ...``).
    parts = [
        f"{ranks_phrase(ranks)} issued {call}"
        for call, ranks in sorted(by_call.items(), key=lambda item: (len(item[1]), item[1][0]))
    ]
    return (
        f"the ranks issued different collectives as the {ordinal(nth)} collective of {label}: "
        f"{'; '.join(parts)}. A real run would hang or mix data here; every rank must issue the "
        "same collectives in the same order."
    )
