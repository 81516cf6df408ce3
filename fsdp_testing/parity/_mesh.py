"""Model-parallel code on a device mesh, for :func:`check_parity`: which batch a rank trains on
(its data-parallel coordinate), the full state of the code under test assembled from its DTensor
parameters or from a declared layout of plain local shards, and, when a tensor diverges, the
mesh coordinates whose shards differ.

[Note: model-parallel parity]
Tensor, sequence and expert parallel code splits one replica's work across the ranks of some
mesh dims; data parallelism splits the batch across the others. The reference is then one
replica trained on every data-parallel rank's batch (``reference="local"``: one process, the
mean of the ``D`` data-parallel batches' losses; ``"ddp"``: DDP over the data-parallel ranks),
whatever the model-parallel dims do, so ``get_batch(i, dp_rank)`` is called with a rank's
coordinate over the data-parallel dims (flattened, row-major), never its global rank: the
ranks of one replica must see the same batch. The full state of the code under test is
assembled automatically: a DTensor parameter by ``full_tensor()``, a plain one named in
``layout`` (the dim it is split on across the model-parallel ranks of its replica, even
chunks as ``torch.chunk`` cuts; or ``(dim, mesh_dim)``: split across the ranks of that one mesh
dim, e.g. experts across the data-parallel ranks of expert parallelism) by an all-gather over
those ranks, any other as it is (replicated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._causes import MeshShards

__all__ = ["MeshLayout", "layout_from_plan"]

_API = "check_parity"


def layout_from_plan(plan: Mapping[str, Any]) -> dict[str, int]:
    """A ``layout`` for :func:`check_parity` from a torch ``parallelize_plan``
    (``{"w1": ColwiseParallel(), "w2": RowwiseParallel()}``): a colwise linear's weight and bias
    are split on dim 0, a rowwise linear's weight on dim 1 (its bias is replicated), an
    embedding's weight on dim 1 (colwise) or 0 (rowwise)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layout: dict[str, int] = {}
    for fqn, style in plan.items():
        if isinstance(style, ColwiseParallel):
            layout[f"{fqn}.weight"] = 0
            layout[f"{fqn}.bias"] = 0
        elif isinstance(style, RowwiseParallel):
            layout[f"{fqn}.weight"] = 1
        else:
            raise ValueError(
                f"layout_from_plan: {fqn!r} has {type(style).__name__}; only ColwiseParallel "
                "and RowwiseParallel split a module's own parameters. Give its parameters' dims "
                "in layout={name: dim} instead"
            )
    return layout


class MeshLayout:
    """A rank's place on the mesh for :func:`check_parity` (see [Note: model-parallel
    parity]).

    Args:
        mesh: the device mesh the code under test runs on (None: data parallel over the group).
        dp_dims: the mesh dims that split the batch (names or indices; default: none).
        layout: plain parameters split across the other dims: name -> the dim split, or
            ``(dim, mesh_dim)`` for a parameter split across one mesh dim's ranks.
    """

    def __init__(
        self,
        mesh: Any,
        dp_dims: str | int | Iterable[str | int] | None,
        layout: Mapping[str, int | tuple[int, str | int]] | None,
    ) -> None:
        self.mesh = mesh
        self.layout: dict[str, tuple[int, list[int]]] = {}
        names = list(mesh.mesh_dim_names or range(mesh.ndim))
        wanted = [dp_dims] if isinstance(dp_dims, (str, int)) else list(dp_dims or ())
        self.dp = [self._index(d, names) for d in wanted]
        self.mp = [i for i in range(mesh.ndim) if i not in self.dp]
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"{_API}: this rank is not in the mesh {mesh}")
        self.coordinate = list(coordinate)
        self.names = [str(n) for n in names]
        shape = list(mesh.mesh.shape)
        self.dp_world = _prod(shape[i] for i in self.dp)
        self.dp_rank = _flat(self.coordinate, shape, self.dp)
        self._shape = shape
        for name, spec in (layout or {}).items():
            if isinstance(spec, tuple):
                dim, over = spec
                self.layout[name] = (int(dim), [self._index(over, names)])
            else:
                self.layout[name] = (int(spec), list(self.mp))
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {
            tuple(dims): self._group(dims) for _, dims in self.layout.values()
        }

    def _index(self, dim: str | int, names: list[Any]) -> int:
        if isinstance(dim, int) and 0 <= dim < len(names):
            return dim
        if dim in names:
            return names.index(dim)
        raise ValueError(
            f"{_API}: dp_dims names {dim!r}, which is not a dim of the mesh (its dims: "
            f"{names}); name the data-parallel dims, or none"
        )

    def _group(self, dims: list[int]) -> dist.ProcessGroup | None:
        """The process group of the ranks that differ from this one only in ``dims``."""
        if not dims:
            return None
        if len(dims) == 1:
            return self.mesh.get_group(dims[0])
        names = [self.names[i] for i in dims]
        return self.mesh[tuple(names)]._flatten().get_group()

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks of this rank's model-parallel coordinate (None: none)."""
        return self._group(self.dp)

    def where(self, coordinate: list[int]) -> str:
        """``(dp=0, tp=1)``."""
        pairs = zip(self.names, coordinate, strict=True)
        return "(" + ", ".join(f"{name}={index}" for name, index in pairs) + ")"

    def shards(
        self, group: dist.ProcessGroup, module: Any, rename: Callable[[str], str]
    ) -> MeshShards | None:
        """Where each rank of ``group`` sits and how each parameter of ``module`` is split, for
        the likely causes (see [Note: shards on a mesh] in ``_causes``): the layout's, and a
        DTensor's with one ``Shard`` placement. None if a rank of ``group`` is not in the
        mesh."""
        ranks = self.mesh.mesh
        coordinates = []
        for rank in range(dist.get_world_size(group)):
            found = (ranks == dist.get_global_rank(group, rank)).nonzero()
            if found.shape[0] != 1:
                return None
            coordinates.append(tuple(int(i) for i in found[0]))
        splits = {name: (dim, tuple(dims)) for name, (dim, dims) in self.layout.items()}
        if isinstance(module, torch.nn.Module):
            for raw, param in module.named_parameters():
                split = self._dtensor_split(param)
                if split is not None:
                    splits.setdefault(rename(raw), split)
        return MeshShards(
            names=tuple(self.names),
            shape=tuple(self._shape),
            coordinates=tuple(coordinates),
            dp_dims=tuple(self.dp),
            splits=splits,
        )

    def _dtensor_split(self, param: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
        """A DTensor's (dim, mesh dims) when it has one ``Shard`` placement, the others
        ``Replicate``, on mesh dims of this mesh's names."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(param, DTensor):
            return None
        names = param.device_mesh.mesh_dim_names
        sharded = [(i, p) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
        others = [p for p in param.placements if not isinstance(p, (Shard, Replicate))]
        if names is None or len(sharded) != 1 or others or names[sharded[0][0]] not in self.names:
            return None
        index, placement = sharded[0]
        return placement.dim, (self.names.index(names[index]),)

    def shape_mismatch(self, name: str, full: tuple[int, ...], model: tuple[int, ...]) -> str:
        """Why ``name``'s full value has shape ``full`` where the model's is ``model``: what
        the layout gathered, or that it is not in the layout."""
        split = self.layout.get(name)
        if split is None:
            return (
                f"{name} is not in layout, so its {full} was taken as the full (replicated) "
                f"value; if it is a shard, name its dim in layout[{name!r}]"
            )
        dim, dims = split
        world = _prod(self._shape[i] for i in dims)
        across = ", ".join(self.names[i] for i in dims) or "no mesh dim"
        local = list(full)
        if 0 <= dim < len(local) and world > 0:
            local[dim] //= world
        line = (
            f"{name} gathered on dim {dim} across {across} ({world} shards of {tuple(local)}) "
            f"gives {full}, the model's is {model}"
        )
        fits = [
            d
            for d in range(len(local))
            if d != dim
            and tuple(n * world if i == d else n for i, n in enumerate(local)) == tuple(model)
        ]
        if fits:
            line += f" (gathered on dim {fits[0]} it would be {model})"
        return (
            line + f": check layout[{name!r}] (the shard dim, or which mesh dims it splits across)"
        )

    # --- the full state ---------------------------------------------------------------------

    def full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """``param``'s full value (a collective for a DTensor or a declared shard: every rank
        assembles the same parameters in the same order)."""
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor):
            return param.full_tensor()
        split = self.layout.get(name)
        if split is None:
            return param
        dim, dims = split
        world = _prod(self._shape[i] for i in dims)
        if world == 1:
            return param
        pieces = [torch.empty_like(param) for _ in range(world)]
        dist.all_gather(pieces, param.detach().contiguous(), group=self._groups[tuple(dims)])
        return torch.cat(pieces, dim=dim)

    def local_of(self, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (the reference's value of ``param``) this rank should hold."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            laid = distribute_tensor(
                full.detach(), param.device_mesh, param.placements, src_data_rank=None
            )
            return laid.to_local()
        split = self.layout.get(name)
        if split is None:
            return full
        dim, dims = split
        world = _prod(self._shape[i] for i in dims)
        return full.chunk(world, dim=dim)[_flat(self.coordinate, self._shape, dims)]


def full_state_of(
    module: torch.nn.Module, mesh: MeshLayout | None, rename: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """Every parameter of ``module``, full, by the model's names (see [Note: model-parallel
    parity]; without a mesh, DTensor parameters are assembled all the same)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for raw, param in module.named_parameters():
        name = rename(raw)
        if mesh is not None:
            out[name] = mesh.full(name, param)
        elif isinstance(param, DTensor):
            out[name] = param.full_tensor()
        else:
            out[name] = param
    return out


def shard_lines(
    module: Any,
    mesh: MeshLayout,
    rename: Callable[[str], str],
    reference: Mapping[str, torch.Tensor],
    diverged: list[str],
    tolerance: tuple[float, float],
) -> list[str]:
    """For each diverging tensor, the mesh coordinates whose shards differ from the reference's
    (a collective over the world: every rank answers for its own shards)."""
    rtol, atol = tolerance
    mine: dict[str, bool] = {}
    params = {rename(n): p for n, p in module.named_parameters()} if module is not None else {}
    for name in diverged:
        param, full = params.get(name), reference.get(name)
        if param is None or full is None:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        expected = mesh.local_of(name, param, full)
        same = local.shape == expected.shape and torch.allclose(
            local.detach().float(), expected.detach().float(), rtol=rtol, atol=atol
        )
        mine[name] = bool(same)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mesh.coordinate, mine))
    lines = []
    for name in diverged:
        differ = [mesh.where(c) for c, verdicts in everyone if not verdicts.get(name, True)]
        if not differ:
            continue
        total = sum(1 for _, verdicts in everyone if name in verdicts)
        lines.append(
            f"{name}: the shards of {len(differ)} of {total} mesh coordinates differ from the "
            f"reference's: {', '.join(differ[:8])}{', ...' if len(differ) > 8 else ''}"
        )
    return lines


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _flat(coordinate: list[int], shape: list[int], dims: list[int]) -> int:
    """The row-major index of ``coordinate`` over ``dims``."""
    index = 0
    for i in dims:
        index = index * shape[i] + coordinate[i]
    return index
