"""``fsdp_core.debug.suspend_hooks``: within the block both doors' forward hooks pass everything
through (no unshard, no collective, the modules see their local shards) while the user's hooks
on the same modules keep running, in their place; the composable door keeps the handles of the
hooks it registered; the block refuses to start inside a forward and nests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp_core import FSDP, events, fully_shard
from fsdp_core._composable._hooks import hooks_of
from fsdp_core.debug import suspend_hooks


class _Probe(nn.Linear):
    """A Linear whose forward records what it sees of its weight and returns its input."""

    def __init__(self) -> None:
        super().__init__(4, 3)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        self.seen.append(f"{type(weight).__name__}{tuple(weight.shape)}")
        return x


def _kind(weight: torch.Tensor) -> str:
    return "DTensor" if isinstance(weight, DTensor) else "full"


def _events_of(fn: Any) -> list[str]:
    seen: list[events.Event] = []
    with events.subscribe(seen.append):
        fn()
    return [type(e).__name__ for e in seen]


@pytest.mark.distributed(world_size=2)
def test_composable_door_hooks_pass_through_and_keep_their_place(rank, process_group):
    mesh = DeviceMesh.from_group(process_group, "cpu")
    model = nn.Sequential(_Probe(), nn.Linear(4, 4))
    probe = model[0]
    calls: list[str] = []
    # One user hook of each kind before fully_shard, one after: the door's hooks sit between.
    probe.register_forward_pre_hook(lambda m, a: calls.append("pre, registered first"))
    probe.register_forward_hook(lambda m, a, o: calls.append(f"post before: {_kind(m.weight)}"))
    fully_shard(probe, mesh=mesh)
    fully_shard(model, mesh=mesh)
    probe.register_forward_pre_hook(lambda m, a: calls.append("pre, registered last"))
    probe.register_forward_hook(lambda m, a, o: calls.append(f"post after: {_kind(m.weight)}"))
    hooks = hooks_of(probe)
    # Forward pre and post; state-dict save and load pre-hooks (reshard), load (full tensors).
    assert hooks is not None and len(hooks.handles) == 5
    assert all(isinstance(h, RemovableHandle) for h in hooks.handles)

    def forward() -> None:
        calls.clear()
        model(torch.randn(2, 4))

    # The door gathers before the user's pre-hooks, reshards between the user's forward hooks.
    eager = ["pre, registered first", "pre, registered last"]
    eager += ["post before: full", "post after: DTensor"]
    assert "Unshard" in _events_of(forward)
    assert calls == eager and probe.seen[-1] == "Parameter(3, 4)"
    with suspend_hooks(model):
        assert _events_of(forward) == []
        assert calls == [*eager[:2], "post before: DTensor", "post after: DTensor"]
        assert probe.seen[-1] == "DTensor(3, 4)"  # the local shard, as a DTensor
    _events_of(forward)
    assert calls == eager  # switched back on, each hook in its old place


class _Local(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.distributed(world_size=2)
def test_wrapper_door_forward_calls_the_module_directly(rank, process_group):
    model = FSDP(_Local(), process_group)
    probe = model.module.lin
    with torch.no_grad():  # no backward follows: the root reshards after forward
        model(torch.randn(2, 4))
    assert probe.seen == ["Parameter(3, 4)"]
    with suspend_hooks(model):
        assert _events_of(lambda: model(torch.randn(2, 4))) == []
    # The module sees its sharded parameter: a DTensor of the full shape whose local shard on
    # rank 0 holds 2 of the 3 rows, on rank 1 the last one.
    assert probe.seen[-1] == "DTensor(3, 4)"
    assert tuple(probe.weight.to_local().shape) == ((2, 1)[rank], 4)


@pytest.mark.distributed(world_size=2)
def test_blocks_nest_and_refuse_to_start_inside_a_forward(rank, process_group):
    mesh = DeviceMesh.from_group(process_group, "cpu")
    model = nn.Sequential(_Probe(), _Probe())
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with suspend_hooks(model):
        with suspend_hooks(model[0]):
            pass
        assert _events_of(lambda: model(torch.randn(2, 4))) == []  # the outer block holds
    errors: list[str] = []

    def enter(module: nn.Module, args: Any) -> None:
        try:
            with suspend_hooks(model):
                pass
        except RuntimeError as error:
            errors.append(str(error))

    model[1].register_forward_pre_hook(enter)
    model(torch.randn(2, 4))
    assert len(errors) == 1
    assert "FSDP instances ['<root>'] are inside a forward or backward" in errors[0]
