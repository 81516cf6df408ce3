"""The planner's communication against the recorder's, bytes exact per collective family: every
row of ``fsdp-testing check``'s default matrix (180 rows, ``fsdp_core``) at world sizes 2 and
4, and the composable door's rows (2 ranks) and the hybrid rows on 2 x 2 (4 ranks): 220 rows
per world size, about two minutes on two cores, so marked ``slow`` (``--run-slow``). The
default suite checks a representative part (:func:`representative`: every model meets every
value of every other axis, 15 and 25 rows at world sizes 2 and 4).

The plans are made in the pytest process (a fake world per row, ``plan_comm``: the same
communication as ``make_plan``, see ``test_plan.py``); one launch per world size then runs
every row on gloo ranks as ``check`` does (:class:`TrainingSetup`: the row's reference model,
engine and options) and counts the collectives of its second step with the recorder check
uses (:class:`CollectiveLog`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fsdp_testing.cli._matrix import DEFAULTS, HYBRID_GRID, Config, build_matrix
from fsdp_testing.cli._plan_args import PlanRequest, parse_model
from fsdp_testing.cli.plan import plan_comm

DEFAULT_ROWS = build_matrix(dict(DEFAULTS))
_ALL_MODELS = DEFAULTS["model"]
COMPOSABLE_ROWS = build_matrix(
    {
        "engine": ("fsdp_core_fully_shard",),
        "model": _ALL_MODELS,
        "strategy": ("FULL_SHARD", "SHARD_GRAD_OP"),
        "prefetch": ("BACKWARD_PRE",),
        "offload": ("off", "on"),
        "mp": ("off", "bf16/fp32"),
    }
)
HYBRID_ROWS = build_matrix(
    {
        "engine": ("fsdp_core", "fsdp_core_fully_shard"),
        "model": _ALL_MODELS,
        "strategy": ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
        "prefetch": ("BACKWARD_PRE",),
        "offload": ("off",),
        "mp": ("off", "bf16/fp32"),
    }
)


def rows(world_size: int) -> list[Config]:
    extra = COMPOSABLE_ROWS if world_size == 2 else HYBRID_ROWS
    return DEFAULT_ROWS + extra


def request_of(config: Config, world_size: int) -> PlanRequest:
    """The ``fsdp-testing plan`` options of one check row."""
    return PlanRequest(
        model=parse_model(config.model),
        world_size=world_size,
        mesh=HYBRID_GRID if config.hybrid else None,
        strategy=config.strategy,
        prefetch=config.prefetch,
        mp=config.mp,
        offload=config.offload == "on",
        engine=config.engine,
    )


def representative(configs: list[Config]) -> list[Config]:
    """Rows of ``configs`` in which every model meets every value of every other axis that
    ``configs`` has (a greedy cover, in matrix order)."""

    def pairs(config: Config) -> set[tuple[str, str, str]]:
        axes = ("strategy", "prefetch", "offload", "mp", "engine")
        return {(config.model, axis, getattr(config, axis)) for axis in axes}

    needed = set().union(*(pairs(c) for c in configs))
    chosen = []
    while needed:
        best = max(configs, key=lambda c: len(pairs(c) & needed))
        chosen.append(best)
        needed -= pairs(best)
    return [c for c in configs if c in chosen]


def plans(configs: list[Config], world_size: int) -> dict[str, dict[str, tuple[int, int]]]:
    """Every row's planned communication, ``label -> family -> (calls, bytes)``."""
    return {c.label: plan_comm(request_of(c, world_size)) for c in configs}


def test_representative_rows_cover_every_pairing():
    for world_size in (2, 4):
        full, part = rows(world_size), representative(rows(world_size))
        assert len(part) < len(full) // 5
        for axis in ("strategy", "prefetch", "offload", "mp", "engine"):
            every = {(c.model, getattr(c, axis)) for c in full}
            assert {(c.model, getattr(c, axis)) for c in part} == every, axis


def _measure(config: Config, ctx: Any) -> dict[str, tuple[int, int]]:
    from fsdp_testing.cli._measure import CollectiveLog
    from fsdp_testing.cli._rankwork import TrainingSetup

    sharded = TrainingSetup(config, ctx).lockstep.sharded
    sharded.step()  # the first step also records the units' order
    log = CollectiveLog()
    with log.watching():
        sharded.step()
    return log.totals()


def _compare(configs: list[Config], planned: dict[str, Any], ctx: Any) -> None:
    assert len(planned) == len(configs)  # every row has its plan
    wrong = []
    for config in configs:
        measured = _measure(config, ctx)
        if measured != planned[config.label]:
            wrong.append(f"{config.label}: planned {planned[config.label]}, measured {measured}")
    assert not wrong, f"{len(wrong)} rows differ:\n" + "\n".join(wrong)


# The plans are made in the parent (the planner makes its own fake world, which a rank with a
# process group cannot), for both world sizes: a fixture that requests world_size would run on
# the ranks.
@pytest.fixture(scope="module")
def planned_part() -> dict[int, dict[str, dict[str, tuple[int, int]]]]:
    return {ws: plans(representative(rows(ws)), ws) for ws in (2, 4)}


@pytest.fixture(scope="module")
def planned_all() -> dict[int, dict[str, dict[str, tuple[int, int]]]]:
    return {ws: plans(rows(ws), ws) for ws in (2, 4)}


@pytest.mark.distributed(world_size=[2, 4], timeout=300)
def test_planned_bytes_equal_the_recorder_on_representative_rows(
    rank, world_size, process_group, device, planned_part
):
    ctx = SimpleNamespace(rank=rank, device=device, process_group=process_group)
    _compare(representative(rows(world_size)), planned_part[world_size], ctx)


@pytest.mark.slow
@pytest.mark.distributed(world_size=[2, 4], timeout=600)
def test_planned_bytes_equal_the_recorder_on_every_row(
    rank, world_size, process_group, device, planned_all
):
    assert len(rows(world_size)) == 180 + 40
    ctx = SimpleNamespace(rank=rank, device=device, process_group=process_group)
    _compare(rows(world_size), planned_all[world_size], ctx)
