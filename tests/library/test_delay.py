"""The delayed models: each delay fires where it says, for every engine.

Each test logs, per rank, the sleeps of :func:`fsdp_testing.patching.delays.sleep_ms` and the calls
the delay is meant to precede (reduce-scatters, reshards), through the patching primitives, and
asserts the order; so they do not depend on how fast the machine is. A lower bound on the wall
time confirms that the sleeps are real.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_testing.patching.delays as delay_module
from fsdp_testing.engines import PatchTarget, use_engine
from fsdp_testing.models import (
    DEVICEInitMode,
    FSDPInitMode,
    MixtureOfExperts,
    NestedWrappedModuleWithDelay,
)
from fsdp_testing.patching import patch_all_reduce, patch_reduce_scatter, patch_reshard, patched

ENGINES = ["fsdp_core", "torch_fsdp1", "torch_fsdp2"]
CPU = torch.device("cpu")
AFTER_LOSS_MS = 30
BEFORE_REDUCTION_MS = 20
BEFORE_FREE_MS = 10

Log = list[Any]


@contextmanager
def _logged_sleeps(log: Log) -> Iterator[None]:
    """Within the block, this rank's ``sleep_ms`` calls append ``("sleep", ms)``, then sleep."""

    def sleep_ms(milliseconds: float, device: torch.device) -> None:
        log.append(("sleep", milliseconds))
        call_next(milliseconds, device)

    with patched(PatchTarget(delay_module, "sleep_ms"), sleep_ms, barrier=False) as call_next:
        yield


def _assert_each_preceded_by_sleep(log: Log, event: str, milliseconds: int) -> int:
    """Asserts that every ``event`` in ``log`` comes right after a sleep of ``milliseconds``;
    returns how many there were (at least one)."""
    positions = [i for i, entry in enumerate(log) if entry == event]
    assert positions, f"no {event} was logged: {log}"
    unslept = [i for i in positions if i == 0 or log[i - 1] != ("sleep", milliseconds)]
    assert not unslept, f"{event} at {unslept} not right after a {milliseconds} ms sleep: {log}"
    return len(positions)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2, mode="thread")
def test_delays_fire_after_the_loss_and_before_every_reduce_scatter(
    engine_name, rank, process_group
):
    with use_engine(engine_name):
        model = NestedWrappedModuleWithDelay.init(
            process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            delay_after_loss_ms=AFTER_LOSS_MS,
            delay_before_reduction_ms=BEFORE_REDUCTION_MS,
            device=CPU,
        )
    log: Log = []

    def reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        log.append("reduce_scatter")
        return rs_next(output, input, **kwargs)

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        log.append("all_reduce")
        return ar_next(*args, **kwargs)

    inputs = model.get_input(CPU)
    with (
        _logged_sleeps(log),
        patch_reduce_scatter(reduce_scatter) as rs_next,
        patch_all_reduce(all_reduce) as ar_next,
    ):
        output = model(*inputs)
        log.append("forward")
        loss = model.get_loss(inputs, output)
        log.append("loss")
        start = time.perf_counter()
        model.run_backward(loss)
        backward_s = time.perf_counter() - start
    # The loss delay: one sleep between forward and loss, none in forward (where fsdp_core's
    # first step all-reduces to check the collective order, undelayed).
    start_of_loss = log.index("forward")
    assert log[start_of_loss : log.index("loss") + 1] == [
        "forward",
        ("sleep", AFTER_LOSS_MS),
        "loss",
    ], log
    assert set(log[:start_of_loss]) <= {"all_reduce"}, log
    # The reduction delay: every reduce-scatter (whichever spelling the engine calls) sleeps
    # first, and so does every all-reduce (fsdp_core's first step checks the collective order
    # with one before each reduce-scatter).
    backward = log[log.index("loss") + 1 :]
    count = _assert_each_preceded_by_sleep(backward, "reduce_scatter", BEFORE_REDUCTION_MS)
    if "all_reduce" in backward:
        count += _assert_each_preceded_by_sleep(backward, "all_reduce", BEFORE_REDUCTION_MS)
    assert backward.count(("sleep", BEFORE_REDUCTION_MS)) == count, backward
    assert backward_s >= count * BEFORE_REDUCTION_MS / 1000
    # Outside run_backward the collectives are not delayed.
    log.clear()
    with _logged_sleeps(log):
        dist.all_reduce(torch.ones(1), group=process_group)
    assert log == []


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.distributed(world_size=2)  # process ranks: each builds its own one-rank group
def test_mixture_of_experts_delays_before_every_reshard(engine_name, rank, process_group):
    with use_engine(engine_name):
        model = MixtureOfExperts.init(
            process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
            delay_before_free_ms=BEFORE_FREE_MS,
            device=CPU,
        )
    log: Log = []

    def reshard(*args: Any, **kwargs: Any) -> Any:
        log.append("reshard")
        return call_next(*args, **kwargs)

    inputs = model.get_input(CPU)
    with _logged_sleeps(log), patch_reshard(reshard, engine=engine_name) as call_next:
        output = model(*inputs)
        log.append("forward")
        loss = model.get_loss(inputs, output)
        log.append("loss")
        model.run_backward(loss)
    # Forward: FSDP1/FSDP2 call their reshard for both units (roots, as the root module is not
    # sharded), fsdp_core does not; backward: every engine frees both units.
    backward = log[log.index("loss") + 1 :]
    assert _assert_each_preceded_by_sleep(backward, "reshard", BEFORE_FREE_MS) >= 2
    forward = log[: log.index("forward")]
    assert forward.count("reshard") == (0 if engine_name == "fsdp_core" else 2), forward
    if engine_name != "fsdp_core":
        _assert_each_preceded_by_sleep(forward, "reshard", BEFORE_FREE_MS)
    assert log[log.index("forward") : log.index("loss") + 1] == ["forward", "loss"]
    assert set(forward + backward) == {"reshard", ("sleep", BEFORE_FREE_MS)}, log
