"""The core's tests on the library's parity trainer: an fsdp_core model and its data-parallel
reference train with :class:`fsdp_testing.parity.TrainingLoop` (SGD with momentum, lr 0.05) on
this package's models and batches, under the library's mixed precision reference and tolerances
(``docs/parity.md``). What stays here: the batches and loss of these models, the averaging of
the mixture of experts' shared layers, and :func:`full_params`, an independent oracle for the
core's own ``summon_full_params``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import FSDP, MixedPrecision
from fsdp_testing.parity import (
    FP32_TOLERANCE,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    Tolerance,
    TrainingLoop,
    compare_named,
    format_divergences,
)
from fsdp_testing.parity._reference import build_reference

from ._models import get_input

__all__ = [
    "FP32_TOLERANCE",
    "LOSS_TOLERANCE",
    "PARAM_TOLERANCE",
    "STEPS",
    "assert_same",
    "assert_same_losses",
    "full_params",
    "precision_reference",
    "reference",
    "train",
]

STEPS = 3
LR = 0.05


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP model, unsharded, by original name.

    Independent of ``summon_full_params``: one ``dist.all_gather`` of each unit's padded flat
    shard, split by the layout in [Note: sharded and unsharded parameters].
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params: dict[str, torch.Tensor] = {}
    for fsdp in FSDP.fsdp_modules(model):
        unit = fsdp._unit
        if unit is None:
            continue
        group = unit.groups.shard
        if group is None or unit.shard_world == 1:
            for sp in unit.params:
                params[names[id(sp.sharded)]] = sp.sharded.to_local().detach().clone()
            continue
        flat = unit._flat_shard.detach()
        blocks = [torch.empty_like(flat) for _ in range(unit.shard_world)]
        dist.all_gather(blocks, flat, group=group)  # hybrid: replicas hold the same shards
        gathered = torch.stack(blocks)  # (shard world, flat shard numel)
        offset = 0
        for sp in unit.params:
            block = gathered[:, offset : offset + sp.shard_numel]
            padded = block.reshape(sp.chunk_rows * unit.shard_world, *sp.rest)
            params[names[id(sp.sharded)]] = padded[: sp.rows].clone()
            offset += sp.shard_numel
    return params


class _Batches:
    """The workload of this package's models: the per-rank, per-step batch of ``kind`` and the
    loss ``mean(output ** 2)``; ``after_backward`` runs right after each backward."""

    def __init__(
        self, kind: str, rank: int, after_backward: Callable[[], None] | None = None
    ) -> None:
        self.kind, self.rank, self.after_backward = kind, rank, after_backward
        self.step = 0

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        batch = get_input(self.kind, self.rank, self.step)
        self.step += 1
        return (batch,)

    def get_loss(self, input: Any, output: torch.Tensor) -> torch.Tensor:
        return output.pow(2).mean()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.after_backward is not None:
            self.after_backward()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def train(
    model: nn.Module,
    kind: str,
    rank: int,
    *,
    after_backward: Callable[[], None] | None = None,
    steps: int = STEPS,
    save_load: bool = False,
) -> list[torch.Tensor]:
    """SGD with momentum for ``steps`` steps; return the per-step losses.

    With ``save_load`` (FSDP models only) every step ends with a full state dict save, zeroing
    every parameter through ``summon_full_params`` and loading the saved state dict.
    """
    roots = FSDP.fsdp_modules(model, root_only=True)
    loop = TrainingLoop(
        model,
        workload=_Batches(kind, rank, after_backward),
        lr=LR,
        mixed_precision=roots[0].mixed_precision if roots else None,
        device=_device(model),
    )
    return [loop.step(save_model=save_load) for _ in range(steps)]


def _train_reference(
    kind: str,
    model: nn.Module,
    rank: int,
    group: dist.ProcessGroup,
    policy: MixedPrecision | None,
    steps: int,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    plain = copy.deepcopy(model)
    reduce_dtype = torch.float32
    if policy is not None:
        reduce_dtype = policy.reduce_dtype or policy.param_dtype or torch.float32
    average = None
    if kind == "moe":
        # Experts are per-rank: the model averages only its shared layers' gradients, as the
        # engine does (in the reduce dtype: cast, pre-divide, sum, cast back).
        shared = [p for n, p in plain.named_parameters() if not n.startswith("expert.")]
        average = functools.partial(_average, shared, group, reduce_dtype)
    reference, round_gradients = build_reference(
        plain,
        process_group=group,
        device=_device(plain),
        ref_init_fn=(lambda body: body) if kind == "moe" else None,
        mixed_precision=policy,
    )
    loop = TrainingLoop(
        reference,
        workload=_Batches(kind, rank, average),
        lr=LR,
        mixed_precision=policy,
        device=_device(plain),
        after_backward=round_gradients,
    )
    losses = [loop.step() for _ in range(steps)]
    return losses, dict(loop.named_full_params())


def _average(params: list[nn.Parameter], group: dist.ProcessGroup, dtype: torch.dtype) -> None:
    world = dist.get_world_size(group)
    with torch.no_grad():
        for param in params:
            assert param.grad is not None
            grad = param.grad.to(dtype).div_(world)
            dist.all_reduce(grad, group=group)
            param.grad.copy_(grad)


def reference(
    kind: str, model: nn.Module, rank: int, group: dist.ProcessGroup, *, steps: int = STEPS
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and parameters of the data-parallel reference for ``model`` (unwrapped): DDP, or
    for ``moe`` the model averaging its shared layers itself."""
    return _train_reference(kind, model, rank, group, None, steps)


def precision_reference(
    kind: str,
    model: nn.Module,
    rank: int,
    group: dist.ProcessGroup,
    policy: MixedPrecision,
    *,
    steps: int = STEPS,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The library's mixed precision reference for ``policy`` (fp32 masters computing in
    ``param_dtype``, gradients averaged in the reduce dtype; see [Note: mixed precision parity]
    in ``fsdp_testing/parity/_reference.py``)."""
    assert policy.param_dtype is not None
    return _train_reference(kind, model, rank, group, policy, steps)


def assert_same(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    tolerance: tuple[float, float] | None,
    what: str,
) -> None:
    """The same names, dtypes and values: bitwise with ``tolerance=None``, else within
    ``(rtol, atol)``."""
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    _assert_close(list(expected.items()), [(n, actual[n]) for n in expected], tolerance, what)


def assert_same_losses(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    *,
    tolerance: tuple[float, float] | None,
    what: str,
) -> None:
    """Per-step losses as :func:`assert_same` compares tensors."""
    names = [f"loss at step {step}" for step in range(len(expected))]
    pairs = list(zip(names, actual, strict=True))
    _assert_close(list(zip(names, expected, strict=True)), pairs, tolerance, what)


def _assert_close(
    expected: list[tuple[str, torch.Tensor]],
    actual: list[tuple[str, torch.Tensor]],
    tolerance: tuple[float, float] | None,
    what: str,
) -> None:
    limits = Tolerance(*tolerance) if tolerance is not None else None
    found = compare_named(expected, actual, exact=limits is None, tolerance=limits)
    assert not found, f"{what} differs from the reference:\n{format_divergences(found)}"
