"""What ``fully_shard`` and ``replicate`` share: the checks of their arguments, the parameters a
call takes, the unit, and attaching the state, forward hooks and swapped class to the modules.

Every message names the calling API (``api``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _init
from .._grad_dtype import applies as grad_dtype_applies
from .._groups import UnitGroups, backend_moves_cuda_memory, hybrid_groups_from_mesh
from .._param import DTensorLayout, ParamSpec, is_sharded_param
from .._precision import UnitPrecision
from .._runtime import FSDPState, state_of
from .._spmd_mesh import SpmdMesh
from .._unit import FSDPUnit
from ..api import MixedPrecision, TrainingState
from ..fully_sharded_data_parallel import FullyShardedDataParallel
from ._api import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    reduce_follows_grad_dtype,
)
from ._fsdp_module import API_KEY, FSDPModule, api_of
from ._hooks import ForwardHooks, load_full_tensors_hook
from ._placement import ShardPlacementFn, place_params
from ._shared import UnitFactory, mark_taken, move_shared_params, taken

__all__ = [
    "attach",
    "collect_specs",
    "compute_device",
    "default_mesh",
    "is_unit",
    "unit_factory",
    "unit_precision",
    "validate_ignored",
    "validate_modules",
    "validate_policies",
]

_CLASS_CACHE: dict[tuple[str, type], type] = {}


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` has a state of its own (its parameters are not its parent's)."""
    return state_of(module) is not None


def validate_modules(api: str, module: object) -> list[nn.Module]:
    """``module`` as a non-empty list of modules without a state and without wrappers."""
    given: list[object] = (
        list(module)
        if isinstance(module, Iterable) and not isinstance(module, nn.Module)
        else [module]
    )
    modules = [m for m in given if isinstance(m, nn.Module)]
    if not given or len(modules) != len(given):
        raise TypeError(f"{api} takes an nn.Module or a non-empty list of them, got {module!r}.")
    for m in modules:
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError(
                f"{api} got a FullyShardedDataParallel instance (wrapping "
                f"{type(m.module).__name__}): the two doors do not nest. Apply {api} to the "
                "plain module instead of wrapping it."
            )
        if state_of(m) is not None:
            raise ValueError(_applied_twice(api, api_of(m), type(m).__name__))
        wrapped = [n for n, sub in m.named_modules() if isinstance(sub, FullyShardedDataParallel)]
        if wrapped:
            raise ValueError(
                f"{api}({type(m).__name__}) contains FullyShardedDataParallel instances "
                f"{wrapped}: the two doors do not nest. Use fully_shard on those submodules "
                "instead of wrapping them."
            )
    return modules


def _applied_twice(api: str, earlier: str, name: str) -> str:
    if earlier == api:
        verb = "sharded" if api == "fully_shard" else "replicated"
        return (
            f"{api} was already applied to {name}: each module is {verb} once. Apply {api} "
            "bottom-up, once per module (submodules first, then the root)."
        )
    return (
        f"{api}({name}): {earlier} was already applied to this module, and a module is either "
        "sharded (fully_shard) or replicated (replicate), once. Keep one of the two calls."
    )


def default_mesh(api: str, mesh: Any, modules: list[nn.Module]) -> Any:
    """``mesh``, or when ``None`` a 1-D mesh of every rank: on the parameters' device type, or
    for CPU (and meta) parameters on CUDA where it exists and the default group's backend for
    it moves device memory (nccl), else on the CPU.

    torch's FSDP2 takes the accelerator whatever the backend; here a gloo job on a machine that
    has a GPU (a test written on a CPU-only machine, run on a GPU node) keeps its CPU tensors,
    where torch's would move the module to the GPU and fail at its CPU inputs or gloo's
    reduce-scatter.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            f"{api} needs torch.distributed to be initialized; call "
            "dist.init_process_group(...) first."
        )
    if mesh is None:
        device_type = "cpu"
        for m in modules:
            for p in m.parameters():
                if p.device.type not in ("cpu", "meta"):
                    device_type = p.device.type
                break
        if device_type == "cpu" and torch.cuda.is_available() and backend_moves_cuda_memory():
            device_type = "cuda"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{api}: mesh takes a DeviceMesh or None, got {mesh!r}.")
    return mesh


def compute_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def validate_policies(api: str, mp_policy: object, offload_policy: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{api}: mp_policy takes a MixedPrecisionPolicy, got {mp_policy!r}; e.g. "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"{api}: offload_policy takes OffloadPolicy() or CPUOffloadPolicy(), got "
            f"{offload_policy!r}."
        )


def validate_ignored(api: str, ignored_params: object) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    params = set(ignored_params)  # type: ignore[call-overload]
    bad = [p for p in params if not isinstance(p, nn.Parameter)]
    if bad:
        raise TypeError(f"{api}: ignored_params takes nn.Parameters, got {bad[:3]}.")
    return params


def collect_specs(
    api: str,
    modules: list[nn.Module],
    ignored: set[nn.Parameter],
    validate: Callable[[list[ParamSpec]], None],
) -> list[ParamSpec]:
    """The parameters the call on ``modules`` takes: those they own (see [Note: ownership] in
    ``_init``), less those a sibling unit took, plus the shared ones moving up from nested
    units (see [Note: shared parameters] in ``_shared``). ``validate`` sees the owned ones."""
    specs: list[ParamSpec] = []
    index: dict[int, int] = {}
    for m in modules:
        for spec in _init.collect_params(
            m, ignored_modules=set(), ignored_params=ignored, is_unit=is_unit
        ):
            i = index.setdefault(id(spec.param), len(specs))
            if i == len(specs):
                specs.append(spec)
            else:  # shared by modules of the group (tied weights): one parameter, every slot
                specs[i] = dataclasses.replace(specs[i], slots=(*specs[i].slots, *spec.slots))
    validate(specs)
    _validate_bottom_up(api, modules, specs)
    return [s for s in specs if not taken(s.param)] + move_shared_params(modules)


def _validate_bottom_up(api: str, modules: list[nn.Module], specs: list[ParamSpec]) -> None:
    """A parameter already in a unit means an enclosing module got its unit first."""
    from torch.distributed.tensor import Replicate

    owned = [s for s in specs if is_sharded_param(s.param)]
    if not owned:
        return
    names = ", ".join(type(m).__name__ for m in modules)
    placements = getattr(owned[0].param, "placements", ())
    by = (
        "replicated by replicate"
        if placements and all(isinstance(p, Replicate) for p in placements)
        else "sharded by fully_shard"
    )
    raise ValueError(
        f"{api}({names}) was applied top-down: its parameters {[s.fqn for s in owned]} are "
        f"already {by} on an enclosing module, so they would belong to two units. Apply "
        f"{api} bottom-up: submodules first, then their parents, then the root."
    )


def unit_factory(
    modules: list[nn.Module],
    mesh: Any,
    *,
    replicate: bool,
    api: str | None = None,
    spmd: SpmdMesh | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    then: Callable[[FSDPUnit], None] | None = None,
) -> UnitFactory:
    """Builds the unit of ``modules`` from given parameters, with this call's options:
    ``Shard(0)`` DTensors over ``mesh`` (``Shard(dim)`` where ``shard_placement_fn`` says), or
    with ``replicate`` whole ``Replicate()`` ones (``api`` names the door in errors: default
    ``replicate`` for those, else ``fully_shard``); with ``spmd`` ``mesh`` is its data-parallel
    part and the parameters are ``DTensor``s on its full mesh (see [Note: SPMD meshes]);
    ``then`` finishes each unit built (also those rebuilt when a shared parameter moves up)."""
    from torch.distributed.tensor import Replicate, Shard

    placements: tuple[Any, ...]
    if replicate:
        groups, placements = UnitGroups(replicate=mesh.get_group()), (Replicate(),)
    elif mesh.ndim == 2:  # HSDP: see [Note: unit groups] in ``_groups``
        groups = hybrid_groups_from_mesh("fully_shard", mesh)
        placements = (Replicate(), Shard(0))
    else:
        groups, placements = UnitGroups(shard=mesh.get_group()), (Shard(0),)
    device = compute_device(mesh)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    layout = DTensorLayout(mesh, placements, spmd)

    def make_unit(specs: list[ParamSpec]) -> FSDPUnit:
        door = api or ("replicate" if replicate else "fully_shard")
        if spmd is not None:
            for spec in specs:
                spmd.check_param(door, spec.fqn, spec.param)
        specs = place_params("fully_shard", specs, shard_placement_fn, mesh, groups.shard_size)
        _init.validate_uniform(door, specs, frozen_may_differ=True)
        precision = unit_precision(mp_policy, _init.trained_dtype(specs))
        dtypes = [mp_policy.param_dtype_for(s.param, s.fqn) for s in specs]  # validated
        keep = frozenset(
            i
            for i, dtype in enumerate(dtypes)
            if mp_policy.param_dtype is not None and dtype != mp_policy.param_dtype
        )
        unit = FSDPUnit(
            modules[0],
            specs,
            groups,
            precision=precision,
            offload_params=offload,
            compute_device=device,
            layout=layout,
            pin_memory=offload and offload_policy.pin_memory,  # type: ignore[attr-defined]
            keep_dtype=keep,
        )
        # FSDP2's no-sync accumulation dtype, and .grad None for parameters without gradients
        unit.upcast_unreduced_grads = unit.skip_params_without_grads = True
        # torch 2.15 on: each parameter's ``grad_dtype``; see [Note: per-parameter gradient
        # dtypes] in ``_grad_dtype``.
        unit.grad_dtype_policies = grad_dtype_applies()
        unit.mp_policy = mp_policy
        if then is not None:
            then(unit)
        mark_taken(specs, unit)
        return unit

    return make_unit


def unit_precision(mp_policy: MixedPrecisionPolicy, orig_dtype: torch.dtype) -> UnitPrecision:
    """A unit's dtypes under ``mp_policy``; ``reduce_dtype=None`` follows the installed torch's
    rule (``default_reduce_dtype``): with torch 2.15 or later it stays the gradients' dtype,
    also after ``module.to(dtype)`` before the first forward."""
    precision = UnitPrecision.resolve(
        MixedPrecision(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype),
        orig_dtype,
    )
    if mp_policy.reduce_dtype is None and reduce_follows_grad_dtype():
        precision = dataclasses.replace(
            precision, reduce_dtype=orig_dtype, policy_sets_reduce=False
        )
    return precision


def attach(
    api: str, modules: list[nn.Module], state: FSDPState, make_unit: UnitFactory, prefix: str
) -> None:
    """Give ``modules`` the state, its forward hooks, the state-dict hook and the class
    ``<prefix><Cls>``, a subclass of ``FSDPModule`` and the original class."""
    hooks = ForwardHooks(state, modules)
    for m in modules:
        _register_with_torch(m, api)
        m.__dict__["_fsdp_state"] = state
        m.__dict__["_fsdp_forward_hooks"] = hooks
        m.__dict__[API_KEY] = api
        m.__class__ = _fsdp_class(type(m), prefix)
        hooks.handles += [
            m.register_forward_pre_hook(hooks.pre, prepend=True, with_kwargs=True),
            m.register_forward_hook(hooks.post),
            m.register_state_dict_pre_hook(_reshard_before_state_dict(state)),
            m._register_load_state_dict_pre_hook(_reshard_before_state_dict(state)),
            m._register_load_state_dict_pre_hook(load_full_tensors_hook(m, state)),
        ]
        m.__dict__["_fsdp_make_unit"] = make_unit


def _reshard_before_state_dict(state: FSDPState) -> Callable[..., None]:
    """A save and load state-dict pre-hook: outside forward and backward, an unsharded unit
    (``reshard_after_forward=False`` after a forward, an explicit ``unshard()``) is resharded
    first, so that state dicts hold its ``DTensor`` shards and loads write into them, as in
    FSDP2."""

    def hook(*args: Any, **kwargs: Any) -> None:
        unit = state.unit
        if unit is not None and unit.is_unsharded and state.training_state is TrainingState.IDLE:
            unit.reshard("explicit")

    return hook


def _register_with_torch(module: nn.Module, api: str) -> None:
    """Record ``api`` in torch's registry of composable APIs on ``module``, as torch's own
    ``fully_shard`` and ``replicate`` do: torch's composable APIs read it to leave a module to
    the API that manages it (torch's DDP-based ``replicate`` around ``fully_shard``-ed
    submodules skips their parameters)."""
    try:
        from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
    except ImportError:  # pragma: no cover - a torch without composable APIs
        return
    registry = module.__dict__.setdefault(REGISTRY_KEY, {})
    registry.setdefault(api, RegistryItem())


def _fsdp_class(cls: type, prefix: str) -> type:
    """``<prefix><cls>``: a subclass of ``FSDPModule`` and ``cls`` (one per class)."""
    if issubclass(cls, FSDPModule):
        return cls
    key = (prefix, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"{prefix}{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[key]
