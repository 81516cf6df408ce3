"""Resharding after forward to a smaller world: ``reshard_after_forward=N`` (an int).

[Note: reshard after forward to a smaller world]
With ``reshard_after_forward=True`` a unit frees its unsharded parameters after forward and
all-gathers them again over the whole shard group in backward; with ``False`` it keeps them
whole. An int ``N`` that divides the shard world size ``W`` sits between the two, like ZeRO++'s
secondary partition: the shard group splits into ``W / N`` groups of ``N`` consecutive ranks,
and after forward each rank keeps ``W / N`` of the ``W`` blocks of the forward all-gather's
output (rank ``k`` of its group keeps blocks ``[k * W / N, (k + 1) * W / N)``). Backward
all-gathers those kept blocks inside the group of ``N``, which yields the ``W`` blocks in order,
exactly the forward all-gather's output, and copies them out as usual. So each rank holds
``1 / N`` of the unit between forward and backward, and the backward all-gather moves as many
bytes as the forward one but only inside the smaller group (e.g. one node).

The kept blocks include the columns of the forward all-gather's order tags (see [Note: order
check]); the backward gather inside the small group is not tagged itself, and the copy-out
never reads those columns. ``N == 1`` means keep everything (``False``) and ``N == W`` means
``True``: the door resolves both before a unit sees them.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from . import _collectives

__all__ = ["PostForwardShards", "post_forward_group"]

# (thread, ranks of the shard group, N) -> this rank's group of N; every rank creates every
# group once. The thread is part of the key because ranks that are threads of one process (thread
# mode) each see only their own groups.
_GROUPS: dict[tuple[int, tuple[int, ...], int], dist.ProcessGroup] = {}


def post_forward_group(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``group`` (created collectively)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (threading.get_ident(), ranks, size)
    cached = _GROUPS.get(key)
    if cached is not None:
        try:
            dist.get_process_group_ranks(cached)
        except (
            KeyError,
            ValueError,
            RuntimeError,
        ):  # destroyed since (a new default group): rebuild
            del _GROUPS[key]
    if key not in _GROUPS:
        mine = None
        for start in range(0, len(ranks), size):
            members = list(ranks[start : start + size])
            created = dist.new_group(members)
            if dist.get_rank() in members:
                mine = created
        if mine is None:
            raise AssertionError(f"[rank {dist.get_rank()}] not in shard group {ranks}")
        _GROUPS[key] = mine
    return _GROUPS[key]


class PostForwardShards:
    """The blocks one unit keeps between forward and backward. See the note above.

    Args:
        group: this rank's group of ``N`` ranks.
        shard_world: ``W``, the unit's shard group size.
    """

    def __init__(self, group: dist.ProcessGroup, shard_world: int) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.shard_world = shard_world
        self._rank = dist.get_rank(group)
        self.blocks: torch.Tensor | None = None  # (W / N, gathered block numel)

    def keep(self, gathered: torch.Tensor) -> None:
        """Keep this rank's ``W / N`` blocks of a forward all-gather's output (1D)."""
        per_rank = self.shard_world // self.size
        rows = gathered.view(self.shard_world, -1)
        self.blocks = rows[self._rank * per_rank : (self._rank + 1) * per_rank].clone()

    def regather(self, *, unit: str) -> torch.Tensor:
        """All-gather the kept blocks inside the group: the forward all-gather's output."""
        if self.blocks is None:
            raise AssertionError(f"[rank {dist.get_rank()}] {unit}: no blocks kept after forward")
        send = self.blocks.view(-1)
        out = torch.empty(send.numel() * self.size, dtype=send.dtype, device=send.device)
        _collectives.all_gather_flat(out, send, self.group, unit=unit)
        self.blocks = None
        return out

    def drop(self) -> None:
        self.blocks = None
