"""``fully_shard``: the composable door, on the same units, runtime and collectives as the
wrapper.

``fully_shard(module)`` builds one unit of the parameters ``module`` owns (not those of
modules already sharded below it, see [Note: ownership] in ``fsdp_core/_init.py``), shows
them as ``DTensor``s with ``Shard(0)`` placement, swaps the module's class for a subclass of
:class:`FSDPModule` and the original class, and registers forward hooks that run the shared
runtime's ``pre_forward``/``post_forward`` (backward hooks are the runtime's own).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from .._post_forward import PostForwardShards, post_forward_group
from .._runtime import FSDPState, RuntimeConfig
from .._spmd_mesh import SpmdMesh, resolve_spmd_mesh
from .._unit import FSDPUnit
from ._api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._build import (
    attach,
    collect_specs,
    default_mesh,
    unit_factory,
    validate_ignored,
    validate_modules,
    validate_policies,
)
from ._fsdp_module import resolve_reshard_after_forward
from ._placement import ShardPlacementFn, ValueAssertionError, validate_params

__all__ = ["fully_shard"]

M = TypeVar("M", bound=nn.Module)


def fully_shard(
    module: M | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
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
        mesh: a 1-D ``DeviceMesh`` to shard over, or a 2-D one for hybrid sharding (HSDP):
            dim 0 replicates, dim 1 shards, as ``init_device_mesh(type, (replicas, shard),
            mesh_dim_names=("replicate", "shard"))`` (default ``None``: every rank, on the
            device type of the parameters; CPU parameters go to CUDA only where a GPU exists
            and the default group's backend is nccl, not gloo). With HSDP the parameters are
            ``DTensor``s with ``(Replicate(), Shard(0))`` placements and each reduce-scatter
            inside the shard group is followed by an all-reduce of the shard across the
            replicate group.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward and
            all-gathers them again in backward; ``False`` keeps them; an int ``N`` dividing
            the shard world size keeps a copy sharded over groups of ``N`` ranks so the
            backward all-gather stays inside them. Default ``None``, as in FSDP2: ``True``
            for every module but the root, which keeps its parameters (backward needs them
            first); an explicit ``True`` or int applies to the root too, and
            ``root.set_reshard_after_forward`` changes it later.
        shard_placement_fn: ``fn(param)`` returning ``Shard(dim)`` to shard that parameter on
            ``dim`` (negative counts from the end), or ``None`` for dim 0 (default ``None``:
            dim 0 for all). A dim other than 0 must divide evenly by the shard world size;
            the ``DTensor`` shows ``Shard(dim)``. See [Note: sharding on another dim] in
            ``fsdp_core/_param.py``.
        mp_policy: a ``MixedPrecisionPolicy`` (default: full precision).
        offload_policy: ``OffloadPolicy()`` (default, none) or ``CPUOffloadPolicy()``.
        ignored_params: parameters to leave unsharded and unreduced (default ``None``).
        dp_mesh_dims: the data-parallel dimensions of ``mesh``, which is then the job's
            full SPMD mesh (default ``None``): every parameter must be a ``DTensor`` on
            that mesh object, ``Replicate()`` on those dimensions (``distribute_module``).
            The unit shards over ``mesh[dp_mesh_dims.shard]`` (several names flattened
            into one) and, when ``replicate`` is named too, replicates across
            ``mesh[dp_mesh_dims.replicate]``; with only ``replicate`` it is DDP. The model
            computes with ``DTensor``s on the full mesh; see [Note: SPMD meshes] in
            ``fsdp_core/_spmd_mesh.py``.

    Returns:
        ``module`` (now also an ``FSDPModule``).
    """
    modules = validate_modules("fully_shard", module)
    mesh, spmd = _resolve_mesh(mesh, dp_mesh_dims, modules)
    group = mesh.get_group(mesh.ndim - 1)  # the shard group: the inner dimension
    world = dist.get_world_size(group)
    only_replicate = spmd is not None and not spmd.shard_dims  # DDP on an SPMD mesh
    if spmd is not None and type(reshard_after_forward) is int:  # an int, not a bool
        raise NotImplementedError(
            "fully_shard: reshard_after_forward as int is not yet supported with SPMD "
            f"mesh (dp_mesh_dims), got {reshard_after_forward}; pass True or False."
        )
    rsf = resolve_reshard_after_forward("fully_shard", reshard_after_forward, world)
    if only_replicate:
        rsf = False  # nothing to free or gather again: see [Note: replicate]
    validate_policies("fully_shard", mp_policy, offload_policy)
    ignored = validate_ignored("fully_shard", ignored_params)
    specs = collect_specs(
        "fully_shard",
        modules,
        ignored,
        lambda owned: validate_params("fully_shard", owned),
    )

    def keep_after_forward(made: FSDPUnit) -> None:
        if not isinstance(rsf, bool):
            made.post_forward = PostForwardShards(post_forward_group(group, rsf), world)

    make_unit = unit_factory(
        modules,
        mesh,
        replicate=only_replicate,
        api="fully_shard",
        spmd=spmd,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        then=keep_after_forward,
    )
    unit = make_unit(specs) if specs else None
    param_dtype = mp_policy.param_dtype
    config = RuntimeConfig(
        reshard_after_forward=rsf,
        # The default (None, as in torch 2.13) leaves the root's parameters gathered after
        # forward; an explicit True or int applies to the root too.
        reshard_root_after_forward=reshard_after_forward is not None and rsf is not False,
        limit_all_gathers=True,
        input_dtype=param_dtype if mp_policy.cast_forward_inputs else None,
        output_dtype=mp_policy.output_dtype,
        cast_inputs_always=True,  # as FSDP2
        api="fully_shard",
    )
    attach("fully_shard", modules, FSDPState(modules[0], unit, config), make_unit, "FSDP")
    return module


def _resolve_mesh(
    mesh: Any, dp_mesh_dims: DataParallelMeshDims | None, modules: list[nn.Module]
) -> tuple[Any, SpmdMesh | None]:
    """A 1-D mesh (FSDP) or a 2-D mesh whose dim 0 replicates and dim 1 shards (HSDP), and
    with ``dp_mesh_dims`` the full SPMD mesh it is the data-parallel part of (see [Note: SPMD
    meshes] in ``_spmd_mesh``)."""
    mesh = default_mesh("fully_shard", mesh, modules)
    if dp_mesh_dims is not None:
        if not isinstance(dp_mesh_dims, DataParallelMeshDims):
            raise TypeError(
                f"fully_shard: dp_mesh_dims takes a DataParallelMeshDims, got {dp_mesh_dims!r}."
            )
        spmd = resolve_spmd_mesh(
            "fully_shard",
            mesh,
            dp_mesh_dims.shard_names,
            dp_mesh_dims.replicate_names,
        )
        return spmd.dp_mesh, spmd
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: mesh must be 1-D (FSDP) "
            f"or 2-D (HSDP), got a {mesh.ndim}-D mesh; a 2-D mesh's dims are ('replicate', "
            "'shard'). Pass init_device_mesh(type, (world,)), slice the data-parallel "
            "dimensions out of yours (mesh['replicate', 'shard']), or name them with "
            "dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)."
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueAssertionError(
            f"fully_shard: Please init the 2D mesh for HSDP with mesh_dim_names specified, got "
            f"{mesh}: dim 0 replicates and dim 1 shards, e.g. init_device_mesh(type, (replicas, "
            "shard), mesh_dim_names=('replicate', 'shard'))."
        )
    return mesh, None
