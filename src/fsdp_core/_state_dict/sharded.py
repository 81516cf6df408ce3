"""Sharded and local state dicts of the wrapper door: each rank saves and loads its shards.

[Note: sharded state dict]
``SHARDED_STATE_DICT`` gives every parameter a unit owns as a ``DTensor`` under the unwrapped
name, laid out like the sharded parameter itself (see [Note: the wrapper's DTensor parameters]
in ``_dtensor_layout``): the local rows of the sharded parameter (sharing its storage, so
``dcp.load`` into the dict writes the shards in place) with ``Shard(0)`` placement on a 1-D
``DeviceMesh`` of the unit's shard group (``Replicate()`` on its replicate group for
``NO_SHARD``, both on a 2-D mesh for hybrid sharding). The ``DTensor`` carries the global shape,
so DCP (``torch.distributed.checkpoint``) can write it at one world size and read it back at
another, and a checkpoint of the composable door (whose parameters are such ``DTensor``s
already) loads into the wrapper and back. Buffers and ignored parameters are plain tensors
(every rank holds the same), buffers in the dtype they had at wrap time.

Loading takes, per parameter, a ``DTensor`` laid out like the parameter (its local rows are
copied into the shard), any other ``DTensor`` of the full shape (gathered with
``full_tensor()``, a collective, then this rank's rows taken) or a full plain tensor. A shape
that differs from the parameter's raises, naming the parameter.

``LOCAL_STATE_DICT`` is torch's FSDP1 meaning: each unit's flat local shard under
``<module>._flat_param`` (a ``DTensor`` over the unit's group whose local part is this rank's
padded flat shard, so DCP can save it) plus the buffers. Its layout depends on the world size
and the wrapping, so it loads only into the same configuration; use ``SHARDED_STATE_DICT`` to
reshard.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .._param import ShardedParam, _contiguous_stride, local_tensor
from .._runtime import FSDPState, clean_fqn, state_of, states_in
from .._unit import FSDPUnit
from .full import (
    _buffer_orig_dtypes,
    _plain_state_dicts,
    copy_metadata,
    give_metadata,
    saved_entry,
    validate_idle,
)

__all__ = [
    "FLAT_PARAM",
    "load_sharded_state_dict",
    "same_layout",
    "sharded_state_dict",
    "unit_dtensor",
]

FLAT_PARAM = "_flat_param"  # torch FSDP1's key of a unit's flat shard in a local state dict


def unit_dtensor(unit: FSDPUnit, local: torch.Tensor, shape: tuple[int, ...]) -> Any:
    """``local`` (this rank's dim-0 rows) as a ``DTensor`` of global ``shape`` laid out like
    ``unit``'s parameters (on their mesh, with their placements; see [Note: the wrapper's
    DTensor parameters] in ``_param``)."""
    from torch.distributed.tensor import DTensor

    layout = unit.params[0].layout
    if layout is None:
        raise AssertionError(f"[rank {dist.get_rank()}] unit {unit.name} shows no DTensors")
    return DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(torch.Size(shape)),
    )


def sharded_state_dict(module: nn.Module, prefix: str = "", *, local: bool = False) -> Any:
    """The sharded (or, with ``local``, the local) state dict of the FSDP instance ``module``.

    See [Note: sharded state dict].
    """
    own = _own_state(module)
    states = states_in(module)
    validate_idle("state_dict", states)
    offload = own.state_dict_settings.state_dict_config.offload_to_cpu
    owners = _param_owners(states)
    flat_keys = _flat_param_keys(module, prefix, states) if local else {}
    with _plain_state_dicts(module):
        raw = nn.Module.state_dict(module, prefix=prefix, keep_vars=True)
    orig_dtypes = _buffer_orig_dtypes(module, prefix)
    result: OrderedDict[str, Any] = OrderedDict()
    for key, value in raw.items():
        name = clean_fqn(key)
        found = owners.get(id(value))
        if found is not None:
            param, unit = found
            if local:
                flat_key = flat_keys.pop(id(unit), None)
                if flat_key is not None:  # where the unit's first parameter would be
                    result[flat_key] = _flat_shard_dtensor(unit, offload)
                continue
            rows = local_tensor(param.sharded).detach()  # shares the shard's storage
            result[name] = unit_dtensor(unit, rows.cpu() if offload else rows, param.full_shape)
            continue
        result[name] = saved_entry(value, orig_dtypes.get(name), offload)
    for unit_id, flat_key in flat_keys.items():  # units none of whose slots are in the dict
        unit = next(u for _, u in owners.values() if id(u) == unit_id)
        result[flat_key] = _flat_shard_dtensor(unit, offload)
    copy_metadata(raw, result)
    return result


def load_sharded_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True, local: bool = False
) -> _IncompatibleKeys:
    """Load a sharded (or local) state dict into the FSDP instance ``module``.

    See [Note: sharded state dict].
    """
    _own_state(module)
    states = states_in(module)
    validate_idle("load_state_dict", states)
    owners = _param_owners(states)
    with _plain_state_dicts(module):
        raw = nn.Module.state_dict(module, keep_vars=True)
    real_names = {clean_fqn(k): k for k in raw}
    params = {clean_fqn(k): owners[id(v)] for k, v in raw.items() if id(v) in owners}
    flat_keys = _flat_param_keys(module, "", states) if local else {}
    units = {key: next(u for _, u in owners.values() if id(u) == i) for i, key in flat_keys.items()}
    handled: set[str] = set()
    rest: OrderedDict[str, Any] = OrderedDict()
    with torch.no_grad():
        for key, value in state_dict.items():
            if local and key in units:
                _load_flat_shard(key, units[key], value)
                handled.add(key)
            elif not local and key in params:
                _load_param(key, params[key][0], value)
                handled.add(key)
            else:
                rest[real_names.get(key, key)] = value
    give_metadata(module, state_dict, rest)
    with _plain_state_dicts(module):
        result = nn.Module.load_state_dict(module, rest, strict=False)
    covered = set(params) if local else set()  # local: the parameters come in their flat shards
    missing = [clean_fqn(k) for k in result.missing_keys]
    missing = [k for k in missing if k not in handled and k not in covered]
    missing += [k for k in units if k not in handled]
    unexpected = [clean_fqn(k) for k in result.unexpected_keys]
    if strict and (missing or unexpected):
        kind = "local" if local else "sharded"
        raise RuntimeError(
            f"Error(s) in loading the {kind} state_dict for {type(module).__name__}: missing "
            f"keys {missing}, unexpected keys {unexpected}. Keys are the unwrapped module's "
            "names; pass strict=False to load a partial one."
        )
    return _IncompatibleKeys(missing, unexpected)


def _own_state(module: nn.Module) -> FSDPState:
    own = state_of(module)
    if own is None:
        raise AssertionError(f"[rank {dist.get_rank()}] a sharded state dict needs FSDP")
    return own


def _param_owners(states: list[FSDPState]) -> dict[int, tuple[ShardedParam, FSDPUnit]]:
    """id of a sharded (or unsharded) parameter -> its ``ShardedParam`` and unit."""
    owners: dict[int, tuple[ShardedParam, FSDPUnit]] = {}
    for state in states:
        if state.unit is None:
            continue
        for param in state.unit.params:
            owners[id(param.sharded)] = owners[id(param.unsharded)] = (param, state.unit)
    return owners


def _flat_param_keys(module: nn.Module, prefix: str, states: list[FSDPState]) -> dict[int, str]:
    """id of each unit -> its local state dict key, ``<module>._flat_param``."""
    names = {id(m): name for name, m in module.named_modules()}
    keys: dict[int, str] = {}
    for state in states:
        if state.unit is not None and id(state.owner) in names:
            owner = clean_fqn(prefix + names[id(state.owner)])
            keys[id(state.unit)] = f"{owner}.{FLAT_PARAM}" if owner else FLAT_PARAM
    return keys


def _flat_shard_dtensor(unit: FSDPUnit, offload: bool) -> Any:
    flat = unit._flat_shard.detach()  # 1D, this rank's padded flat shard
    world = unit.shard_world
    return unit_dtensor(unit, flat.cpu() if offload else flat, (flat.numel() * world,))


def _load_flat_shard(key: str, unit: FSDPUnit, value: Any) -> None:
    local = local_tensor(value) if isinstance(value, torch.Tensor) else value
    expected = unit.flat_shard.numel()
    if not isinstance(local, torch.Tensor) or local.numel() != expected:
        got = local.numel() if isinstance(local, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"load_state_dict (LOCAL_STATE_DICT): {key!r} holds {got} elements on this rank "
            f"but the unit's flat shard has {expected}. A local state dict loads only at the "
            "world size and wrapping it was saved with; save with "
            "StateDictType.SHARDED_STATE_DICT to load at another world size."
        )
    unit._flat_shard.copy_(local.reshape(-1))


def _load_param(name: str, param: ShardedParam, value: Any) -> None:
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"load_state_dict (SHARDED_STATE_DICT): {name!r} must be a tensor (a DTensor or "
            f"the full tensor), got {type(value).__name__}."
        )
    if tuple(value.shape) != tuple(param.full_shape):
        raise ValueError(
            f"load_state_dict: parameter {name!r} has shape {tuple(value.shape)} in the state "
            f"dict but {tuple(param.full_shape)} in the model. A checkpoint loads only into a "
            "model with the same parameter shapes: build the model with the configuration "
            "the checkpoint was saved from, or drop that entry and load with strict=False."
        )
    rows = param.padded_shard[: param.valid_rows]
    if isinstance(value, DTensor):
        local = value.to_local() if same_layout(value, param) else value.full_tensor()[_rows(param)]
    else:
        local = value[_rows(param)]
    rows.copy_(local)


def same_layout(value: Any, param: ShardedParam) -> bool:
    """Whether the ``DTensor`` ``value`` is laid out like ``param``'s sharded parameter, so
    that its local part is this rank's rows."""
    layout = param.layout
    return (
        layout is not None
        and value.device_mesh == layout.mesh
        and tuple(value.placements) == layout.placements
    )


def _rows(param: ShardedParam) -> slice:
    return slice(param.start_row, param.start_row + param.valid_rows)
