"""What ``fully_shard`` requires of each parameter it takes, and ``shard_placement_fn``: the dim
each parameter is sharded on (see [Note: sharding on another dim] in ``fsdp_core/_param.py``).

The rules and messages are FSDP2's, so code written against torch's ``fully_shard`` gets the
same error types: a scalar parameter (``ValueError``), a non-contiguous one
(``NotImplementedError``), a shard dim outside the tensor (:class:`ValueAssertionError`), an
uneven split on a dim other than 0 (``NotImplementedError``). Each message starts with the
door's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from .._init import ValueAssertionError
from .._param import ParamSpec, local_tensor

__all__ = ["ShardPlacementFn", "ValueAssertionError", "place_params", "validate_params"]

ShardPlacementFn = Callable[[nn.Parameter], Any]
"""``shard_placement_fn``: a parameter -> ``Shard(dim)``, or ``None`` for ``Shard(0)``."""


def validate_params(api: str, specs: list[ParamSpec]) -> None:
    """Scalars and non-contiguous parameters cannot be sharded: raise naming them."""
    scalars = [s.fqn for s in specs if s.param.dim() == 0]
    if scalars:
        raise ValueError(
            f"{api} doesn't support scalar parameters {scalars}: they cannot be sharded. "
            f"Change {', '.join(scalars)} to a 1D tensor with numel equal to 1."
        )
    strided = [
        f"{s.fqn} (shape {tuple(s.param.shape)}, stride {s.param.stride()})"
        for s in specs
        if not s.param.is_contiguous()
    ]
    if strided:
        raise NotImplementedError(
            f"{api}: FSDP does not support non-contiguous parameters yet: {strided}. Make them "
            "contiguous before sharding, e.g. module.to(memory_format=torch.contiguous_format)."
        )


def place_params(
    api: str, specs: list[ParamSpec], fn: ShardPlacementFn | None, mesh: Any, world: int
) -> list[ParamSpec]:
    """``specs`` with the shard dim ``fn`` picks for each parameter (dim 0 without ``fn``)."""
    if fn is None:
        return specs
    if not callable(fn):
        raise TypeError(
            f"{api}: shard_placement_fn takes a callable(param) -> Shard | None, got {fn!r}."
        )
    return [
        dataclasses.replace(s, shard_dim=_shard_dim(api, s, fn(s.param), mesh, world))
        for s in specs
    ]


def _shard_dim(api: str, spec: ParamSpec, result: object, mesh: Any, world: int) -> int:
    from torch.distributed.tensor import Shard

    placement = result
    if hasattr(result, "placement") and hasattr(result, "mesh_info"):  # ShardPlacementResult
        if result.mesh_info.mesh is not mesh:
            raise NotImplementedError(
                f"{api}: shard_placement_fn returned a ShardPlacementResult with its own mesh "
                f"for {spec.fqn}; fsdp_core shards every parameter of one fully_shard call over "
                "its mesh. Call fully_shard separately on the modules holding those parameters "
                "with that mesh."
            )
        placement = result.placement
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"{api}: invalid shard_placement_fn result {result!r} for {spec.fqn}: return "
            "Shard(dim), or None to shard on dim 0."
        )
    shape = local_tensor(spec.param).shape  # a tensor-parallel DTensor: its local piece
    dim = placement.dim + len(shape) if placement.dim < 0 else placement.dim
    if not 0 <= dim < len(shape):
        raise ValueAssertionError(
            f"{api}: Shard dim {placement.dim} is invalid for {len(shape)}D tensor: "
            f"{spec.fqn} has shape {tuple(shape)}. Return a dim in [{-len(shape)}, "
            f"{len(shape)}) from shard_placement_fn."
        )
    if dim > 0 and shape[dim] % world:
        raise NotImplementedError(
            f"{api}: FSDP does not support uneven sharding on dim {dim}: {spec.fqn} has shape "
            f"{tuple(shape)} (world size: {world}). Shard it on dim 0, or on a dim whose size "
            f"divides by {world}."
        )
    return dim
