"""Train an fsdp_core model next to a data-parallel reference and compare them."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp_core import FSDP

from ._models import get_input

STEPS = 3


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP model, unsharded, by original name."""
    names = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, torch.Tensor] = {}
    for fsdp in FSDP.fsdp_modules(model):
        unit = fsdp._unit
        if unit is None:
            continue
        for sp in unit.params:
            name = names[id(sp.sharded)]
            if unit.replicate:
                params[name] = sp.sharded.detach().clone()
                continue
            shards = [torch.empty_like(sp.padded_shard) for _ in range(unit.group_size)]
            dist.all_gather(shards, sp.padded_shard.detach().contiguous(), group=unit.group)
            params[name] = torch.cat(shards)[: sp.rows].clone()
    return params


def train(
    model: nn.Module,
    kind: str,
    rank: int,
    *,
    after_backward: Callable[[], None] | None = None,
    steps: int = STEPS,
) -> list[torch.Tensor]:
    """SGD with momentum for ``steps`` steps; return the per-step losses."""
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        out = model(get_input(kind, rank, step))
        loss = out.pow(2).mean()
        loss.backward()
        if after_backward is not None:
            after_backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def reference(
    kind: str, model: nn.Module, rank: int, group: dist.ProcessGroup, *, steps: int = STEPS
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and parameters of the data-parallel reference for ``model`` (unwrapped)."""
    model = copy.deepcopy(model)
    if kind != "moe":
        ddp = DDP(model, process_group=group)
        return train(ddp, kind, rank, steps=steps), _named(model)

    # Experts are per-rank: average only the shared parameters' gradients, as DDP would
    # (pre-divide by the world size, then sum).
    world = dist.get_world_size(group)
    shared = [p for n, p in model.named_parameters() if not n.startswith("expert.")]

    def reduce_shared() -> None:
        for p in shared:
            assert p.grad is not None
            p.grad.div_(world)
            dist.all_reduce(p.grad, group=group)

    return train(model, kind, rank, after_backward=reduce_shared, steps=steps), _named(model)


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, exact: bool, what: str
) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for name, value in expected.items():
        _assert_close(actual[name], value, exact=exact, what=f"{what}: {name}")


def assert_same_losses(
    actual: list[torch.Tensor], expected: list[torch.Tensor], *, exact: bool, what: str
) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        _assert_close(a, e, exact=exact, what=f"{what}: loss at step {step}")


def _assert_close(a: torch.Tensor, e: torch.Tensor, *, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(a, e), f"{what} differs: max |diff| {(a - e).abs().max().item()}"
    else:
        # Gloo sums the contributions of more than two ranks in a different order for
        # reduce-scatter than for DDP's all-reduce, so fp32 results differ in the last bits.
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=what)
