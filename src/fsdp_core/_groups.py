"""The process groups of a unit: sharded over one group, replicated across another (HSDP).

[Note: unit groups]
A unit's parameters are dim-0 sharded over ``UnitGroups.shard`` and each shard is replicated
across ``UnitGroups.replicate``; a missing group means this rank alone:

- ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``fully_shard`` on a 1-D mesh: ``shard=G``.
- ``NO_SHARD``, ``replicate``: ``replicate=G`` (every rank holds whole parameters).
- ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``, ``fully_shard`` on a 2-D mesh: both. The groups
  are the rows (shard groups) and columns (replicate groups) of a grid of ranks, ``grid``:
  every shard group has the same size and meets every replicate group in exactly one rank.

Data path: an unshard all-gathers inside the shard group. A reduction pre-divides the gradients
by ``world`` (shard size x replicate size: the average is over every rank that holds a replica
of the unit), reduce-scatters them inside the shard group, then all-reduces the reduced shard
across the replicate group, each step skipped over a group of one. For ``HYBRID_SHARD`` on a
2 x 2 grid a unit of ``B`` padded gradient bytes moves ``B`` in the reduce-scatter (input) and
``B / 2`` in the all-reduce; the all-gather moves ``B`` (output) inside the shard group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Grid",
    "UnitGroups",
    "default_hybrid_groups",
    "hybrid_groups_from_mesh",
    "hybrid_groups_from_pair",
]

Grid = tuple[tuple[int, ...], ...]
"""Global ranks of a hybrid layout: row ``i`` is a shard group, column ``j`` a replicate group."""

_HYBRID_FIX = (
    "Pass the groups of a 2-D grid of ranks, e.g. device_mesh=init_device_mesh(device_type, "
    "(replicas, shard_size), mesh_dim_names=('replicate', 'shard'))"
)


@dataclass(frozen=True)
class UnitGroups:
    """Where a unit's parameters live. See [Note: unit groups].

    Args:
        shard: the group the parameters are dim-0 sharded over (default ``None``: unsharded).
        replicate: the group each shard is replicated across, whose ranks all-reduce the
            reduced gradient shard (default ``None``: no replicas).
        grid: the ranks of both kinds of groups, for a hybrid layout (default ``None``).
    """

    shard: dist.ProcessGroup | None = None
    replicate: dist.ProcessGroup | None = None
    grid: Grid | None = None

    @property
    def shard_size(self) -> int:
        return 1 if self.shard is None else dist.get_world_size(self.shard)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard is None else dist.get_rank(self.shard)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate is None else dist.get_rank(self.replicate)

    @property
    def world(self) -> int:
        """Ranks holding a part or a replica of the unit: what gradients are averaged over."""
        return self.shard_size * self.replicate_size

    @property
    def is_hybrid(self) -> bool:
        return self.shard is not None and self.replicate is not None

    def collective_groups(self) -> list[dist.ProcessGroup]:
        """The groups the unit communicates over (shard first), groups of one left out."""
        return [
            g for g in (self.shard, self.replicate) if g is not None and dist.get_world_size(g) > 1
        ]

    def ranks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Global ranks of the shard group and of the replicate group (``()`` when absent)."""
        return tuple(
            tuple(dist.get_process_group_ranks(g)) if g is not None else ()
            for g in (self.shard, self.replicate)
        )  # type: ignore[return-value]

    def broadcast_steps(self) -> list[tuple[dist.ProcessGroup, int]]:
        """``(group, source global rank)`` broadcasts that give every rank the values of the
        layout's first rank (``grid[0][0]``; global rank 0 when the grid is the world)."""
        if self.grid is not None and self.shard is not None and self.replicate is not None:
            me = dist.get_rank()
            row = next(i for i, ranks in enumerate(self.grid) if me in ranks)
            column = self.grid[row].index(me)
            # Row-wise from column 0, then column-wise from row 0: (i, j) <- (0, j) <- (0, 0).
            return [(self.shard, self.grid[row][0]), (self.replicate, self.grid[0][column])]
        group = self.shard if self.shard is not None else self.replicate
        if group is None:
            return []
        return [(group, dist.get_global_rank(group, 0))]


def hybrid_groups_from_mesh(api: str, mesh: Any) -> UnitGroups:
    """The groups of a 2-D ``DeviceMesh``: dim 0 replicates, dim 1 shards (as torch)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{api}: device_mesh takes a 2-D DeviceMesh, got {mesh!r}.")
    if mesh.ndim != 2:
        raise ValueError(
            f"{api}: hybrid sharding takes a 2-D mesh (dims ('replicate', 'shard')), got a "
            f"{mesh.ndim}-D mesh {mesh}. Slice the two data-parallel dimensions out of it, "
            "e.g. mesh['replicate', 'shard'], or pass init_device_mesh(device_type, "
            "(replicas, shard_size), mesh_dim_names=('replicate', 'shard'))."
        )
    grid = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
    return UnitGroups(shard=mesh.get_group(1), replicate=mesh.get_group(0), grid=grid)


def hybrid_groups_from_pair(api: str, pair: object) -> UnitGroups:
    """The groups of ``process_group=(shard_group, replicate_group)``, checked to tile the world.

    Every rank of the default group must call it (one all-gather of two rank masks): all ranks
    see every rank's groups and raise the same error if they do not form a grid. A pair checked
    once is not checked again (``auto_wrap_policy`` passes it to every nested instance).
    """
    if not (
        isinstance(pair, tuple)
        and len(pair) == 2
        and all(isinstance(g, dist.ProcessGroup) for g in pair)
    ):
        raise ValueError(
            f"{api}: a hybrid sharding strategy takes process_group=(shard_group, "
            f"replicate_group), a device_mesh or neither, got process_group={pair!r}. "
            f"{_HYBRID_FIX}."
        )
    shard, replicate = pair
    checked = _CHECKED.get((id(shard), id(replicate)))
    if checked is not None:
        return checked[2]
    world = dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL moves CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    masks = torch.zeros(2, world, dtype=torch.int32)
    for row, group in enumerate(pair):
        masks[row, dist.get_process_group_ranks(group)] = 1
    masks = masks.to(device)
    gathered = [torch.empty_like(masks) for _ in range(world)]
    dist.all_gather(gathered, masks)
    gathered = [m.cpu() for m in gathered]
    shards = [frozenset(torch.nonzero(m[0]).flatten().tolist()) for m in gathered]
    replicas = [frozenset(torch.nonzero(m[1]).flatten().tolist()) for m in gathered]
    problem = _grid_problem(shards, replicas)
    if problem is not None:
        found = sorted({tuple(sorted(s)) for s in shards})
        across = sorted({tuple(sorted(r)) for r in replicas})
        raise ValueError(
            f"{api}: process_group=(shard_group, replicate_group) must tile the world "
            f"({world} ranks) as a grid: {problem}. Got shard groups {found} and replicate "
            f"groups {across}. {_HYBRID_FIX}, or groups with the same ranks."
        )
    rows = sorted({tuple(sorted(s)) for s in shards})
    columns = sorted({tuple(sorted(r)) for r in replicas})
    grid = tuple(tuple(next(iter(set(row) & set(col))) for col in columns) for row in rows)
    return _remember(UnitGroups(shard=shard, replicate=replicate, grid=grid))


# (id(shard), id(replicate)) -> the groups (kept alive, so the ids stay theirs) and the layout.
_CHECKED: dict[tuple[int, int], tuple[Any, Any, UnitGroups]] = {}


def _remember(groups: UnitGroups) -> UnitGroups:
    _CHECKED[(id(groups.shard), id(groups.replicate))] = (groups.shard, groups.replicate, groups)
    return groups


def _grid_problem(shards: list[frozenset[int]], replicas: list[frozenset[int]]) -> str | None:
    """Why the groups of every rank (by global rank) do not form a grid, or ``None``."""
    for kind, groups in (("shard", shards), ("replicate", replicas)):
        for rank, group in enumerate(groups):
            if rank not in group:
                return f"rank {rank} is not in its own {kind} group {sorted(group)}"
            other = next((q for q in group if groups[q] != group), None)
            if other is not None:
                return (
                    f"ranks {rank} and {other} pass different {kind} groups "
                    f"({sorted(group)} and {sorted(groups[other])}): the {kind} groups overlap"
                )
        sizes = sorted({len(g) for g in groups})
        if len(sizes) > 1:
            return f"the {kind} groups have different sizes {sizes}"
    for rank, group in enumerate(shards):
        if len(group & replicas[rank]) != 1 or any(len(group & r) != 1 for r in replicas):
            return (
                f"rank {rank}'s shard group {sorted(group)} does not meet every replicate group "
                "in exactly one rank"
            )
    return None


# (world ranks, node size) -> this rank's (shard, replicate) groups and the grid.
_DEFAULT: dict[tuple[tuple[int, ...], int], UnitGroups] = {}


def default_hybrid_groups(api: str) -> UnitGroups:
    """Shard within a node, replicate across nodes, as torch does without groups.

    The node size is ``LOCAL_WORLD_SIZE`` (set by torchrun), else the number of CUDA devices,
    else the whole world (one machine: a single shard group, no replicas). Every rank creates
    every group once per default group (``dist.new_group`` is collective).
    """
    world = dist.get_world_size()
    node = _node_size(api, world)
    key = (tuple(range(world)), node)
    cached = _DEFAULT.get(key)
    if cached is not None and _alive(cached):
        return cached
    grid = tuple(tuple(range(start, start + node)) for start in range(0, world, node))
    me = dist.get_rank()
    shard = replicate = None
    for row in grid:
        group = dist.new_group(list(row))
        if me in row:
            shard = group
    for column in zip(*grid, strict=True):
        group = dist.new_group(list(column))
        if me in column:
            replicate = group
    _DEFAULT[key] = _remember(UnitGroups(shard=shard, replicate=replicate, grid=grid))
    return _DEFAULT[key]


#: Backends that say nothing of a GPU: gloo's collectives run on host memory (torch registers
#: gloo for cuda too, but its reduce-scatter takes CPU tensors only), ``local`` and ``threaded``
#: are the harness's CPU groups, and ``fake`` moves nothing (the harness's fake ranks compute on
#: the CPU; a mesh passed explicitly still puts them anywhere).
_HOST_BACKENDS = frozenset({"gloo", "local", "threaded", "fake"})


def backend_moves_cuda_memory() -> bool:
    """Whether the default group's backend for CUDA tensors is a device backend (nccl), so that
    a GPU's presence says where the ranks compute: the backend's name is one backend
    (``"nccl"``) or a map (``"cpu:gloo,cuda:nccl"``). Over gloo a machine's GPUs say nothing of
    a job whose ranks compute on the CPU (a test written on a CPU-only machine, run on a GPU
    node), so the default mesh stays on the CPU and nodes are not sized by them."""
    name = str(dist.get_backend())
    if ":" in name:
        by_device = dict(part.split(":", 1) for part in name.split(","))
        name = by_device.get("cuda", "")
    return bool(name) and name.lower() not in _HOST_BACKENDS


def _node_size(api: str, world: int) -> int:
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is not None:
        node = int(text)
        if node < 1 or world % node:
            raise ValueError(
                f"{api}: LOCAL_WORLD_SIZE={text} does not divide the world size {world}, so "
                f"ranks cannot be grouped by node. {_HYBRID_FIX}."
            )
        return node
    count = 0
    if torch.cuda.is_available() and backend_moves_cuda_memory():
        count = torch.cuda.device_count()
    return count if count and world % count == 0 else world


def _alive(groups: UnitGroups) -> bool:
    """Whether the cached groups still belong to the current default group."""
    try:
        for group in (groups.shard, groups.replicate):
            if group is not None:
                dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True
