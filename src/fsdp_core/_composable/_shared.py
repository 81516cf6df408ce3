"""Parameters shared by modules in different units: they move up to the enclosing unit.

[Note: shared parameters]
A parameter reachable from two modules (tied embedding and output weights) has one slot per
(module, attribute). ``fully_shard`` is applied bottom-up, so when a child unit takes such a
parameter it cannot know whether a module outside it uses the parameter too. The rule: a
parameter belongs to the unit of the lowest common ancestor of all its users.

- Each unit marks the original parameters it took (``_fsdp_taken_by``, the ``ShardedParam``),
  so a later ``fully_shard`` on a sibling skips them: the sibling's slot keeps the original
  until an ancestor is sharded.
- ``fully_shard(parent)`` looks at every slot in its subtree. A parameter owned by a nested
  unit with a slot outside that unit's modules is shared beyond it: the nested unit is rebuilt
  without it (one all-gather of its values; its remaining parameters are sharded again) and the
  parent's unit takes it, with every slot. Since ``fully_shard`` runs bottom-up, the first
  ancestor to see all slots is the lowest common one.
- A parameter whose users never get a common sharded ancestor would stay with the first unit
  while the other users see its original, unsharded and untrained: the root's lazy init raises
  FSDP2's ``ValueError`` naming it (``_replaced.refuse_unowned_shared``).

torch's FSDP2 raises on every such model, also when an enclosing module is sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .._param import ParamSpec, ShardedParam
from .._replaced import _TAKEN, mark_taken, taken
from .._runtime import FSDPState, state_of
from .._unit import FSDPUnit

__all__ = ["UnitFactory", "mark_taken", "move_shared_params", "taken"]

UnitFactory = Callable[[list[ParamSpec]], FSDPUnit]
"""Builds a unit of the given parameters with the options its ``fully_shard`` call had."""


@dataclass
class _Owned:
    state: FSDPState
    param: ShardedParam
    slots: list[tuple[nn.Module, str]]


def move_shared_params(modules: list[nn.Module]) -> list[ParamSpec]:
    """Take the parameters nested units own but modules outside them use; return their specs
    for the unit of ``modules`` (FQNs relative to ``modules[0]``). See [Note: shared
    parameters]."""
    names: dict[int, str] = {}
    owned: dict[int, _Owned] = {}
    by_sharded: dict[int, tuple[FSDPState, ShardedParam]] = {}
    nested = _nested_states(modules)
    for state in nested:
        for p in state.unit.params if state.unit is not None else ():
            by_sharded[id(p.sharded)] = (state, p)
            by_sharded[id(p)] = (state, p)
    for root in modules:
        for prefix, m in root.named_modules(remove_duplicate=False):
            names.setdefault(id(m), prefix)
            for attr, value in m._parameters.items():
                if value is None:
                    continue
                key = id(getattr(value, _TAKEN, None)) if taken(value) else id(value)
                if key in by_sharded:
                    state, p = by_sharded[key]
                    entry = owned.setdefault(id(p), _Owned(state, p, []))
                    if (m, attr) not in entry.slots:
                        entry.slots.append((m, attr))
    moving = [e for e in owned.values() if not _inside(e.state, e.slots)]
    specs: list[ParamSpec] = []
    for state in nested:
        leaving = [e for e in moving if e.state is state]
        if leaving:
            full = _rebuild_without(state, {id(e.param) for e in leaving})
            for e in leaving:
                module, attr = e.slots[0]
                prefix = names[id(module)]
                fqn = f"{prefix}.{attr}" if prefix else attr
                param = nn.Parameter(full[id(e.param)], requires_grad=e.param.requires_grad)
                specs.append(ParamSpec(fqn, param, tuple(e.slots)))
    return specs


def _nested_states(modules: list[nn.Module]) -> list[FSDPState]:
    found: list[FSDPState] = []
    for root in modules:
        for m in root.modules():
            state = state_of(m)
            if m is not root and state is not None and state not in found:
                found.append(state)
    return found


def _inside(state: FSDPState, slots: list[tuple[nn.Module, str]]) -> bool:
    members = {id(sub) for m in _unit_modules(state) for sub in m.modules()}
    return all(id(module) in members for module, _ in slots)


def _unit_modules(state: FSDPState) -> list[nn.Module]:
    hooks = state.owner.__dict__.get("_fsdp_forward_hooks")
    return list(hooks.modules) if hooks is not None else [state.owner]


def _rebuild_without(state: FSDPState, leaving: set[int]) -> dict[int, torch.Tensor]:
    """Rebuild ``state``'s unit without the parameters in ``leaving``; return every
    parameter's full values by ``id(ShardedParam)``."""
    unit = state.unit
    if unit is None:
        raise AssertionError("a parameter moved out of a unit that has none")
    if unit.params[0].sharded.is_meta:
        values = [
            torch.empty(p.full_shape, dtype=p.padded_shard.dtype, device="meta")
            for p in unit.params
        ]
    else:
        values = [t.to(unit.params[0].padded_shard.device) for t in unit.gather_full_params()]
    full = {id(p): v for p, v in zip(unit.params, values, strict=True)}
    keep = [
        ParamSpec(p.fqn, nn.Parameter(full[id(p)], requires_grad=p.requires_grad), p.slots)
        for p in unit.params
        if id(p) not in leaving
    ]
    make_unit: UnitFactory = state.owner.__dict__["_fsdp_make_unit"]
    state.unit = make_unit(keep) if keep else None
    if state.unit is not None:
        mark_taken(keep, state.unit)
    return full
