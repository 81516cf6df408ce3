"""What ``fsdp-testing plan`` prints: the configuration, the communication per step, where the
peak is, and one table row per class of identical ranks (a rich table on a terminal, plain
lines elsewhere: [Note: plain output] in ``_render.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._plan_cost import COMM_FAMILIES, format_ranks, group_ranks
from ._render import echo, print_table

if TYPE_CHECKING:
    from rich.console import Console

    from .plan import Plan

__all__ = ["format_bytes", "plan_rows", "print_plan"]

_HEADERS = (
    "ranks",
    "count",
    "params",
    "grads",
    "optim",
    "padding",
    "empty units",
    "peak",
    "step adds",
)
_FAMILY = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
}


def format_bytes(value: int) -> str:
    """Bytes with a binary unit and three significant digits: ``1.50 GiB``, ``512 B``."""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{value} B"
            return f"{size:.3g} {unit}" if abs(size) >= 1 else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.3g} TiB"  # unreachable: GiB is the last unit


def plan_rows(plan: Plan) -> list[list[str]]:
    """One row per class of identical ranks (see :data:`_HEADERS`)."""
    step_adds = plan.measured.step_adds
    rows = []
    for ranks, cost in group_ranks(plan.ranks):
        rows.append(
            [
                format_ranks(ranks),
                str(len(ranks)),
                format_bytes(cost.param_bytes),
                format_bytes(cost.grad_bytes),
                format_bytes(cost.optim_bytes),
                format_bytes(cost.padding_bytes),
                str(cost.empty_units),
                format_bytes(cost.peak_bytes),
                format_bytes(step_adds),
            ]
        )
    return rows


def _comm_line(plan: Plan) -> str:
    parts = []
    comm = dict(plan.ranks[0].comm)
    for family in COMM_FAMILIES:
        calls = plan.comm_calls.get(family, 0)
        if not calls:
            parts.append(f"{_FAMILY[family]} -")
            continue
        sizes = "/".join(str(s) for s in plan.comm_groups.get(family, ())) or "?"
        parts.append(
            f"{_FAMILY[family]} {calls} calls, {comm[family]:,} B "
            f"({format_bytes(comm[family])}) in groups of {sizes} ranks"
        )
    return "comm per step, every rank: " + "; ".join(parts)


def print_plan(console: Console, plan: Plan) -> None:
    """The plan, for people. ``--json`` has every rank's exact numbers."""
    request = plan.request
    mesh = f" as {request.mesh[0]} x {request.mesh[1]}" if request.mesh else ""
    echo(
        console,
        f"fsdp-testing plan: {request.model.text} on {request.world_size} ranks{mesh}, "
        f"{request.strategy}, prefetch {request.prefetch}, mp {request.mp}, offload "
        f"{'on' if request.offload else 'off'}, {request.engine}, optimizer {request.optim}, "
        f"{request.backend}",
    )
    echo(
        console,
        f"model: {plan.numel:,} parameters ({plan.trainable:,} trainable) in {plan.units} units",
    )
    echo(console, _comm_line(plan))
    measured = plan.measured
    echo(
        console,
        f"peak at {measured.peak_at or 'the start of the step'}; at most "
        f"{measured.max_units_unsharded} units unsharded at once; a step adds "
        f"{format_bytes(measured.step_adds)} to what stays between steps",
    )
    print_table(console, _HEADERS, plan_rows(plan))
    echo(
        console,
        "params, grads: sharded, padding included · optim: the optimizer's state · padding: "
        "zero rows in params · empty units: units this rank holds no row of · peak: all a rank "
        "holds at the step's worst point · step adds: peak minus what stays between steps",
        style="dim",
    )
    for note in plan.notes:
        echo(console, f"note: {note}", style="yellow")
    echo(console, f"planned in {plan.seconds:.1f} s")
