"""What a unit's reduction keeps alive (see [Note: overlap on the CPU] in
``fsdp_core/_overlap.py``): the unsharded gradients are let go once they are copied into the
reduce input, before the reduce-scatter is issued (gloo copies its input there, so a third copy
would coexist with both), and the engine keeps no reference to the input of a reduction in
flight (the process group holds what it still reads): the input goes back to the root's staging
buffers (see [Note: staging buffers on the CPU] in ``fsdp_core/_staging.py``), so at a later
all-gather it lives on only as that all-gather's output or as an idle staging buffer; after
the steps only the idle staging buffers remain, and once the model is let go, nothing."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_core import FSDP, BackwardPrefetch, _collectives, fully_shard
from fsdp_core._param import ShardedParam
from fsdp_core._runtime import states_in
from fsdp_core._staging import StagingBuffers
from fsdp_core.debug import set_cpu_overlap


class Chain(nn.Module):
    """Four layers, so that a backward prefetch is issued while a reduction is in flight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _wrapper(group: dist.ProcessGroup) -> nn.Module:
    model = Chain()
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(layer, group, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    return FSDP(model, group, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)


def _composable(group: dist.ProcessGroup) -> nn.Module:
    model = Chain()
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _staging_of(model: nn.Module) -> StagingBuffers:
    staging = next(s.unit.staging for s in states_in(model) if s.unit is not None)
    assert staging is not None
    return staging


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("door", ["wrapper", "fully_shard"])
def test_a_reduction_lets_go_of_the_gradients_and_of_its_input(rank, process_group, door, overlap):
    model = (_wrapper if door == "wrapper" else _composable)(process_group)
    set_cpu_overlap(model, enabled=overlap)
    grads: list[StorageWeakRef] = []  # every unsharded gradient a reduction took
    inputs: list[tuple[StorageWeakRef, int]] = []  # every reduce-scatter's input, and where
    problems: list[str] = []
    held = weakref.ref(model)  # so that the model can be let go at the end
    take = ShardedParam.take_unreduced_grad
    scatter = getattr(dist, _collectives._REDUCE_SCATTER)
    gather = getattr(dist, _collectives._ALL_GATHER)

    def taking(param: ShardedParam) -> torch.Tensor | None:
        grad = take(param)
        if grad is not None:
            grads.append(StorageWeakRef(grad.untyped_storage()))
        return grad

    def scattering(output, full, *args, **kwargs):
        alive = sum(not ref.expired() for ref in grads)
        if alive:
            problems.append(f"{alive} unsharded gradient(s) alive at a reduce-scatter")
        inputs.append((StorageWeakRef(full.untyped_storage()), full.data_ptr()))
        # The backend gets a copy, so that only the engine's own references keep the input.
        return scatter(output, full.clone(), *args, **kwargs)

    def gathering(output, shard, *args, **kwargs):
        reused = {output.data_ptr(), *(b.data_ptr() for b in _staging_of(held()).idle())}
        alive = sum(not ref.expired() and at not in reused for ref, at in inputs)
        if alive:
            problems.append(f"{alive} reduce input(s) alive at an all-gather")
        return gather(output, shard, *args, **kwargs)

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        mock.patch.object(ShardedParam, "take_unreduced_grad", taking),
        mock.patch.object(dist, _collectives._REDUCE_SCATTER, scattering),
        mock.patch.object(dist, _collectives._ALL_GATHER, gathering),
    ):
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
    # Per step: one reduce-scatter per layer (the root has no parameters of its own), two
    # gradients each; with overlap the backward prefetch of layers.0 and layers.1 each is issued
    # while the reduce-scatter of the layer two after it is in flight.
    assert (len(inputs), len(grads)) == (3 * 4, 3 * 8)
    assert problems == []
    # Only the root's idle staging buffers outlive the steps.
    idle = {b.data_ptr() for b in _staging_of(model).idle()}
    assert all(ref.expired() for ref in grads)
    assert all(ref.expired() or at in idle for ref, at in inputs)
    # And nothing outlives the model.
    del model, optim
    gc.collect()
    assert [at for ref, at in inputs if not ref.expired()] == []
