"""Construction steps both front doors share: which parameters and buffers a unit owns, where
nested units begin, and ``sync_module_states``.

[Note: ownership]
A fully sharded module owns every parameter in its subtree that is not below a nested fully
sharded module (one that has an FSDP state of its own) or an ignored module. The wrapper door
wraps children first, so when its constructor collects, the nested instances already own their
parameters; ``fully_shard`` is applied bottom-up for the same reason. A parameter reachable from
two modules (tied weights) has several *slots*, one per (module, attribute); it is owned once.

What happens to a parameter that a nested unit owns and the enclosing module also reaches
differs by door: the wrapper raises (FSDP1 does), ``fully_shard`` moves it up into the
enclosing unit, the lowest common ancestor of its users (see [Note: shared parameters] in
``_composable/_shared.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ._param import ParamSpec
from ._precision import BufferSlot

__all__ = [
    "IsUnit",
    "collect_buffers",
    "collect_params",
    "device_from_id",
    "expand_ignored",
    "nested_unit_modules",
    "sync_module_states",
    "validate_no_scalars",
]

IsUnit = Callable[[nn.Module], bool]
"""Whether a module is (or wraps) a fully sharded module with its own FSDP state."""


def expand_ignored(api: str, modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    """``modules`` and every submodule of them; raises naming ``api`` on a non-module."""
    given = list(modules or ())
    bad = [m for m in given if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"{api}: ignored_modules takes nn.Module instances, got {bad}.")
    return {sub for m in given for sub in m.modules()}


def nested_unit_modules(module: nn.Module, is_unit: IsUnit) -> list[nn.Module]:
    """The fully sharded modules directly below ``module`` (not below another one)."""
    found: list[nn.Module] = []
    for child in module.children():
        if is_unit(child):
            found.append(child)
        else:
            found.extend(nested_unit_modules(child, is_unit))
    return found


def collect_params(
    module: nn.Module,
    *,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter] | None = None,
    is_unit: IsUnit,
) -> list[ParamSpec]:
    """The parameters ``module`` owns, in registration order. See [Note: ownership].

    Each spec lists every slot in ``module``'s owned subtree that refers to the parameter;
    ``fqn`` is the first name found (relative to ``module``).
    """
    ignored_ids = {id(p) for p in ignored_params or ()}
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, tuple[str, nn.Parameter]] = {}
    seen: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if m in ignored_modules or (m is not module and is_unit(m)) or id(m) in seen:
            return
        seen.add(id(m))
        for name, param in m._parameters.items():
            if param is None or id(param) in ignored_ids:
                continue
            params.setdefault(id(param), (prefix + name, param))
            slots.setdefault(id(param), []).append((m, name))
        for child_name, child in m._modules.items():
            if child is not None:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return [ParamSpec(fqn, param, tuple(slots[i])) for i, (fqn, param) in params.items()]


def validate_no_scalars(api: str, specs: list[ParamSpec]) -> None:
    """Scalar parameters cannot be sharded in dim 0: raise naming them and the fix."""
    scalars = sorted(s.fqn for s in specs if s.param.dim() == 0)
    if scalars:
        raise ValueError(
            f"{api} doesn't support scalar parameters {scalars}: they cannot be sharded in dim "
            "0. Change each to a 1D tensor with numel equal to 1."
        )


def collect_buffers(
    module: nn.Module, *, ignored_modules: set[nn.Module], is_unit: IsUnit
) -> list[BufferSlot]:
    """The floating-point buffers ``module`` owns: not under a nested unit or ignored."""
    slots: list[BufferSlot] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if m in ignored_modules or (m is not module and is_unit(m)) or id(m) in seen:
            return
        seen.add(id(m))
        for name, buffer in m._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                slots.append(BufferSlot(m, name, buffer.dtype))
        for child in m._modules.values():
            if child is not None:
                visit(child)

    visit(module)
    return slots


def sync_module_states(
    module: nn.Module,
    specs: list[ParamSpec],
    ignored_modules: set[nn.Module],
    group: dist.ProcessGroup,
) -> None:
    """Broadcast a unit's parameters and ``module``'s buffers from the group's rank 0."""
    tensors = [s.param.detach() for s in specs]
    ignored_ids = {id(b) for m in ignored_modules for b in m.buffers()}
    tensors += [b.detach() for b in module.buffers() if id(b) not in ignored_ids]
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=group)


def device_from_id(api: str, device_id: int | str | torch.device) -> torch.device:
    """The device ``device_id`` names: an int is a CUDA index, a string is parsed by torch."""
    if isinstance(device_id, bool):
        raise TypeError(f"{api}: device_id takes an int, str or torch.device, got {device_id!r}.")
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if isinstance(device_id, torch.device):
        return device_id
    if isinstance(device_id, str):
        try:
            return torch.device(device_id)
        except RuntimeError as error:
            raise ValueError(
                f"{api}: device_id={device_id!r} is not a device name ({error}); pass e.g. "
                "'cuda:0', 'cpu' or an int CUDA index."
            ) from error
    raise TypeError(f"{api}: device_id takes an int, str or torch.device, got {device_id!r}.")
