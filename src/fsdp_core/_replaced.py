"""Sharded parameters replaced on the module after ``fully_shard``, adopted back into their unit.

[Note: replaced parameters]
Between passes a module shows its sharded parameters, and users replace them:
``module.to_empty(device=...)`` and ``module.to(dtype or device)`` (``nn.Module._apply``),
``load_state_dict(sd, assign=True)``, or an assignment (``module.scale = nn.Parameter(...)``, e.g.
an init function that computes one parameter from others). As FSDP2 does, the composable door
picks the new tensors up in ``FSDPModule._apply`` and, for every unit, at the root's lazy init
(:func:`adopt_at_lazy_init`); ``FSDPUnit.reset_sharded_params`` calls :func:`adopt`:

- Nothing replaced (every slot still shows the unit's own sharded parameter, a view into its
  flat shard): nothing to do. A new object over the same storage (``load_state_dict(sd,
  assign=True)`` with the module's own state dict) is a replacement: the user holds it.
- Otherwise the unit gets a new flat shard on the new tensors' device, filled with their
  values, and each ``ShardedParam`` shows a view into it again (``ShardedParam.rebind``). A
  replacement that is a ``DTensor`` parameter with the parameter's layout keeps its identity: its
  local tensor becomes the view into the new flat shard (FSDP2 swaps it the same way), so an
  optimizer built on it steps the unit's storage. A plain tensor of the full shape gives this
  rank's rows; any other shape raises naming the parameter.
- New dtype (``module.to(torch.float64)``): the unit takes it; compute and reduction dtypes that
  followed the old one (no ``param_dtype``/``reduce_dtype`` in the policy) follow the new one.
  The unsharded parameters keep their objects (autograd hooks stay) with storage in the new
  compute dtype. Parameters that train must keep one dtype; frozen ones may take others (see
  [Note: mixed dtypes in one unit] in ``_flat``).
- Some parameters still on the meta device while others are not (partly materialized): left as
  they are; the root's lazy init then raises naming the meta ones (FSDP2's message), before any
  collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ._flat import FlatLayout
from ._param import ParamSpec, ShardedParam, local_tensor

if TYPE_CHECKING:
    from ._unit import FSDPUnit

__all__ = ["adopt", "adopt_at_lazy_init", "mark_taken", "refuse_unowned_shared", "taken"]

_TAKEN = "_fsdp_taken_by"


def mark_taken(specs: list[ParamSpec], unit: FSDPUnit) -> None:
    """Mark each original parameter in ``specs`` as taken by its ``ShardedParam`` in ``unit``
    (see [Note: shared parameters] in ``_composable/_shared``)."""
    for spec, sharded in zip(specs, unit.params, strict=True):
        setattr(spec.param, _TAKEN, sharded)


def taken(param: nn.Parameter) -> bool:
    """Whether a unit already took this original parameter."""
    return isinstance(getattr(param, _TAKEN, None), ShardedParam)


def refuse_unowned_shared(root: nn.Module) -> None:
    """At the root's lazy init: raise FSDP2's error (``ValueError``) if a module still shows an
    original parameter that a unit took: its user got no common sharded ancestor with that
    unit's modules, so it would compute with a copy that never trains. See [Note: shared
    parameters] in ``_composable/_shared``."""
    for name, param in root.named_parameters(remove_duplicate=False):
        if taken(param):
            raise ValueError(
                f"fully_shard: Parameter '{name}' is shared with a parameter already managed by "
                f"another FSDP group ({getattr(param, _TAKEN).fqn!r}). Call fully_shard on a "
                "module enclosing all its users as well (the root, usually: fsdp_core then "
                "moves it into that unit), or use fully_shard([module_a, module_b]) to place "
                "them in the same FSDP group."
            )


def adopt(unit: FSDPUnit) -> None:
    """See [Note: replaced parameters]."""
    for p in unit.params:  # see [Note: per-parameter gradient dtypes] in _grad_dtype
        p.grad_policy.capture(p.sharded)  # a grad_dtype set since
        p.grad_policy.restore_on(p.sharded)  # ``_apply`` may have swapped it out
    if unit.is_unsharded:
        return  # the module shows the unit's unsharded parameters (an explicit unshard)
    current = [p.current() for p in unit.params]
    # The storages themselves (``_cdata``), not their data pointers: fake tensors have none.
    old = unit.flat_shard.untyped_storage()._cdata
    same_objects = all(c is p.sharded for c, p in zip(current, unit.params, strict=True))
    if same_objects and all(local_tensor(c).untyped_storage()._cdata == old for c in current):
        return
    devices = {c.device for c in current}
    if len(devices) > 1 and torch.device("meta") in devices:
        return  # partly materialized: see the note
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: the parameters of unit {unit.name!r} are now on several devices "
            f"{sorted(map(str, devices))}; move the whole module with module.to(device)."
        )
    dtypes = [c.dtype for c in current]
    trainable = {c.dtype for c, p in zip(current, unit.params, strict=True) if p.requires_grad}
    if len(trainable) > 1:
        raise ValueError(
            f"fully_shard: the parameters of unit {unit.name!r} that train now have several "
            f"dtypes {sorted(map(str, trainable))}; cast the whole module with module.to(dtype)."
        )
    dtype = trainable.pop() if trainable else dtypes[0]
    if dtype != unit.dtype:
        unit.dtype = dtype
        unit.precision = unit.precision.with_orig_dtype(dtype)
    for p, new in zip(unit.params, dtypes, strict=True):
        p.set_compute_dtype(unit.compute_dtype_for(p, new))
    layout = FlatLayout(dtypes, [p.shard_numel for p in unit.params])
    flat = unit.new_flat_shard(layout, devices.pop())
    for i, (p, tensor) in enumerate(zip(unit.params, current, strict=True)):
        p.rebind(layout.segment(flat, i), tensor)


def adopt_at_lazy_init(
    units: list[tuple[str, FSDPUnit, str]], check: Callable[[], None] = lambda: None
) -> None:
    """At the root's lazy init: adopt every composable unit's replaced parameters, run
    ``check`` (the offload check: it sees what was adopted), then raise if any parameter is
    still on the meta device, unless its unit computes there (``device_id="meta"``, planning).
    ``units``: (the owner's FQN, its unit, its door)."""
    for _, unit, api in units:
        if api != "FullyShardedDataParallel":  # FSDP1 adopts nothing
            adopt(unit)
    check()
    for fqn, unit, api in units:
        if unit.device.type == "meta":
            continue
        meta = [f"{fqn}.{p.fqn}" if fqn else p.fqn for p in unit.params if p.sharded.is_meta]
        if meta:
            raise RuntimeError(
                f"{api}: FSDP parameters should be materialized from meta device before "
                f"training, but the following were still on meta device: {meta}\nFor example, "
                "call module.to_empty(device=...) to materialize them and module."
                "reset_parameters() on each module to initialize values."
            )
