"""What a configuration costs each rank: the played rank's measured step, extended to every rank
of the world by arithmetic over the units' views.

[Note: every rank from one]
The planner shards and steps the model once, as one rank of the fake world (``_plan_build``),
and counts what that rank holds (``_plan_memory``). ``fsdp_core`` pads every parameter's dim-0
shard to ``ceil(rows / S)`` rows on every rank of its shard group of ``S`` ranks (the flat shard
buffer, the unsharded buffers, the reduce buffers and the reduced gradient are that size on
every rank), so parameter and gradient bytes, every buffer of the step and the communication
are the same on every rank. What differs is which rows are real: rank ``r`` at index ``i`` of a
shard group holds ``min(max(rows - i * ceil(rows / S), 0), ceil(rows / S))`` rows of a
parameter, so its padding, its empty units (no row of any parameter) and its optimizer state
(built on the real rows only) follow from the views by arithmetic, for every rank at once. A
rank's index in a group comes from the played rank's view: groups of consecutive ranks aligned
to their size (the world, a mesh's shard groups) or of one rank; any other layout is refused by
name. Ranks with equal numbers form a class, one table row each.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ._plan_args import PlanError

__all__ = [
    "COMM_FAMILIES",
    "STATE_PER_ELEMENT",
    "Measured",
    "RankCost",
    "format_ranks",
    "group_ranks",
    "rank_costs",
    "shard_index",
]

COMM_FAMILIES = ("all_gather", "reduce_scatter", "all_reduce")

#: Optimizer state elements per element of a trainable shard (beside a scalar step counter).
STATE_PER_ELEMENT = {"adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the played rank held in its counted step (bytes; see [Note: counting storages])."""

    param_bytes: int
    """Storages of the sharded parameters (flat shard buffers, padding included)."""
    grad_bytes: int
    """Storages of the sharded gradients after backward."""
    optim_bytes: int
    """Storages of the optimizer state."""
    buffer_bytes: int
    """Storages of the model's buffers."""
    peak_bytes: int
    """Everything alive at the step's worst point."""
    end_bytes: int
    """Everything alive after the optimizer step (what stays between steps)."""
    peak_at: str
    """Where the peak was: phase and the last unit event."""
    max_units_unsharded: int
    """Units unsharded at once, at most."""

    @property
    def step_adds(self) -> int:
        """What the step holds beyond what stays between steps."""
        return self.peak_bytes - self.end_bytes


@dataclasses.dataclass(frozen=True)
class RankCost:
    """One rank's numbers, as ``--json`` writes them (bytes; comm per training step)."""

    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    peak_bytes: int
    padding_bytes: int
    empty_units: int
    comm: tuple[tuple[str, int], ...]

    def as_json(self) -> dict[str, Any]:
        """The keys of the SPEC, in its order."""
        return {
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optim_bytes": self.optim_bytes,
            "peak_bytes": self.peak_bytes,
            "padding_bytes": self.padding_bytes,
            "empty_units": self.empty_units,
            "comm": dict(self.comm),
        }


def shard_index(view: Any, rank: int, world_size: int) -> int:
    """``rank``'s index in the shard group that the played rank's ``view`` shows, for the
    layouts of [Note: every rank from one].

    Raises:
        PlanError: the group is not one of them.
    """
    size = view.shard_size
    if size == 1:
        return 0
    first = view.shard_ranks[0]
    if (
        view.shard_ranks == tuple(range(first, first + size))
        and first % size == 0
        and world_size % size == 0
    ):
        return rank % size
    raise PlanError(
        f"unit {view.fqn or '<root>'!r} is sharded over ranks "
        f"{list(view.shard_ranks)}; the planner extends one rank's numbers to the others for "
        "groups of consecutive ranks aligned to their size (the world, --mesh's shard groups) "
        "and groups of one rank"
    )


def _local_rows(param: Any, index: int) -> int:
    rows = param.shape[0] if param.shape else 1
    return max(0, min(param.padded_rows, rows - index * param.padded_rows))


def _per_index(view: Any, per_element: int) -> list[tuple[int, int, bool]]:
    """Per index in the unit's shard group: (optimizer state bytes, padding bytes, empty)."""
    out = []
    for index in range(view.shard_size):
        state = padding = 0
        empty = view.shard_size > 1
        for p in view.params:
            rest = math.prod(p.shape[1:])
            local = _local_rows(p, index)
            itemsize = p.dtype.itemsize
            padding += (p.padded_rows - local) * rest * itemsize
            if p.requires_grad:
                state += per_element * local * rest * itemsize
            empty = empty and local == 0
        out.append((state, padding, empty))
    return out


def rank_costs(
    views: Sequence[Any],
    *,
    world_size: int,
    played: int,
    measured: Measured,
    optim: str,
    comm: dict[str, int],
) -> list[RankCost]:
    """Every rank's :class:`RankCost` from the played rank's views and measurement. See
    [Note: every rank from one].

    Args:
        views: the played rank's ``fsdp_core.UnitView``s.
        world_size: ranks in the world.
        played: the rank the fake world played.
        measured: what the played rank held in its step.
        optim: a key of :data:`STATE_PER_ELEMENT`.
        comm: bytes per step per family (every rank alike).
    """
    per_element = STATE_PER_ELEMENT[optim]
    tables = [(view, _per_index(view, per_element)) for view in views]
    totals = []
    for rank in range(world_size):
        state = padding = empty = 0
        for view, table in tables:
            s, p, e = table[shard_index(view, rank, world_size)]
            state, padding, empty = state + s, padding + p, empty + e
        totals.append((state, padding, empty))
    played_state = totals[played][0]
    frozen = tuple((family, comm.get(family, 0)) for family in COMM_FAMILIES)
    costs = []
    for state, padding, empty in totals:
        delta = state - played_state  # optimizer state is built on the real rows only
        costs.append(
            RankCost(
                param_bytes=measured.param_bytes,
                grad_bytes=measured.grad_bytes,
                optim_bytes=measured.optim_bytes + delta,
                peak_bytes=measured.peak_bytes + delta,
                padding_bytes=padding,
                empty_units=empty,
                comm=frozen,
            )
        )
    return costs


def group_ranks(costs: Sequence[RankCost]) -> list[tuple[list[int], RankCost]]:
    """Ranks with equal numbers, as (ranks, their cost), in order of their first rank."""
    classes: dict[RankCost, list[int]] = {}
    for rank, cost in enumerate(costs):
        classes.setdefault(cost, []).append(rank)
    return [(ranks, cost) for cost, ranks in classes.items()]


def format_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8``."""
    parts: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ", ".join(parts)
