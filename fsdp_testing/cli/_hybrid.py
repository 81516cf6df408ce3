"""Hybrid rows of ``fsdp-testing check``: their 2-D mesh, the engine adapter that shards over it,
and the process group each collective family must use.

[Note: hybrid rows]
A hybrid row (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``) runs at world size 4 as a 2 x 2 grid,
whatever ``--world-size`` says: mesh dims ``("replicate", "shard")``, so the shard groups are
{0, 1} and {2, 3} and the replicate groups {0, 2} and {1, 3}. The reference models and the DDP
reference train over the whole world as in every other row; the engine shards over the mesh:

- every engine gets the mesh as ``device_mesh=`` (the FSDP1 option; the composable engines
  ``fsdp_core_fully_shard`` and ``torch_fsdp2`` call ``fully_shard(mesh=...)`` with it), in
  place of the world group the models pass;
- a unit the model puts on another group (``moe``'s expert, on a group of its own rank) keeps
  that group with the matching single-group strategy (``FULL_SHARD`` for ``HYBRID_SHARD``,
  ``SHARD_GRAD_OP`` for ``_HYBRID_SHARD_ZERO2``), as hybrid instances mix with others in torch.

The theory ([Note: theoretical volume]) is per family; on the wire each family must also use
its group: all-gathers and reduce-scatters the rank's shard group, all-reduces its replicate
group (every family the world group in the other rows). Each rank compares its bytes per
(family, group) with that, so an all-reduce over the wrong group is a mismatch even where the
totals agree.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ._matrix import HYBRID_GRID, Config

__all__ = ["MeshEngine", "expected_groups", "hybrid_mesh", "mesh_groups"]

#: The single-group strategy of a unit that a hybrid row leaves on its own group.
_SINGLE_GROUP = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


def hybrid_mesh(device_type: str) -> Any:
    """The 2 x 2 mesh of a hybrid row, dims ``("replicate", "shard")`` (on every rank)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    replicas, shard = HYBRID_GRID
    ranks = torch.arange(replicas * shard).view(replicas, shard)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("replicate", "shard"))


def mesh_groups(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (shard group, replicate group) ranks in ``mesh``."""
    shard = tuple(dist.get_process_group_ranks(mesh.get_group("shard")))
    replicate = tuple(dist.get_process_group_ranks(mesh.get_group("replicate")))
    return shard, replicate


def expected_groups(
    totals: dict[str, tuple[int, int]], config: Config, mesh: Any | None
) -> dict[str, dict[str, tuple[int, int]]]:
    """The theory per family and group: ``family -> {"r0,r1": (calls, bytes)}``. See
    [Note: hybrid rows]."""
    world = tuple(range(dist.get_world_size()))
    shard, replicate = mesh_groups(mesh) if config.hybrid and mesh is not None else (world, world)
    where = {"all_gather": shard, "reduce_scatter": shard, "all_reduce": replicate}
    return {kind: {group_key(where.get(kind, world)): value} for kind, value in totals.items()}


def group_key(ranks: tuple[int, ...]) -> str:
    """A group's ranks as a JSON key: ``"0,2"``."""
    return ",".join(map(str, ranks))


class MeshEngine:
    """An engine that shards over a hybrid row's mesh. See [Note: hybrid rows].

    Every attribute but :meth:`wrap` is the wrapped engine's.

    Args:
        engine: the row's engine.
        mesh: the 2-D mesh.
    """

    def __init__(self, engine: Any, mesh: Any) -> None:
        self.engine = engine
        self.mesh = mesh
        self._world = set(mesh.mesh.flatten().tolist())

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        if ranks is None or set(ranks) == self._world:
            return self.engine.wrap(module, None, device_mesh=self.mesh, **fsdp_kwargs)
        strategy = fsdp_kwargs.get("sharding_strategy")
        single = _SINGLE_GROUP.get(getattr(strategy, "name", ""))
        if strategy is not None and single is not None:
            fsdp_kwargs = {**fsdp_kwargs, "sharding_strategy": type(strategy)[single]}
        return self.engine.wrap(module, process_group, **fsdp_kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("engine", "mesh", "_world"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __repr__(self) -> str:
        return f"<engine {self.engine.name} on a 2-D mesh>"
