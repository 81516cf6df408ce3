"""Parameters that are already ``DTensor``s (tensor or expert parallel) when ``fully_shard`` takes
them: FSDP over the data-parallel mesh composed with the model-parallel mesh, as FSDP2 does.

[Note: tensor-parallel parameters]
``parallelize_module(model, tp_mesh, ...)`` leaves each parameter a ``DTensor`` on ``tp_mesh``
whose local tensor is this rank's tensor-parallel piece. ``fully_shard(model, mesh=dp_mesh)``
then shards that *local* tensor exactly like a plain parameter (rows of dim 0, or the
``shard_placement_fn`` dim, across ``dp_mesh``): the unit, its flat shard, its all-gather and
its reduce-scatter never see the tensor-parallel dimension. Only the parameters the module
shows change:

- sharded: a ``DTensor`` on the concatenated mesh ``(*dp_mesh dims, *tp_mesh dims)`` (both must
  be slices of one ``DeviceMesh``) with placements ``(*data-parallel ones, *tensor-parallel
  ones)``. When the tensor-parallel placements already split the dim FSDP shards, FSDP's rows
  are a strided piece of the global tensor: ``_StridedShard(dim, split_factor=number of
  tensor-parallel pieces of that dim)``, the placement FSDP2 uses, so ``full_tensor()`` and DCP
  see the right global layout.
- unsharded: a ``DTensor`` on ``tp_mesh`` with the original placements, whose local tensor is
  the unit's unsharded storage (so tensor-parallel modules compute as before); its gradient
  arrives as a ``DTensor`` and is redistributed to the original placements (a ``Partial``
  gradient is reduced across ``tp_mesh``) before the unit reduces its local tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._spmd_mesh import SpmdMesh

__all__ = ["local_grad", "sharded_layout", "tp_spec_of", "unsharded_param"]


def tp_spec_of(param: torch.Tensor, fsdp_mesh: Any, spmd: SpmdMesh | None = None) -> Any:
    """``param``'s ``DTensorSpec`` when it is a tensor-parallel ``DTensor`` (or one on the full
    SPMD mesh: see [Note: SPMD meshes] in ``_spmd_mesh``), else ``None``; raises for what FSDP2
    refuses too."""
    spec = getattr(param, "_spec", None)
    if spec is None or fsdp_mesh is None:
        return None
    if spmd is not None:
        return spec  # checked against the mesh when the unit was made
    if spec.mesh.device_type != fsdp_mesh.device_type:
        raise ValueError(
            "fully_shard: Requires DTensor to have mesh of the same type as the FSDP mesh but "
            f"got {spec.mesh.device_type} for DTensor and {fsdp_mesh.device_type} for FSDP."
        )
    if len(spec.placements) > 2:
        raise NotImplementedError(
            f"fully_shard: FSDP only supports 1D TP/EP or 2D EP+TP, not {spec.placements}."
        )
    return spec


def sharded_layout(
    mesh: Any, placements: tuple[Any, ...], dim: int, tp_spec: Any
) -> tuple[Any, tuple[Any, ...]]:
    """The mesh and placements of the sharded ``DTensor``: the data-parallel ``mesh`` and
    ``placements`` with the last one sharding on ``dim``, and a tensor-parallel parameter's own
    mesh dims and placements after them (see [Note: tensor-parallel parameters])."""
    from torch.distributed.tensor import Shard

    fsdp_mesh = mesh
    fsdp_placements = placements if dim == 0 else (*placements[:-1], Shard(dim))
    if tp_spec is None:
        return fsdp_mesh, fsdp_placements
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import _StridedShard

    split = tp_spec.num_shards_map[dim]
    if split > 1:
        fsdp_placements = (*fsdp_placements[:-1], _StridedShard(dim, split_factor=split))
    try:
        # FSDP2 builds the same mesh: the data-parallel dims, then the model-parallel ones.
        mesh = DeviceMesh._concatenate([fsdp_mesh, tp_spec.mesh])
    except (AssertionError, RuntimeError, TypeError, ValueError) as error:
        raise ValueError(
            f"fully_shard: the FSDP mesh {fsdp_mesh} and the tensor-parallel mesh "
            f"{tp_spec.mesh} of a DTensor parameter must be named dims of one DeviceMesh, e.g. "
            "mesh = init_device_mesh(type, (dp, tp), mesh_dim_names=('dp', 'tp')), then "
            f"parallelize_module(..., mesh['tp']) and fully_shard(..., mesh=mesh['dp']) ({error})."
        ) from error
    return mesh, (*fsdp_placements, *tp_spec.placements)


def unsharded_param(local: torch.Tensor, tp_spec: Any, requires_grad: bool) -> nn.Parameter:
    """``local`` (the unit's unsharded storage) as the parameter the module computes with."""
    if tp_spec is None:
        return nn.Parameter(local, requires_grad=requires_grad)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = tp_spec.tensor_meta
    meta = TensorMeta(meta.shape, meta.stride, local.dtype)  # the compute dtype
    spec = DTensorSpec(tp_spec.mesh, tp_spec.placements, tensor_meta=meta)
    param = DTensor(local, spec, requires_grad=requires_grad)  # see ShardedParam._as_parameter
    param._is_param = True
    return param  # type: ignore[return-value]  # an nn.Parameter by ``_is_param``


def local_grad(
    grad: torch.Tensor | None, tp_spec: Any, spmd: SpmdMesh | None = None
) -> torch.Tensor | None:
    """The local tensor of an unsharded parameter's gradient, in the parameter's placements
    (on an SPMD mesh, but for the data-parallel dims: :meth:`SpmdMesh.grad_placements`)."""
    if grad is None or tp_spec is None:
        return grad
    target = tuple(tp_spec.placements)
    if spmd is not None:
        target = spmd.grad_placements(grad.placements, target)  # type: ignore[attr-defined]
    if tuple(grad.placements) != target:  # type: ignore[attr-defined]
        grad = grad.redistribute(placements=target)  # type: ignore[attr-defined]
    local: torch.Tensor = grad._local_tensor  # type: ignore[union-attr]
    return local
