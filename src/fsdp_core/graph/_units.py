"""The units of a ``fully_shard`` model as graph mode sees them: which module gathers which
``Shard(0)`` parameters over which process group, in registration order.

Both composable doors give such a model: fsdp_core's ``fully_shard`` (the one graph mode is
for) and torch's FSDP2 ``fully_shard`` (accepted too: its parameters are ``Shard(0)``
``DTensor``s as well, and graph mode reads nothing else of it). Of fsdp_core's units graph mode
also reads the policies, to refuse those it does not trace (mixed precision, CPU offload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["GraphParam", "GraphUnit", "find_units"]


@dataclass(frozen=True)
class GraphParam:
    """One sharded parameter: where it is registered and its full and local row counts."""

    fqn: str
    owner: nn.Module  # the module whose ``_parameters`` holds it
    name: str  # its key in ``owner._parameters``
    param: DTensor  # an nn.Parameter holding a DTensor with placements (Shard(0),)


@dataclass(frozen=True)
class GraphUnit:
    """One fully sharded module and the parameters it gathers (those no nested unit owns)."""

    fqn: str
    module: nn.Module
    params: tuple[GraphParam, ...]
    group: dist.ProcessGroup


def _is_fully_sharded(module: nn.Module) -> bool:
    """Sharded by fsdp_core's ``fully_shard`` (or torch's, whose models trace the same way)."""
    import sys

    from .._composable import FSDPModule

    if isinstance(module, FSDPModule):
        return True
    torch_fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: torch's never ran
    return torch_fsdp is not None and isinstance(module, torch_fsdp.FSDPModule)


def _validate_policies(api: str, modules: dict[str, nn.Module]) -> None:
    """fsdp_core units whose policies graph mode does not trace raise, naming them."""
    from .._runtime import state_of

    unsupported = []
    for name, module in modules.items():
        state = state_of(module)
        unit = state.unit if state is not None else None
        if unit is None:
            continue
        if unit.precision.casts_params or unit.precision.reduce_dtype != unit.precision.orig_dtype:
            unsupported.append(f"{name or '<root>'} (mp_policy)")
        if unit.offload_params:
            unsupported.append(f"{name or '<root>'} (offload_policy)")
        if unit.groups.replicate_size > 1:
            kind = "2-D mesh" if unit.groups.is_hybrid else "replicate"
            unsupported.append(f"{name or '<root>'} ({kind})")
        if any(p.shard_dim != 0 for p in unit.params):
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
    _validate_policies(api, modules)
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
    from .._runtime import state_of

    units = []
    for unit_name, module in modules.items():
        params = owned[unit_name]
        if not params:
            continue
        state = state_of(module)
        if state is not None and state.unit is not None:
            group = state.unit.groups.shard  # the door's own group object
            assert group is not None  # a fully_shard unit always has one
        else:
            group = params[0].param.device_mesh.get_group()
        units.append(GraphUnit(unit_name, module, tuple(params), group))
    return units
