"""A user's own sharded-training code: a ZeRO-2 data parallel wrapper on ``torch.distributed``
alone. ``examples/test_zero2_wrapper.py`` tests it with fsdp_testing; this file knows nothing of
the harness except :class:`ZeRO2Engine` at the end, which lets ``fsdp-testing check`` run its
matrix on the wrapper:

    cd examples && fsdp-testing check --engine zero2_wrapper:ZeRO2Engine \\
        --model zero2_wrapper:build --input-shape 4,16 --strategy SHARD_GRAD_OP

ZeRO stage 2 (Rajbhandari et al., 2020): every rank holds the full parameters, but gradients and
optimizer state are sharded. After each backward the gradients, flattened into one buffer, are
averaged with one reduce-scatter, so rank ``r`` keeps only its ``1/W`` slice of the averaged
gradient; the optimizer steps that slice of the parameters, and one all-gather brings every
rank's updated slice back into the full parameters.

Run as a script, it trains a few steps on 2 CPU processes and prints the losses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_testing.engines import CommVolume, RootOnlyEngine, UnitVolume


def _collective(family: str) -> Callable[..., Any]:
    # torch 2.13 renamed the single-tensor collectives ``*_single``; use whichever this torch
    # has, looked up at each call so that tools which patch torch.distributed see it.
    old = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}
    return getattr(dist, f"{family}_single", None) or getattr(dist, old[family])


def sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class ZeRO2(nn.Module):
    """Wraps ``module`` for ZeRO-2 data parallel training over ``process_group``.

    Train it as ``loss = f(model(x)); loss.backward(); model.step(); model.zero_grad()``.
    Every trainable parameter must receive a gradient in every backward (as DDP without
    ``find_unused_parameters``). Several backwards before a ``step()`` accumulate.

    Args:
        module: the model, the same on every rank (rank 0's values are broadcast).
        process_group: the ranks (default: the world).
        optimizer: builds the optimizer over this rank's slice (default: SGD, lr 0.05,
            momentum 0.9).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        optimizer: Callable[[Iterable[torch.Tensor]], Any] = sgd,
    ) -> None:
        super().__init__()
        self.module = module
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        source = dist.get_global_rank(self.group, 0)
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source, group=self.group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-numel // self.world_size)  # the flat buffer is padded to W slices
        flat = self._flatten([p.detach() for p in self.params])
        mine = flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        self.shard = mine.clone().requires_grad_(True)  # 1D: this rank's slice, what is stepped
        self.optimizer = optimizer([self.shard])
        self._ready = 0
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_gradient)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.shard_numel * self.world_size - flat.numel()))

    def _on_gradient(self, param: torch.Tensor) -> None:
        self._ready += 1
        if self._ready == len(self.params):  # the backward has produced every gradient
            self._ready = 0
            self.reduce_gradients()

    def average(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """Scales the flat gradient before the summing reduce-scatter: an average, as DDP."""
        return flat_grad.div_(self.world_size)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """One reduce-scatter of the flat gradients into this rank's slice, added to what
        earlier backwards left there (gradient accumulation); the full gradients are freed."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self.average(self._flatten(grads))
        reduced = torch.empty_like(self.shard)
        _collective("reduce_scatter")(reduced, flat, group=self.group)
        if self.shard.grad is None:
            self.shard.grad = reduced
        else:
            self.shard.grad += reduced
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Steps this rank's slice, then all-gathers every slice into the full parameters."""
        self.optimizer.step()
        full = torch.empty(self.shard_numel * self.world_size, dtype=self.shard.dtype)
        _collective("all_gather")(full, self.shard.detach(), group=self.group)
        offset = 0
        for param in self.params:
            param.copy_(full[offset : offset + param.numel()].view_as(param))
            offset += param.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        super().zero_grad(set_to_none)


def build() -> nn.Module:
    """The model the example trains: a small MLP (16 -> 32 -> 8)."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: 4 inputs and their targets, the same on every call."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 8, generator=generator)


def mse(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


class ZeRO2Engine(RootOnlyEngine):
    """:class:`ZeRO2` as an engine of ``fsdp-testing check`` and the reference models: one
    wrapper at the root (no nested units). It is ``SHARD_GRAD_OP`` (gradients and optimizer
    state sharded, parameters not) in full precision without offload; other rows are
    unavailable. The optimizer is the test's, over this rank's slice."""

    name = "zero2"
    unit_class = ZeRO2

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        strategy = getattr(fsdp_kwargs.get("sharding_strategy"), "name", "SHARD_GRAD_OP")
        if strategy != "SHARD_GRAD_OP" or fsdp_kwargs.get("cpu_offload") is not None:
            raise NotImplementedError(f"ZeRO2 is SHARD_GRAD_OP without offload, not {strategy}")
        if fsdp_kwargs.get("mixed_precision") is not None:
            raise NotImplementedError("ZeRO2 trains in full precision only")
        return ZeRO2(module, process_group)

    def make_optimizer(self, module: nn.Module, build: Callable[..., Any]) -> Any:
        assert isinstance(module, ZeRO2)
        module.optimizer = build([module.shard])
        return module  # module.step() steps the slice and gathers the parameters

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        assert isinstance(module, ZeRO2)
        flat_bytes = module.shard_numel * module.world_size * module.shard.element_size()
        unit = UnitVolume("", flat_bytes, flat_bytes, gathers=1, reduce_kind="reduce_scatter")
        return CommVolume("ZeRO-2: one flat buffer", (unit,))


def _demo(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = ZeRO2(build())
    for step in range(3):
        loss = mse(model, batch(step, rank))
        loss.backward()
        model.step()
        model.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} on rank 0")
    dist.destroy_process_group()


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_demo, args=(2, f"{tmp}/init"), nprocs=2)
