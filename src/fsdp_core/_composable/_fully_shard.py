"""``fully_shard``: the composable door, on the same units, runtime and collectives as the
wrapper.

``fully_shard(module)`` builds one unit of the parameters ``module`` owns (not those of
modules already sharded below it, see [Note: ownership] in ``fsdp_core/_init.py``), shows
them as ``DTensor``s with ``Shard(0)`` placement, swaps the module's class for a subclass of
:class:`FSDPModule` and the original class, and registers forward hooks that run the shared
runtime's ``pre_forward``/``post_forward`` (backward hooks are the runtime's own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .. import _init
from .._param import DTensorLayout, ParamSpec, is_sharded_param
from .._post_forward import PostForwardShards, post_forward_group
from .._precision import UnitPrecision
from .._runtime import FSDPState, RuntimeConfig, state_of
from .._unit import FSDPUnit
from ..api import MixedPrecision
from ..fully_sharded_data_parallel import FullyShardedDataParallel
from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._fsdp_module import (
    ForwardHooks,
    FSDPModule,
    load_full_tensors_hook,
    resolve_reshard_after_forward,
)
from ._shared import mark_taken, move_shared_params, taken

__all__ = ["fully_shard"]

M = TypeVar("M", bound=nn.Module)

_CLASS_CACHE: dict[type, type] = {}


def fully_shard(
    module: M | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> M | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` as one unit; apply bottom-up.

    Call it on submodules first (e.g. each transformer block), then on the root: each call
    takes the parameters not already taken by an earlier call below it. Afterwards the
    module's parameters are ``DTensor``s with ``Shard(0)`` placement (build the optimizer on
    them), ``isinstance(module, FSDPModule)`` holds, and forward/backward all-gather the unit
    once per pass and reduce-scatter its gradients once.

    Args:
        module: the module, or a list of modules that form one unit together (one
            all-gather before the first of them runs, one reshard after the last).
        mesh: a 1-D ``DeviceMesh`` to shard over (default ``None``: every rank, on the
            device type of the parameters).
        reshard_after_forward: ``True`` frees the unsharded parameters after forward and
            all-gathers them again in backward; ``False`` keeps them; an int ``N`` dividing
            the shard world size keeps a copy sharded over groups of ``N`` ranks so the
            backward all-gather stays inside them. Default ``True``; the root keeps its
            parameters when left at the default (backward needs them first), as FSDP2 does
            (``None``, torch 2.13's default, means the same; ``root.set_reshard_after_forward``
            overrides it).
        mp_policy: a ``MixedPrecisionPolicy`` (default: full precision).
        offload_policy: ``OffloadPolicy()`` (default, none) or ``CPUOffloadPolicy()``.
        ignored_params: parameters to leave unsharded and unreduced (default ``None``).
        dp_mesh_dims: for a mesh with more dimensions, the data-parallel ones (default
            ``None``); the unit shards over ``mesh[dp_mesh_dims.shard]``.

    Returns:
        ``module`` (now also an ``FSDPModule``).
    """
    modules = _validate_modules(module)
    mesh = _resolve_mesh(mesh, dp_mesh_dims, modules)
    group = mesh.get_group()
    world = dist.get_world_size(group)
    rsf = resolve_reshard_after_forward("fully_shard", reshard_after_forward, world)
    _validate_policies(mp_policy, offload_policy)
    ignored = _validate_ignored(ignored_params)
    specs = []
    seen: set[int] = set()
    for m in modules:
        for spec in _init.collect_params(
            m, ignored_modules=set(), ignored_params=ignored, is_unit=_is_unit
        ):
            if id(spec.param) not in seen:
                seen.add(id(spec.param))
                specs.append(spec)
    _init.validate_no_scalars("fully_shard", specs)
    _validate_bottom_up(modules, specs)
    # See [Note: shared parameters] in ``_shared``.
    specs = [s for s in specs if not taken(s.param)] + move_shared_params(modules)
    from torch.distributed.tensor import Shard

    compute_device = _compute_device(mesh)
    offload = isinstance(offload_policy, CPUOffloadPolicy)

    def make_unit(unit_specs: list[ParamSpec]) -> FSDPUnit:
        precision = UnitPrecision.resolve(
            MixedPrecision(param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype),
            unit_specs[0].param.dtype,
        )
        made = FSDPUnit(
            modules[0],
            unit_specs,
            group,
            replicate=False,
            precision=precision,
            offload_params=offload,
            compute_device=compute_device,
            layout=DTensorLayout(mesh, (Shard(0),)),
            pin_memory=offload and offload_policy.pin_memory,  # type: ignore[attr-defined]
        )
        if not isinstance(rsf, bool):
            made.post_forward = PostForwardShards(post_forward_group(group, rsf), world)
        mark_taken(unit_specs, made)
        return made

    unit = make_unit(specs) if specs else None
    param_dtype = mp_policy.param_dtype
    config = RuntimeConfig(
        reshard_after_forward=rsf,
        # The default (True, or None as in torch 2.13) leaves the root's parameters gathered
        # after forward; an int applies to the root too.
        reshard_root_after_forward=(
            reshard_after_forward is not None
            and reshard_after_forward is not True
            and rsf is not False
        ),
        limit_all_gathers=True,
        input_dtype=param_dtype if mp_policy.cast_forward_inputs else None,
        output_dtype=mp_policy.output_dtype,
    )
    state = FSDPState(modules[0], unit, config)
    hooks = ForwardHooks(state, modules)
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        m.__dict__["_fsdp_forward_hooks"] = hooks
        m.__class__ = _fsdp_class(type(m))
        m.register_forward_pre_hook(hooks.pre, prepend=True, with_kwargs=True)
        m.register_forward_hook(hooks.post)
        m.__dict__["_fsdp_make_unit"] = make_unit
        m._register_load_state_dict_pre_hook(load_full_tensors_hook(m, state))
    return module


def _validate_modules(module: object) -> list[nn.Module]:
    given: list[object] = (
        list(module)
        if isinstance(module, Iterable) and not isinstance(module, nn.Module)
        else [module]
    )
    modules = [m for m in given if isinstance(m, nn.Module)]
    if not given or len(modules) != len(given):
        raise TypeError(
            f"fully_shard takes an nn.Module or a non-empty list of them, got {module!r}."
        )
    for m in modules:
        if state_of(m) is not None:
            raise ValueError(
                f"fully_shard was already applied to {type(m).__name__}: each module is sharded "
                "once. Apply fully_shard bottom-up, once per module (submodules first, then the "
                "root)."
            )
        wrapped = [n for n, sub in m.named_modules() if isinstance(sub, FullyShardedDataParallel)]
        if wrapped:
            raise ValueError(
                f"fully_shard({type(m).__name__}) contains FullyShardedDataParallel instances "
                f"{wrapped}: the two doors do not nest. Use fully_shard on those submodules "
                "instead of wrapping them."
            )
    return modules


def _validate_bottom_up(modules: list[nn.Module], specs: list[ParamSpec]) -> None:
    """A parameter already sharded by a unit means an enclosing module was sharded first."""
    taken = [s.fqn for s in specs if is_sharded_param(s.param)]
    if taken:
        names = ", ".join(type(m).__name__ for m in modules)
        raise ValueError(
            f"fully_shard({names}) was applied top-down: its parameters {taken} are already "
            "sharded by fully_shard on an enclosing module, so they would belong to two units. "
            "Apply fully_shard bottom-up: submodules first, then their parents, then the root."
        )


def _resolve_mesh(
    mesh: Any, dp_mesh_dims: DataParallelMeshDims | None, modules: list[nn.Module]
) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized; call "
            "dist.init_process_group(...) first."
        )
    if mesh is None:
        device_type = "cpu"
        for m in modules:
            for p in m.parameters():
                if p.device.type not in ("cpu", "meta"):
                    device_type = p.device.type
                break
        if device_type == "cpu" and torch.cuda.is_available():
            device_type = "cuda"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh takes a DeviceMesh or None, got {mesh!r}.")
    if dp_mesh_dims is not None:
        if not isinstance(dp_mesh_dims, DataParallelMeshDims):
            raise TypeError(
                f"fully_shard: dp_mesh_dims takes a DataParallelMeshDims, got {dp_mesh_dims!r}."
            )
        if dp_mesh_dims.replicate_names or len(dp_mesh_dims.shard_names) != 1:
            raise NotImplementedError(
                f"fully_shard: dp_mesh_dims={dp_mesh_dims} is not supported yet: give exactly "
                "one shard dimension and no replicate dimension (hybrid sharding arrives with "
                "the HSDP issue)."
            )
        mesh = mesh[dp_mesh_dims.shard_names[0]]
    if mesh.ndim == 2:
        raise NotImplementedError(
            f"fully_shard: a 2-D mesh {mesh} means hybrid sharding (HSDP), which arrives in a "
            "later fsdp_core issue. Pass a 1-D mesh, e.g. init_device_mesh(type, (world,))."
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: mesh must be 1-D (FSDP) or 2-D (HSDP), got a {mesh.ndim}-D mesh "
            f"{mesh}. Pass init_device_mesh(type, (world,)) or slice the data-parallel "
            "dimensions out of yours."
        )
    return mesh


def _compute_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _validate_policies(mp_policy: object, offload_policy: object) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard: mp_policy takes a MixedPrecisionPolicy, got {mp_policy!r}; e.g. "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"fully_shard: offload_policy takes OffloadPolicy() or CPUOffloadPolicy(), got "
            f"{offload_policy!r}."
        )


def _validate_ignored(ignored_params: object) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    params = set(ignored_params)  # type: ignore[call-overload]
    bad = [p for p in params if not isinstance(p, nn.Parameter)]
    if bad:
        raise TypeError(f"fully_shard: ignored_params takes nn.Parameters, got {bad[:3]}.")
    return params


def _is_unit(module: nn.Module) -> bool:
    return state_of(module) is not None


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: a subclass of ``FSDPModule`` and ``cls`` (one per class)."""
    if issubclass(cls, FSDPModule):
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]
