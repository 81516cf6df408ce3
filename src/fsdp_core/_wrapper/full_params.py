"""``summon_full_params``: full parameters (and gradients) exposed outside forward/backward.

[Note: summoned parameters]
Summoning never touches the unsharded parameters that forward/backward use. Each unit gathers
*new* full tensors in the parameters' original dtype (full precision even under mixed
precision, so state dicts and user edits see the real values), wraps them in temporary
``nn.Parameter``s and puts those into the module slots. On exit the slots get the sharded
parameters back; with ``writeback`` each rank first copies its rows of every temporary
(including changes made through ``.data``) into its shard, otherwise the temporaries are
dropped with whatever was written to them. Replicated units work the same way on a copy, so
``writeback=False`` discards writes there too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .. import _collectives
from .._runtime import FSDPState, state_of, states_in
from .._unit import FSDPUnit
from ..api import TrainingState

__all__ = ["apply_with_full_params", "summon_full_params"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    *,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """See ``FullyShardedDataParallel.summon_full_params`` and [Note: summoned parameters]."""
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: only rank 0 "
            "would hold the full parameters, so the other ranks' shards could not be written "
            "back consistently. Pass writeback=False with rank0_only=True."
        )
    states = states_in(module, root_only=not recurse)
    _validate_idle(states)
    units = [s.unit for s in states if s.unit is not None]
    materialize = not rank0_only or dist.get_rank() == 0
    summoned: list[tuple[FSDPUnit, list[nn.Parameter]]] = []
    for state in states:
        state.training_state = TrainingState.SUMMON_FULL_PARAMS
    try:
        with torch.no_grad():
            for unit in units:  # same order on every rank: the collectives pair up
                full = unit.gather_full_params()
                grads = _gather_full_grads(unit) if with_grads else [None] * len(full)
                if not materialize:
                    continue
                temps = []
                for p, tensor, grad in zip(unit.params, full, grads, strict=True):
                    temp = nn.Parameter(
                        tensor.cpu() if offload_to_cpu else tensor, requires_grad=p.requires_grad
                    )
                    if grad is not None:
                        temp.grad = grad.cpu() if offload_to_cpu else grad
                    temps.append(temp)
                unit.expose(temps)
                summoned.append((unit, temps))
        yield
    finally:
        for unit, temps in summoned:
            for p in unit.params:
                p.expose_sharded()
            if writeback:
                unit.write_back(temps)
        for state in states:
            state.training_state = TrainingState.IDLE


def apply_with_full_params(module: ModuleT, fn: Callable[[nn.Module], None]) -> ModuleT:
    """``nn.Module.apply(module, fn)`` with ``module``'s own unit summoned (``writeback``).

    Nested instances are reached through ``nn.Module.apply`` calling their own ``apply``, so
    each gathers its unit while ``fn`` runs on its subtree, as torch's FSDP1 does.
    """
    state = state_of(module)
    if state is None:
        raise AssertionError(f"[rank {dist.get_rank()}] apply_with_full_params needs FSDP")
    if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
        raise ValueError(  # torch's type and words
            "FullyShardedDataParallel.apply(fn) on the instance wrapping "
            f"{type(getattr(module, 'module', module)).__name__} was called inside "
            "summon_full_params of the same instance: it was expected to be in states "
            f"[{TrainingState.IDLE}] but current state is {state.training_state}. apply "
            "gathers the full parameters "
            "itself: call it outside the summon_full_params context, or inside it call fn "
            "on each module yourself "
            "(for m in module.modules(): fn(m)), which sees the summoned parameters."
        )
    with summon_full_params(module, recurse=False, writeback=True):
        nn.Module.apply(module, fn)
    return module


def _validate_idle(states: list[FSDPState]) -> None:
    busy = [s for s in states if s.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            "summon_full_params can only run between training steps, but FSDP instances "
            f"{[s.fqn or type(s.owner).__name__ for s in busy]} are in "
            f"{sorted({s.training_state.name for s in busy})}. Call it outside forward and "
            "backward, and do not nest it over the same instances."
        )
    unsharded = [s.fqn for s in states if s.unit is not None and s.unit.is_unsharded]
    if unsharded:
        raise RuntimeError(
            f"summon_full_params: units {unsharded} still hold unsharded parameters from a "
            "forward whose backward has not run. Run the backward first, or run that forward "
            "under torch.no_grad()."
        )


def _gather_full_grads(unit: FSDPUnit) -> list[torch.Tensor | None]:
    """Full gradients of every parameter of ``unit`` (``None`` where no rank has one).

    One all-reduce of a has-gradient mask and one all-gather of the padded gradient shards in
    the original dtype.
    """
    rows = [p.sharded_grad_rows() for p in unit.params]
    flat = torch.zeros(unit.flat_shard.numel(), dtype=unit.dtype, device=unit.device)
    has_grad = torch.tensor([g is not None for g in rows], dtype=torch.int32)
    offset = 0
    for p, grad in zip(unit.params, rows, strict=True):
        if grad is not None:
            flat[offset : offset + p.shard_numel].copy_(grad.reshape(-1))
        offset += p.shard_numel
    group = unit.groups.shard
    if group is None or unit.shard_world == 1:
        gathered = flat
    else:
        # Replicas hold the same reduced shards: gathering inside the shard group suffices.
        has_grad = has_grad.to(unit.device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
        numel = unit.shard_world * flat.numel()
        gathered = torch.empty(numel, dtype=unit.dtype, device=unit.device)
        _collectives.all_gather_flat(gathered, flat, group, unit=unit.name)
    blocks = gathered.view(unit.shard_world, -1)
    full: list[torch.Tensor | None] = []
    offset = 0
    for p, present in zip(unit.params, has_grad.tolist(), strict=True):
        block = blocks[:, offset : offset + p.shard_numel]
        full.append(p.full_from_gathered(block) if present else None)
        offset += p.shard_numel
    return full
