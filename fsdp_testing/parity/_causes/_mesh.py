"""Where the ranks sit on a device mesh and how each parameter is split across it, as the causes
read them: the real extent of each shard and the ranks that hold it, and the names a report
gives them (see [Note: shards on a mesh])."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from ..._report.text import rank_ranges

__all__ = ["MeshShards"]

# [Note: shards on a mesh]
# Without a mesh the causes cut a parameter into ``world_size`` chunks, chunk ``r`` rank ``r``'s
# (a flat-buffer wrapper or a 1-D engine shards that way). On a device mesh that is wrong: a
# parameter named in ``layout`` (or a DTensor with one ``Shard`` placement) is split across some
# mesh dims only, ``n`` chunks for the product of their sizes, and every rank that differs from
# a holder only in the other dims (the data-parallel replicas) holds the same chunk. Each rank's
# full view of the parameter is gathered within its own replica, so a rank reads which chunk
# sits where in its replica (``peer``); the ranks of the other replicas that found the same
# thing are named with it, by rank and mesh coordinate, in one line (``holders``).


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshShards:
    """The device mesh the code under test ran on (see [Note: shards on a mesh]).

    Args:
        names: the mesh's dim names, e.g. ``("dp", "tp")``.
        shape: its size along each dim.
        coordinates: each rank's coordinate, by rank in the group the causes are agreed over.
        dp_dims: the dims that split the batch (indices; default none).
        splits: for each parameter assembled from shards: the tensor dim it is split on and
            the mesh dims it is split across (indices; default none).
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    coordinates: tuple[tuple[int, ...], ...]
    dp_dims: tuple[int, ...] = ()
    splits: Mapping[str, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shape):
            raise ValueError(f"MeshShards: {len(self.names)} names for a {len(self.shape)}-D mesh")
        wrong = [c for c in self.coordinates if len(c) != len(self.shape)]
        if wrong:
            raise ValueError(f"MeshShards: coordinates {wrong} do not fit the mesh {self.shape}")
        dims = set(range(len(self.shape)))
        outside = sorted(n for n, (_, over) in self.splits.items() if not set(over) <= dims)
        if outside:
            raise ValueError(
                f"MeshShards: splits of {', '.join(outside)} name dims outside the "
                f"{len(self.shape)}-D mesh"
            )

    @property
    def plain(self) -> bool:
        """A 1-D mesh whose coordinates are the ranks: a rank's number says where it is."""
        return len(self.shape) == 1 and all(c == (r,) for r, c in enumerate(self.coordinates))

    @property
    def model_parallel(self) -> tuple[int, ...]:
        """The dims that split the model, not the batch."""
        return tuple(i for i in range(len(self.shape)) if i not in self.dp_dims)

    @property
    def dp_world(self) -> int:
        """The ranks of one model-parallel coordinate: the data-parallel world size."""
        return _prod(self.shape[i] for i in self.dp_dims)

    def count(self, name: str) -> int:
        """How many chunks ``name`` is cut into (1: not split)."""
        split = self.splits.get(name)
        return _prod(self.shape[i] for i in split[1]) if split else 1

    def chunk_of(self, rank: int, name: str) -> int:
        """The chunk of ``name`` that ``rank`` holds (row-major over the dims it is split
        across, the order the all-gather concatenates)."""
        index = 0
        for i in self.splits[name][1]:
            index = index * self.shape[i] + self.coordinates[rank][i]
        return index

    def peer(self, rank: int, name: str, chunk: int) -> int | None:
        """The rank of ``rank``'s replica (same coordinate outside the split dims) that holds
        ``chunk`` of ``name``; None if the group has none."""
        dims = self.splits[name][1]
        mine = self.coordinates[rank]
        for other, where in enumerate(self.coordinates):
            same = all(where[i] == mine[i] for i in range(len(mine)) if i not in dims)
            if same and self.chunk_of(other, name) == chunk:
                return other
        return None

    def shard_label(self, name: str, chunk: int) -> str:
        """``"tp=1"``: the coordinate over the split dims of ``chunk``'s holders."""
        dims = self.splits[name][1]
        parts = []
        for i in reversed(dims):
            chunk, index = divmod(chunk, self.shape[i])
            parts.append(f"{self.names[i]}={index}")
        return ", ".join(reversed(parts))

    def where(self, rank: int) -> str:
        """``"(dp=1, tp=0)"``."""
        pairs = zip(self.names, self.coordinates[rank], strict=True)
        return "(" + ", ".join(f"{name}={index}" for name, index in pairs) + ")"

    def ranks_name(self, ranks: Sequence[int]) -> str:
        """``"rank 2 (dp=1, tp=0)"``, ``"ranks 0 (dp=0, tp=0) and 2 (dp=1, tp=0)"``; beyond
        three ranks, their numbers and the coordinates they share (``"ranks 0-3 (tp=0)"``)."""
        ordered = sorted(set(ranks))
        if len(ordered) == 1:
            return f"rank {ordered[0]} {self.where(ordered[0])}"
        if len(ordered) <= 3:
            named = [f"{r} {self.where(r)}" for r in ordered]
            return "ranks " + ", ".join(named[:-1]) + " and " + named[-1]
        shared = [
            f"{self.names[i]}={self.coordinates[ordered[0]][i]}"
            for i in range(len(self.shape))
            if len({self.coordinates[r][i] for r in ordered}) == 1
        ]
        return f"ranks {rank_ranges(ordered)}" + (f" ({', '.join(shared)})" if shared else "")


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out
