"""``replicate``: data parallelism (DDP semantics) in the composable door, nestable inside
``fully_shard``.

[Note: replicate]
``replicate(module)`` builds one unit of the parameters ``module`` owns, the same way
``fully_shard`` does (bottom-up; not those of units below it, see [Note: ownership] in
``fsdp_core/_init.py``), but with ``FSDPUnit(replicate=True)``: every rank keeps every
parameter whole and the unit all-reduces (pre-divided SUM, so an average) its gradients once
per backward, as the wrapper's ``NO_SHARD``. Applied before ``fully_shard`` on an enclosing
module, its parameters stay out of that module's unit (a module with a state is a unit
boundary), so the enclosing unit shards only the rest.

The parameters show as ``DTensor``s with ``Replicate()`` placement on the mesh (as torch's
``replicate`` built on FSDP2 does), so one optimizer, ``clip_grad_norm_`` and ``state_dict()``
treat the whole model's parameters alike. In forward and backward the module sees plain
tensors: without mixed precision or offload they alias the ``DTensor``'s local storage, so an
unshard moves nothing and the runtime never all-gathers for this unit; with them, the unit
keeps a cast (or device) copy made locally. It keeps that form from forward to the end of
backward (``reshard_after_forward`` is ``False`` and ``set_reshard_after_forward`` leaves it
alone); the final backward callback of the root shows the ``DTensor``s again.

The runtime drives the unit as any nested unit: root lazy init, execution order, order tags on
the all-reduce, post-backward hooks and the final callback are shared, and
``set_requires_gradient_sync(False)`` accumulates unreduced gradients as for sharded units.
Without any ``fully_shard``, ``replicate(model)`` alone is DDP.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

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

__all__ = ["replicate"]

M = TypeVar("M", bound=nn.Module)


def replicate(
    module: M | list[nn.Module],
    *,
    mesh: Any = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> M | list[nn.Module]:
    """Keep ``module``'s parameters whole on every rank and all-reduce their gradients (DDP
    semantics); apply bottom-up, alone or inside ``fully_shard``.

    Call it before ``fully_shard`` on any module enclosing ``module``: the enclosing unit then
    leaves these parameters out. Afterwards they are ``DTensor``s with ``Replicate()``
    placement (build the optimizer on them), ``isinstance(module, FSDPModule)`` holds (the
    class becomes ``Replicate<Cls>``), and each backward all-reduces the gradients once; no
    all-gather ever runs for them. See [Note: replicate].

    Args:
        module: the module, or a list of modules that form one unit together (one
            all-reduce of their gradients), as ``fully_shard``'s.
        mesh: a 1-D ``DeviceMesh`` to replicate over (default ``None``: every rank, on the
            device type of the parameters, chosen as ``fully_shard`` does); a mesh of more
            dimensions with ``dp_mesh_dims``.
        mp_policy: a ``MixedPrecisionPolicy`` (default: full precision): compute in
            ``param_dtype`` on a local cast copy, all-reduce in ``reduce_dtype``.
        offload_policy: ``OffloadPolicy()`` (default, none) or ``CPUOffloadPolicy()`` (the
            parameters and gradients stay on the CPU; a copy computes on the device).
        ignored_params: parameters to leave as they are, not replicated and not reduced
            (default ``None``).
        dp_mesh_dims: the dimension(s) of ``mesh`` to replicate over,
            ``DataParallelMeshDims(replicate=name)`` (several names flattened into one); it
            names no shard dimension, which is ``fully_shard``'s. ``mesh`` is then the job's
            full SPMD mesh, and every parameter must be a ``DTensor`` on it, ``Replicate()``
            on those dimensions (see [Note: SPMD meshes] in ``fsdp_core/_spmd_mesh.py``;
            default ``None``: ``mesh`` is 1-D).

    Returns:
        ``module`` (now also an ``FSDPModule``).
    """
    modules = validate_modules("replicate", module)
    mesh = default_mesh("replicate", mesh, modules)
    spmd = None
    if dp_mesh_dims is not None:
        spmd = _spmd_mesh(mesh, dp_mesh_dims)
        mesh = spmd.dp_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"replicate expects a 1D DeviceMesh but got {mesh}: mesh must be 1-D, got a "
            f"{mesh.ndim}-D mesh. Pass init_device_mesh(type, (world,)), the replicate "
            "dimension of yours (mesh['replicate']), or name it with "
            "dp_mesh_dims=DataParallelMeshDims(replicate=...)."
        )
    validate_policies("replicate", mp_policy, offload_policy)
    ignored = validate_ignored("replicate", ignored_params)
    specs = collect_specs("replicate", modules, ignored, _validate_no_scalars)
    make_unit = unit_factory(
        modules,
        mesh,
        replicate=True,
        spmd=spmd,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )
    unit: FSDPUnit | None = make_unit(specs) if specs else None
    config = RuntimeConfig(
        reshard_after_forward=False,  # nothing to free or gather again: see [Note: replicate]
        limit_all_gathers=True,
        input_dtype=mp_policy.param_dtype if mp_policy.cast_forward_inputs else None,
        output_dtype=mp_policy.output_dtype,
        cast_inputs_always=True,  # as FSDP2
        api="replicate",
    )
    attach("replicate", modules, FSDPState(modules[0], unit, config), make_unit, "Replicate")
    return module


def _spmd_mesh(mesh: Any, dims: DataParallelMeshDims) -> SpmdMesh:
    """``mesh`` as the full SPMD mesh, replicated over the dimension(s) ``dims.replicate``."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"replicate: dp_mesh_dims takes a DataParallelMeshDims, got {dims!r}.")
    if dims.shard_names:
        raise ValueError(
            f"replicate() with dp_mesh_dims requires replicate-only dims (no shard dims), got "
            f"{dims}. Use fully_shard() for sharding, or pass "
            f"DataParallelMeshDims(replicate={dims.replicate!r})."
        )
    return resolve_spmd_mesh("replicate", mesh, (), dims.replicate_names)


def _validate_no_scalars(specs: list[Any]) -> None:
    scalars = sorted(s.fqn for s in specs if s.param.dim() == 0)
    if scalars:
        raise ValueError(
            f"replicate doesn't support scalar parameters {scalars}: a unit keeps each "
            f"parameter as rows of dim 0. Change {', '.join(scalars)} to a 1D tensor with numel "
            "equal to 1."
        )
