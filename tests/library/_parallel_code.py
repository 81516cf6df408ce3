"""Small model-parallel code of the two kinds the likely-cause tests plant bugs in, written on
plain ``torch.distributed`` as a user would: a Megatron-style tensor-parallel MLP (a
column-parallel linear, then a row-parallel one) and a two-stage GPipe schedule with blocking
``dist.send``/``dist.recv``. Each is checked by ``check_parity`` against a single-process
reference (``reference="local"``, every rank on the same batch)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# -- tensor parallel ----------------------------------------------------------------------------

HIDDEN = 64  # the column-parallel width: divides every world size the tests use (up to 64)


def build_mlp() -> nn.Sequential:
    """``0`` and ``6`` stay replicated, ``2`` is column-parallel, ``4`` row-parallel."""
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )


def same_batch(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of forward ``i``: tensor and pipeline parallel ranks share it."""
    generator = torch.Generator().manual_seed(100 + i)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def mse(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of ``full``'s weight and bias: its slice of the output features."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        rows = self.my_rows(full.out_features, dist.get_rank(group), dist.get_world_size(group))
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone())

    def my_rows(self, features: int, rank: int, world: int) -> slice:
        size = features // world
        return slice(rank * size, (rank + 1) * size)

    def copy_to_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyToParallel.apply(x, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.copy_to_parallel(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of ``full``'s weight (its slice of the input features); the bias is
    replicated and added after the all-reduce."""

    def __init__(self, full: nn.Linear, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        size = full.in_features // dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.weight = nn.Parameter(full.weight.detach()[:, rank * size : (rank + 1) * size].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromParallel.apply(F.linear(x, self.weight), self.group) + self.bias


class TensorParallelMLP(nn.Module):
    """:func:`build_mlp`'s model with layer 2 column-parallel and layer 4 row-parallel."""

    column_class: type[ColumnParallelLinear] = ColumnParallelLinear
    row_class: type[RowParallelLinear] = RowParallelLinear

    def __init__(self, module: nn.Sequential, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        layers = list(module)
        layers[2] = self.column_class(module[2], group)
        layers[4] = self.row_class(module[4], group)
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, under :func:`build_mlp`'s names: the shards all-gathered in
        rank order, the replicated ones as this rank holds them."""
        world = dist.get_world_size(self.group)
        sharded_dims = {"2.weight": 0, "2.bias": 0, "4.weight": 1}
        state = {}
        for name, param in self.layers.named_parameters():
            value = param.detach()
            if name in sharded_dims:
                parts = [torch.empty_like(value) for _ in range(world)]
                dist.all_gather(parts, value.contiguous(), group=self.group)
                value = torch.cat(parts, dim=sharded_dims[name])
            state[name] = value.clone()
        return state


# -- pipeline parallel --------------------------------------------------------------------------

MICRO_BATCHES = 2


def build_stages() -> nn.Sequential:
    """Stage 0 is ``0``-``1`` (rank 0), stage 1 is ``2``-``4`` (rank 1)."""
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


_STAGE_0 = 2  # the first module of stage 1


def _stage(model: nn.Sequential, index: int) -> nn.Sequential:
    return model[:_STAGE_0] if index == 0 else model[_STAGE_0:]


def stage_owner(name: str) -> int:
    """The rank that trains parameter ``name``."""
    return 0 if int(name.split(".")[0]) < _STAGE_0 else 1


class GPipe:
    """A two-stage GPipe schedule over ``MICRO_BATCHES`` micro-batches: every forward, then
    every backward; activations and their gradients cross with blocking ``dist.send`` and
    ``dist.recv``. The model is whole on both ranks; each rank trains its stage only (the other
    stage's parameters get no gradient, so the optimizer leaves them alone).

    Args:
        group: the two ranks.
        accum_steps: ``check_parity``'s forwards per optimizer step (each loss is divided by
            the micro-batches and by this).
    """

    def __init__(self, group: dist.ProcessGroup, *, accum_steps: int = 1) -> None:
        self.group = group
        self.accum_steps = accum_steps
        self.rank = dist.get_rank(group)
        self.peer = dist.get_global_rank(group, 1 - self.rank)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's loss."""
        return loss / (MICRO_BATCHES * self.accum_steps)

    def send_input_gradient(self, h: torch.Tensor) -> None:
        assert h.grad is not None
        dist.send(h.grad.contiguous(), dst=self.peer)

    def receive_output_gradient(self, out: torch.Tensor) -> None:
        grad = torch.empty_like(out)
        dist.recv(grad, src=self.peer)
        out.backward(grad)

    def step(self, model: nn.Sequential, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``check_parity``'s ``step_fn``: forward, loss and backward of one batch."""
        inputs, targets = batch
        stage = _stage(model, self.rank)
        loss = torch.zeros(())
        if self.rank == 0:
            outs = []
            for x in inputs.chunk(MICRO_BATCHES):
                out = stage(x)
                dist.send(out.detach().contiguous(), dst=self.peer)
                outs.append(out)
            for out in outs:
                self.receive_output_gradient(out)
            dist.recv(loss, src=self.peer)
            return loss
        received, losses = [], []
        for y in targets.chunk(MICRO_BATCHES):
            h = torch.empty(y.shape[0], model[_STAGE_0].in_features)
            dist.recv(h, src=self.peer)
            h.requires_grad_(True)
            received.append(h)
            losses.append(F.mse_loss(stage(h), y))
        for h, micro_loss in zip(received, losses, strict=True):
            self.scale(micro_loss).backward()
            self.send_input_gradient(h)
        loss = torch.stack([m.detach() for m in losses]).mean()
        dist.send(loss, dst=self.peer)
        return loss

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter as its owner holds it (one broadcast each)."""
        state = {}
        for name, param in model.named_parameters():
            value = param.detach().clone()
            dist.broadcast(
                value, src=dist.get_global_rank(self.group, stage_owner(name)), group=self.group
            )
            state[name] = value
        return state
