"""The units of a ``fully_shard`` model as graph mode sees them: which module gathers which
``Shard(0)`` parameters over which process group, in registration order.

Both composable doors give such a model: fsdp_core's ``fully_shard`` (the one graph mode is
for) and torch's FSDP2 ``fully_shard`` (accepted too: its parameters are ``Shard(0)``
``DTensor``s as well, and graph mode reads nothing else of it). Of fsdp_core's units graph mode
reads their public views (``fsdp_core.unit_views``): the policies, to refuse those it does not
trace (mixed precision, CPU offload, hybrid sharding, replicate), and each unit's shard group.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..debug import suspend_hooks
from ..views import UnitView, unit_views

__all__ = ["GraphParam", "GraphUnit", "doors_suspended", "find_units"]


@dataclass(frozen=True)
class GraphParam:
    """One sharded parameter a traced step gathers.

    Args:
        fqn: its name in the model.
        owner: the module that registers it.
        name: its attribute name on ``owner``.
        param: the parameter, a ``DTensor`` with placements ``(Shard(0),)``.
    """

    fqn: str
    owner: nn.Module
    name: str
    param: DTensor


@dataclass(frozen=True)
class GraphUnit:
    """One fully sharded module of a traced step and the parameters it gathers (those no nested
    unit owns; a parameter shared between units is gathered by the first).

    Args:
        fqn: the module's name (``""`` for the root).
        module: the module.
        params: its parameters, in the order of its all-gather.
        group: the process group it gathers and reduces over.
    """

    fqn: str
    module: nn.Module
    params: tuple[GraphParam, ...]
    group: dist.ProcessGroup


def _is_fully_sharded(module: nn.Module) -> bool:
    """Sharded by fsdp_core's ``fully_shard`` (or torch's, whose models trace the same way)."""
    from .. import FSDPModule

    return isinstance(module, FSDPModule) or _is_torch_fsdp2(module)


def _is_torch_fsdp2(module: nn.Module) -> bool:
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: torch's never ran
    return torch_fsdp is not None and isinstance(module, torch_fsdp.FSDPModule)


@contextlib.contextmanager
def doors_suspended(api: str, model: nn.Module) -> Iterator[None]:
    """The doors' forward hooks off within the block, every other hook left alone.

    fsdp_core's through ``fsdp_core.debug.suspend_hooks``. torch's FSDP2 keeps the handles of
    its forward pre-hook and hook on each unit's state: they are removed through those handles
    and registered again on exit (as torch's ``FSDPMemTracker`` does), so afterwards torch's
    forward hook runs after every other forward hook of that module. A torch unit of several
    modules (``fully_shard([a, b])``) or without those handles is refused by name.
    """
    states: list[tuple[nn.Module, Any]] = []
    refused = []
    for name, module in model.named_modules():
        if not _is_torch_fsdp2(module):
            continue
        state = module._get_fsdp_state()
        handles = [getattr(state, f"_{k}_forward_hook_handle", None) for k in ("pre", "post")]
        if len(getattr(state, "_modules", ())) != 1 or None in handles:
            refused.append(name or "<root>")
        states.append((module, state))
    if refused:
        raise NotImplementedError(
            f"{api} cannot switch off torch's FSDP2 forward hooks of units {refused} through "
            "their handles (a unit of several modules, or a torch without the handles). Shard "
            "each of those modules with its own fully_shard call, or use fsdp_core.fully_shard."
        )
    with suspend_hooks(model):
        for _, state in states:
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        try:
            yield
        finally:
            for module, state in states:
                state._pre_forward_hook_handle = module.register_forward_pre_hook(
                    state._pre_forward, prepend=True, with_kwargs=True
                )
                state._post_forward_hook_handle = module.register_forward_hook(
                    state._post_forward, prepend=False
                )


def _validate_policies(api: str, modules: dict[str, nn.Module], views: dict[str, UnitView]) -> None:
    """fsdp_core units whose policies graph mode does not trace raise, naming them."""
    unsupported = []
    for name in modules:
        view = views.get(name)
        if view is None:
            continue
        if view.param_dtype is not None or view.reduce_dtype is not None:
            unsupported.append(f"{name or '<root>'} (mp_policy)")
        if view.offload_params:
            unsupported.append(f"{name or '<root>'} (offload_policy)")
        if view.replicate_size > 1:
            kind = "2-D mesh" if view.door == "fully_shard" else view.door
            unsupported.append(f"{name or '<root>'} ({kind})")
        if any(p.shard_dim != 0 for p in view.params):
            unsupported.append(f"{name or '<root>'} (shard_placement_fn)")
    if unsupported:
        raise NotImplementedError(
            f"{api} does not trace mixed precision, CPU offload, hybrid sharding or replicate "
            f"yet, nor a shard_placement_fn dim other than 0; units {unsupported} use them. Shard "
            "those modules with fully_shard on a 1-D mesh with the default "
            "MixedPrecisionPolicy(), OffloadPolicy() and shard_placement_fn, or train this "
            "model in eager mode."
        )


def find_units(api: str, model: nn.Module) -> list[GraphUnit]:
    """The model's units, outermost first; every parameter belongs to the innermost unit module
    that contains it. Raises ``ValueError`` for a model not sharded by ``fully_shard``."""
    modules = {name: m for name, m in model.named_modules() if _is_fully_sharded(m)}
    if "" not in modules:
        raise ValueError(
            f"{api} expects a model sharded by fsdp_core.fully_shard, but the root "
            f"{type(model).__name__} is not fully sharded (fully sharded submodules: "
            f"{sorted(modules) or 'none'}). Call fully_shard(block) on each block, then "
            "fully_shard(model) on the root, before tracing."
        )
    # fsdp_core's units by each module they were applied to (torch's have no view).
    views = {name: view for view in unit_views(model) for name in view.module_fqns}
    _validate_policies(api, modules, views)
    owned: dict[str, list[GraphParam]] = {name: [] for name in modules}
    plain: list[str] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            fqn = f"{module_name}.{name}" if module_name else name
            if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
                plain.append(fqn)
                continue
            unit = max(
                (u for u in modules if u == "" or fqn.startswith(u + ".")),
                key=len,
            )
            if any(p.param is param for units in owned.values() for p in units):
                continue  # a shared parameter is gathered once, by its first owner
            owned[unit].append(GraphParam(fqn, module, name, param))
    if plain:
        raise ValueError(
            f"{api} traces DTensor parameters sharded as (Shard(0),) only; {sorted(plain)} are "
            "not. Shard every parameter with fully_shard (and no other placement) first."
        )
    units = []
    for unit_name, module in modules.items():
        params = owned[unit_name]
        if not params:
            continue
        dtypes = sorted({str(p.param.dtype).removeprefix("torch.") for p in params})
        if len(dtypes) > 1:  # frozen ones of other dtypes: see ``fsdp_core/_flat.py``
            raise NotImplementedError(
                f"{api} gathers one dtype per unit, but unit {unit_name or '<root>'!r} holds "
                f"parameters of several dtypes {dtypes} (eager mode all-gathers them as "
                "bytes). Give the modules of the frozen ones their own fully_shard call, or "
                "run the model in eager mode."
            )
        view = views.get(unit_name)
        group = view.shard_group if view is not None else None  # the door's own group object
        if group is None:
            group = params[0].param.device_mesh.get_group()
        units.append(GraphUnit(unit_name, module, tuple(params), group))
    return units
