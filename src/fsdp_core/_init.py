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

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._groups import UnitGroups
from ._param import ParamSpec
from ._precision import BufferSlot

__all__ = [
    "IsUnit",
    "ValueAssertionError",
    "collect_buffers",
    "collect_params",
    "device_from_id",
    "expand_ignored",
    "materialize_meta_module",
    "move_owned_to_device",
    "nested_unit_modules",
    "owned_modules",
    "resolve_ignored",
    "sync_module_states",
    "trained_dtype",
    "validate_no_scalars",
    "validate_uniform",
]


class ValueAssertionError(ValueError, AssertionError):
    """A user mistake for which torch's FSDP2 raises ``AssertionError``.

    It is a ``ValueError`` (this project's type for bad input) and an ``AssertionError`` (what
    code written against torch's ``fully_shard`` catches).
    """


IsUnit = Callable[[nn.Module], bool]
"""Whether a module is (or wraps) a fully sharded module with its own FSDP state."""


def expand_ignored(api: str, modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    """``modules`` and every submodule of them; raises naming ``api`` on a non-module."""
    given = list(modules or ())
    bad = [m for m in given if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"{api}: ignored_modules takes nn.Module instances, got {bad}.")
    return {sub for m in given for sub in m.modules()}


def resolve_ignored(
    api: str,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None,
    is_unit: IsUnit,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their submodules) and every ignored parameter.

    ``ignored_states`` takes parameters or modules (not both kinds); ``ignored_modules`` and
    ``ignored_states`` are exclusive, as in torch's FSDP1. The parameters include those of the
    ignored modules.
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            f"{api}: Cannot pass both ignored_modules and ignored_states at the same time (got "
            f"{ignored_modules!r} and {ignored_states!r}). Pass everything as ignored_states."
        )
    params: list[nn.Parameter] = []
    modules: list[nn.Module] = list(ignored_modules or ())
    # Torch's FSDP1 raises ValueError with these words for both (types sorted by repr).
    if not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError(
            f"{api}: ignored_modules expects nn.Module list elements but got types "
            f"{_sorted_types(modules)}. Pass parameters as ignored_states=... instead."
        )
    if ignored_states is not None:
        states = list(ignored_states)
        if all(isinstance(s, nn.Parameter) for s in states):
            params = states  # type: ignore[assignment]
        elif all(isinstance(s, nn.Module) for s in states):
            modules = states  # type: ignore[assignment]
        else:
            raise ValueError(
                f"{api}: ignored_states expects all nn.Parameter or all nn.Module list elements "
                f"but got types {_sorted_types(states)}. Pass the modules' parameters instead of "
                "mixing both kinds."
            )
    units = [type(m).__name__ for m in modules if isinstance(m, nn.Module) and is_unit(m)]
    if units:
        raise ValueError(
            f"{api}: ignored modules must not be FSDP instances, got {units}. Ignore the "
            "module they wrap before wrapping it, or leave the instance out."
        )
    expanded = expand_ignored(api, modules)
    return expanded, {*params, *(p for m in expanded for p in m.parameters(recurse=False))}


def _sorted_types(values: list[Any]) -> list[type]:
    return sorted({type(v) for v in values}, key=repr)


def trained_dtype(specs: Sequence[ParamSpec]) -> torch.dtype:
    """A unit's dtype: that of its parameters that train (or, all frozen, of the first)."""
    return next((s.param.dtype for s in specs if s.param.requires_grad), specs[0].param.dtype)


def validate_uniform(api: str, specs: list[ParamSpec], *, frozen_may_differ: bool) -> None:
    """One device per unit, and one dtype (one flat shard) unless ``frozen_may_differ`` (the
    composable doors): then, as FSDP2, one dtype of the parameters that train (``ValueError``
    that is also FSDP2's ``AssertionError``), and frozen ones may have others (see [Note: mixed
    dtypes in one unit] in ``_flat``). Raises naming ``api``."""
    # Compared with a parameter that trains, so that the frozen ones of other dtypes are named.
    first = next((s for s in specs if s.param.requires_grad), specs[0])
    devices = [s.fqn for s in specs if s.param.device != first.param.device]
    dtypes = [s.fqn for s in specs if s.param.dtype != first.param.dtype]
    fix = (
        f"Cast or move the module with .to(dtype, device) before calling {api}, or give "
        f"those parameters' modules their own {api} call."
    )
    if devices or (dtypes and not frozen_may_differ):
        raise ValueError(
            f"{api} needs one dtype and device per unit, but {devices or dtypes} differ from "
            f"{first.fqn} ({first.param.dtype}, {first.param.device}). {fix}"
        )
    trainable = {s.param.dtype for s in specs if s.param.requires_grad}
    if len(trainable) > 1:
        raise ValueAssertionError(
            f"{api}: FSDP expects uniform original parameter dtype but got {trainable}. {fix}"
        )


def nested_unit_modules(module: nn.Module, is_unit: IsUnit) -> list[nn.Module]:
    """The fully sharded modules directly below ``module`` (not below another one)."""
    found: list[nn.Module] = []
    for child in module.children():
        if is_unit(child):
            found.append(child)
        else:
            found.extend(nested_unit_modules(child, is_unit))
    return found


def owned_modules(
    module: nn.Module, *, ignored_modules: set[nn.Module], is_unit: IsUnit
) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s owned subtree (see [Note: ownership]): each module once, depth first in
    registration order, with its prefix relative to ``module`` (``""`` or ending in ``.``);
    ignored modules and nested units (with everything below them) left out."""
    seen: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        if m in ignored_modules or (m is not module and is_unit(m)) or id(m) in seen:
            return
        seen.add(id(m))
        yield prefix, m
        for name, child in m._modules.items():
            if child is not None:
                yield from visit(child, f"{prefix}{name}.")

    yield from visit(module, "")


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
    for prefix, m in owned_modules(module, ignored_modules=ignored_modules, is_unit=is_unit):
        for name, param in m._parameters.items():
            if param is None or id(param) in ignored_ids:
                continue
            params.setdefault(id(param), (prefix + name, param))
            slots.setdefault(id(param), []).append((m, name))
    return [ParamSpec(fqn, param, tuple(slots[i])) for i, (fqn, param) in params.items()]


def move_owned_to_device(
    module: nn.Module,
    device: torch.device,
    *,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    is_unit: IsUnit,
) -> None:
    """Move the parameters and buffers ``module`` will own to ``device`` (``device_id``), in
    place. Nested units and ignored modules and parameters stay where they are: a nested unit's
    shards already live where its own arguments put them (on the CPU under CPU offload), so a
    ``module.to(device)`` from the root would move them under it."""
    ignored_ids = {id(p) for p in ignored_params}
    for _, m in owned_modules(module, ignored_modules=ignored_modules, is_unit=is_unit):
        with torch.no_grad():
            for param in m._parameters.values():
                if param is None or id(param) in ignored_ids or param.device == device:
                    continue
                param.data = param.data.to(device)
                if param.grad is not None:
                    param.grad = param.grad.to(device)
        for name, buffer in m._buffers.items():
            if buffer is not None and buffer.device != device:
                m._buffers[name] = buffer.to(device)


def materialize_meta_module(
    api: str,
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    *,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    is_unit: IsUnit,
    device: torch.device,
) -> None:
    """Materialize ``module``'s managed parameters and buffers that are on the meta device.

    As torch's FSDP1: if any parameter ``module`` would own, or any buffer outside ignored
    modules, is on meta, ``param_init_fn(m)`` runs on every module of ``module``'s tree in
    breadth-first order, stopping at nested units and ignored modules. Without
    ``param_init_fn``, each of those modules that holds parameters or buffers directly gets
    ``to_empty(device=device, recurse=False)`` and ``reset_parameters()``. With ``device`` the
    meta device (``device_id="meta"``) nothing is materialized: the module stays on meta and
    computes there, allocating nothing (``fsdp-testing plan`` steps models so).
    """
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            f"{api}: param_init_fn takes a callable(module) -> None, got {param_init_fn!r}; "
            "e.g. lambda m: m.to_empty(device='cpu', recurse=False)."
        )
    if device.type == "meta":
        return
    todo: list[nn.Module] = []
    queue = collections.deque([module])
    seen = {module}
    while queue:
        current = queue.popleft()
        todo.append(current)
        for child in current.children():
            if child not in seen and child not in ignored_modules and not is_unit(child):
                seen.add(child)
                queue.append(child)
    if not _meta_names(module, todo, ignored_params):
        return
    with torch.no_grad():
        for m in todo:
            if param_init_fn is not None:
                param_init_fn(m)
            elif (
                next(m.parameters(recurse=False), None) is not None
                or next(m.buffers(recurse=False), None) is not None
            ):
                reset = getattr(m, "reset_parameters", None)
                if not callable(reset):
                    raise ValueError(
                        f"{api}: module {type(m).__name__} is on the meta device and has no "
                        "reset_parameters() to initialize it. Give it one, or pass "
                        "param_init_fn=... to materialize it."
                    )
                m.to_empty(device=device, recurse=False)
                reset()
    left = _meta_names(module, todo, ignored_params)
    if left:
        raise ValueError(
            f"{api}: parameters or buffers {left} are still on the meta device after "
            "initialization. param_init_fn(module) must materialize the module's own "
            "parameters and buffers, e.g. module.to_empty(device=..., recurse=False) followed "
            "by reset_parameters()."
        )


def _meta_names(
    root: nn.Module, modules: list[nn.Module], ignored_params: set[nn.Parameter]
) -> list[str]:
    """Names (relative to ``root``) of the meta parameters and buffers held by ``modules``."""
    names = {m: name for name, m in root.named_modules(remove_duplicate=False)}
    ignored_ids = {id(p) for p in ignored_params}
    found = []
    for m in modules:
        prefix = f"{names[m]}." if names.get(m) else ""
        found += [
            prefix + n
            for n, p in m.named_parameters(recurse=False)
            if p.is_meta and id(p) not in ignored_ids
        ]
        found += [prefix + n for n, b in m.named_buffers(recurse=False) if b.is_meta]
    return found


def validate_no_scalars(api: str, specs: list[ParamSpec]) -> None:
    """Scalar parameters cannot be sharded in dim 0: raise naming them and the fix."""
    scalars = sorted(s.fqn for s in specs if s.param.dim() == 0)
    if scalars:
        raise ValueError(
            f"{api} doesn't support scalar parameters {scalars}: they cannot be sharded in dim "
            f"0. Change {', '.join(scalars)} to a 1D tensor with numel equal to 1."
        )


def collect_buffers(
    module: nn.Module, *, ignored_modules: set[nn.Module], is_unit: IsUnit
) -> list[BufferSlot]:
    """The floating-point buffers ``module`` owns: not under a nested unit or ignored."""
    return [
        BufferSlot(m, name, buffer.dtype)
        for _, m in owned_modules(module, ignored_modules=ignored_modules, is_unit=is_unit)
        for name, buffer in m._buffers.items()
        if buffer is not None and buffer.is_floating_point()
    ]


def sync_module_states(
    module: nn.Module,
    specs: list[ParamSpec],
    ignored_modules: set[nn.Module],
    groups: UnitGroups,
) -> None:
    """Broadcast a unit's parameters and ``module``'s buffers from the first rank of its
    groups: the group's rank 0, or for a hybrid layout the grid's first rank across both
    dimensions (global rank 0 when the grid is the world; see ``UnitGroups.broadcast_steps``)."""
    tensors = [s.param.detach() for s in specs]
    ignored_ids = {id(b) for m in ignored_modules for b in m.buffers()}
    tensors += [b.detach() for b in module.buffers() if id(b) not in ignored_ids]
    with torch.no_grad():
        for group, src in groups.broadcast_steps():
            if dist.get_world_size(group) == 1:
                continue
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
