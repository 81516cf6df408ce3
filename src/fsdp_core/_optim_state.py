"""Optimizer state dicts keyed by parameter name: full, sharded or local, and back.

[Note: optimizer state dict]
An optimizer built on an FSDP model steps the sharded parameters, so its per-parameter state
tensors (``exp_avg``, ``momentum_buffer``, ...) are ``DTensor``s laid out like them (on both
doors), whose local parts have the shape of this rank's rows. ``optim_state_dict`` keys the
state by each parameter's name (``model.named_parameters()``, the unwrapped names) instead of
the optimizer's integer index, as torch's ``FSDP.optim_state_dict`` does, and converts every
state tensor shaped like the parameter's rows according to the model's state dict type:

- ``FULL_STATE_DICT``: the full tensor, gathered over the unit's group (one all-gather per
  tensor, in parameter order on every rank); ``rank0_only`` leaves the other ranks an empty
  dict;
- ``SHARDED_STATE_DICT``: a ``DTensor`` laid out like the parameter (``Shard(0)`` over the
  unit's group), so DCP saves and reshards it together with the model;
- ``LOCAL_STATE_DICT``: the local tensor as the optimizer holds it.

Scalars (``step``) and the state of parameters no unit owns stay as they are. Every rank must
call it: the gathers are collectives.

``optim_state_dict_to_load`` maps names back to the optimizer's indices and each state tensor
back to this rank's rows (a ``DTensor`` for a ``DTensor`` parameter): a ``DTensor`` laid out
like the parameter gives its local part, any other ``DTensor`` is gathered and sliced, a full
tensor is sliced; a tensor of neither shape raises, naming the parameter.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._param import ShardedParam, local_tensor
from ._runtime import FSDPState, states_in
from ._sharded_state_dict import same_layout, unit_dtensor
from ._unit import FSDPUnit
from .api import FullOptimStateDictConfig, StateDictType

__all__ = ["optim_state_dict", "optim_state_dict_to_load"]

_Owners = dict[int, tuple[ShardedParam, FSDPUnit]]


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter name, full, sharded or local as ``model``'s state
    dict type says (torch's ``FSDP.optim_state_dict``; see [Note: optimizer state dict]).
    Every rank must call it.

    Args:
        model: the FSDP (or ``fully_shard``) model ``optim`` steps.
        optim: the optimizer.
        optim_state_dict: ``optim.state_dict()`` (default ``None``: taken now).
        group: accepted for torch compatibility; each unit's own group is used.
    """
    source = optim.state_dict() if optim_state_dict is None else optim_state_dict
    states = _states(model, "optim_state_dict")
    kind = states[0].state_dict_settings.state_dict_type
    config = states[0].state_dict_settings.optim_state_dict_config
    names = _names(model, optim)
    owners = _owners(states)
    params = _params(optim)
    drop = (
        isinstance(config, FullOptimStateDictConfig) and config.rank0_only and dist.get_rank() != 0
    )
    state_out: dict[str, Any] = {}
    for index, per_param in sorted(source["state"].items()):
        param = params[index]
        found = owners.get(id(param))
        converted = {}
        for key, value in per_param.items():
            if found is not None and _is_rows(value, found[0]):
                value = _export(value, *found, kind)
            elif kind is StateDictType.FULL_STATE_DICT and isinstance(value, torch.Tensor):
                value = value.detach().clone()  # a full state dict is a snapshot (``step``)
            if isinstance(value, torch.Tensor) and config.offload_to_cpu:
                value = _to_cpu(value)
            converted[key] = value
        state_out[names[id(param)]] = converted
    if drop:
        return {}
    groups = [
        {**group, "params": [names[id(params[i])] for i in group["params"]]}
        for group in source["param_groups"]
    ]
    return {"state": state_out, "param_groups": groups}


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """What ``optim.load_state_dict`` takes, from an ``optim_state_dict`` result (full, or
    sharded after ``dcp.load``, or local), resharded to this rank's rows (torch's
    ``FSDP.optim_state_dict_to_load``; see [Note: optimizer state dict]).

    Args:
        model: the FSDP (or ``fully_shard``) model ``optim`` steps.
        optim: the optimizer to load into.
        optim_state_dict: the state keyed by parameter name.
        is_named_optimizer: not supported (default ``False``).
        load_directly: also call ``optim.load_state_dict`` with the result (default
            ``False``).
        group: accepted for torch compatibility; each unit's own group is used.
    """
    if is_named_optimizer:
        raise NotImplementedError(
            "FSDP.optim_state_dict_to_load(is_named_optimizer=True) is not supported: pass a "
            "torch.optim.Optimizer built on model.parameters()."
        )
    result = _to_load(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(result)
    return result


def _to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    states = _states(model, "optim_state_dict_to_load")
    names = _names(model, optim)
    owners = _owners(states)
    params = _params(optim)
    index_of = {names[id(p)]: i for i, p in enumerate(params)}
    unknown = sorted(set(osd["state"]) - set(index_of))
    if unknown:
        raise ValueError(
            f"optim_state_dict_to_load: the optimizer state names parameters {unknown} that "
            "this optimizer does not step. Build the optimizer over the same parameters as "
            "the one that was saved."
        )
    state_out: dict[int, Any] = {}
    for name, per_param in sorted(osd["state"].items(), key=lambda kv: index_of[kv[0]]):
        param = params[index_of[name]]
        found = owners.get(id(param))
        converted = {}
        for key, value in per_param.items():
            if found is not None and isinstance(value, torch.Tensor) and value.dim() > 0:
                value = _import(f"{name}.{key}", value, *found)
            elif isinstance(value, torch.Tensor):
                value = value.detach().clone()  # ``step``: not shared with the source dict
            converted[key] = value
        state_out[index_of[name]] = converted
    groups = [
        {**group, "params": [index_of[n] for n in group["params"]]} for group in osd["param_groups"]
    ]
    return {"state": state_out, "param_groups": groups}


def _states(model: nn.Module, api: str) -> list[FSDPState]:
    states = states_in(model)
    if not states:
        raise ValueError(
            f"FSDP.{api}: {type(model).__name__} contains no FSDP instance; pass the FSDP "
            "(or fully_shard) model the optimizer was built on."
        )
    return states


def _names(model: nn.Module, optim: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    stray = [i for i, p in enumerate(_params(optim)) if id(p) not in names]
    if stray:
        raise ValueError(
            f"FSDP.optim_state_dict: the optimizer's parameters {stray} (indices) are not "
            "parameters of the model; build the optimizer from model.parameters() after "
            "wrapping."
        )
    return names


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(chain.from_iterable(g["params"] for g in optim.param_groups))


def _owners(states: list[FSDPState]) -> _Owners:
    return {
        id(p.sharded): (p, state.unit)
        for state in states
        if state.unit is not None
        for p in state.unit.params
    }


def _is_rows(value: object, param: ShardedParam) -> bool:
    """Whether ``value`` is a state tensor shaped like ``param``'s local rows."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return tuple(local_tensor(value).shape) == (param.valid_rows, *param.rest)


def _export(value: torch.Tensor, param: ShardedParam, unit: FSDPUnit, kind: StateDictType) -> Any:
    local = local_tensor(value).detach()
    if kind is StateDictType.LOCAL_STATE_DICT:
        return local
    if kind is StateDictType.SHARDED_STATE_DICT:  # laid out like the parameter
        return unit_dtensor(unit, local, tuple(param.full_shape))
    return _gather_rows(local, param, unit)


def _gather_rows(local: torch.Tensor, param: ShardedParam, unit: FSDPUnit) -> torch.Tensor:
    """The full tensor (``param.full_shape``) whose rows ``local`` holds on this rank."""
    if unit.shard_world == 1:
        return local.clone()
    padded = local.new_zeros((param.chunk_rows, *param.rest))
    padded[: param.valid_rows].copy_(local)
    gathered = [torch.empty_like(padded) for _ in range(unit.shard_world)]
    dist.all_gather(gathered, padded.contiguous(), group=unit.groups.shard)
    return torch.cat(gathered)[: param.rows]


def _import(name: str, value: torch.Tensor, sharded: ShardedParam, unit: FSDPUnit) -> torch.Tensor:
    """``value`` (a saved state tensor) as the optimizer holds it for ``sharded`` on this
    rank: a ``DTensor`` laid out like the parameter."""
    from torch.distributed.tensor import DTensor

    local_shape = (sharded.valid_rows, *sharded.rest)
    rows = slice(sharded.start_row, sharded.start_row + sharded.valid_rows)
    if isinstance(value, DTensor):
        if tuple(value.shape) != tuple(sharded.full_shape):
            raise _shape_error(name, value, sharded)
        local = value.to_local() if same_layout(value, sharded) else value.full_tensor()[rows]
    elif tuple(value.shape) == tuple(sharded.full_shape):
        local = value[rows]
    elif tuple(value.shape) == local_shape:
        local = value
    else:
        raise _shape_error(name, value, sharded)
    local = local.to(device=sharded.padded_shard.device).clone()
    return unit_dtensor(unit, local, tuple(sharded.full_shape))


def _shape_error(name: str, value: torch.Tensor, param: ShardedParam) -> ValueError:
    return ValueError(
        f"optim_state_dict_to_load: optimizer state {name!r} has shape {tuple(value.shape)} "
        f"but the parameter's shape is {tuple(param.full_shape)} (this rank's rows: "
        f"{(param.valid_rows, *param.rest)}). The optimizer state must come from a model with "
        "the same parameter shapes: build the model with the checkpoint's configuration."
    )


def _to_cpu(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if value.device.type == "cpu":
        return value
    if isinstance(value, DTensor):
        return _dtensor_like(value, value.to_local().cpu())
    return value.cpu()


def _dtensor_like(like: Any, local: torch.Tensor) -> Any:
    """``local`` as this rank's part of a ``DTensor`` with ``like``'s mesh, placements, shape
    and stride."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
