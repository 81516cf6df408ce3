"""The planner's communication against the recorder's, bytes exact per collective family: every
row of ``fsdp-testing check``'s default matrix (180 rows, ``fsdp_core``) at world sizes 2 and
4, and the composable door's rows (2 ranks) and the hybrid rows on 2 x 2 (4 ranks).

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


@pytest.fixture
def planned(world_size: int) -> dict[str, dict[str, tuple[int, int]]]:
    """Every row's planned communication, ``label -> family -> (calls, bytes)``."""
    return {c.label: plan_comm(request_of(c, world_size)) for c in rows(world_size)}


def _measure(config: Config, ctx: Any) -> dict[str, tuple[int, int]]:
    from fsdp_testing.cli._measure import CollectiveLog
    from fsdp_testing.cli._rankwork import TrainingSetup

    sharded = TrainingSetup(config, ctx).lockstep.sharded
    sharded.step()  # the first step also records the units' order
    log = CollectiveLog()
    with log.watching():
        sharded.step()
    return log.totals()


@pytest.mark.distributed(world_size=[2, 4], timeout=600)
def test_planned_bytes_equal_the_recorder_on_every_row(
    rank, world_size, process_group, device, planned
):
    assert len(planned) == len(rows(world_size)) == 180 + 40  # every row has its plan
    ctx = SimpleNamespace(rank=rank, device=device, process_group=process_group)
    wrong = []
    for config in rows(world_size):
        measured = _measure(config, ctx)
        if measured != planned[config.label]:
            wrong.append(f"{config.label}: planned {planned[config.label]}, measured {measured}")
    assert not wrong, f"{len(wrong)} rows differ:\n" + "\n".join(wrong)
