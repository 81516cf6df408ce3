"""Gradient norm clipping over the shards of every rank.

[Note: sharded gradient norm]
A sharded unit's gradient elements are spread over its shard group without overlap, so the p-th
power of the norm is a sum over that group (a max for the inf-norm): each rank takes its local
part (a ``DTensor`` gradient's local tensor), one all-reduce (SUM, or MAX) per distinct shard
group combines them, in the order the groups first appear among the units (the same on every
rank; rows of a hybrid grid reduce at the same position). A hybrid unit's replicas hold the
same reduced shards, so summing over the shard group only counts each element once, never once
per replica. Gradients that every rank holds in full (unsharded units, parameters FSDP does not
manage) are the same on every rank and are added locally after the all-reduce, never counted
once per rank. The clip coefficient is ``max_norm / (total + 1e-6)`` clamped to 1, the formula
of ``torch.nn.utils.clip_grad_norm_``, so clipping here equals clipping the unsharded model up
to the summation order of the norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ._param import local_tensor
from ._runtime import FSDPState

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    states: list[FSDPState],
    max_norm: float,
    norm_type: float,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place; return the total norm (fp32).

    Args:
        parameters: every parameter of the root's tree (sharded and not).
        states: every FSDP state under the root.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm; ``math.inf`` for the max norm.
    """
    norm_type = float(norm_type)
    # Shard group ranks -> (the group, ids of the sharded parameters over it), first seen first.
    by_group: dict[tuple[int, ...], tuple[dist.ProcessGroup, set[int]]] = {}
    for s in states:
        shard = s.unit.groups.shard if s.unit is not None else None
        if s.unit is None or shard is None or s.unit.shard_world == 1:
            continue
        key = tuple(dist.get_process_group_ranks(shard))
        by_group.setdefault(key, (shard, set()))[1].update(id(p.sharded) for p in s.unit.params)
    devices = [s.unit.device for s in states if s.unit is not None]
    device = devices[0] if devices else torch.device("cpu")
    sharded: list[list[torch.Tensor]] = [[] for _ in by_group]
    local: list[torch.Tensor] = []
    for param in parameters:
        if param.grad is None:
            continue
        index = next((i for i, (_, ids) in enumerate(by_group.values()) if id(param) in ids), None)
        # The local part: a DTensor gradient's norm would be a DTensor collective of its own.
        (local if index is None else sharded[index]).append(local_tensor(param.grad))
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    parts = [_norm_power(local, norm_type, device)]
    for (group, _), grads in zip(by_group.values(), sharded, strict=True):
        part = _norm_power(grads, norm_type, device)
        dist.all_reduce(part, op=op, group=group)
        parts.append(part)
    if norm_type == math.inf:
        total = torch.stack(parts).max()
    else:
        total = torch.stack(parts).sum() ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in (*(g for grads in sharded for g in grads), *local):
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def _norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``sum |g|^p`` over ``grads`` (``max |g|`` for inf) as an fp32 scalar on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads]
    )
    if norm_type == math.inf:
        return norms.max()
    return (norms**norm_type).sum()
