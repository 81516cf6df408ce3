"""Gradient norm clipping over the shards of every rank.

[Note: sharded gradient norm]
A sharded unit's gradient elements are spread over the ranks without overlap, so the p-th power
of the norm is a sum over ranks (a max for the inf-norm): each rank takes its local part, one
all-reduce (SUM, or MAX) over the root's group combines them. Gradients that every rank holds
in full (replicated units, parameters FSDP does not manage) are the same on every rank and are
added locally after the all-reduce, never counted once per rank. The clip coefficient is
``max_norm / (total + 1e-6)`` clamped to 1, the formula of ``torch.nn.utils.clip_grad_norm_``,
so clipping here equals clipping the unsharded model up to the summation order of the norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ._runtime import FSDPState

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    parameters: Iterable[nn.Parameter],
    states: list[FSDPState],
    group: dist.ProcessGroup,
    max_norm: float,
    norm_type: float,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place; return the total norm (fp32).

    Args:
        parameters: every parameter of the root's tree (sharded and not).
        states: every FSDP state under the root.
        group: the root's process group.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm; ``math.inf`` for the max norm.
    """
    norm_type = float(norm_type)
    sharded_ids = {
        id(p.sharded)
        for s in states
        if s.unit is not None and not s.unit.replicate
        for p in s.unit.params
    }
    devices = [s.unit.device for s in states if s.unit is not None]
    device = devices[0] if devices else torch.device("cpu")
    sharded: list[torch.Tensor] = []
    local: list[torch.Tensor] = []
    for param in parameters:
        if param.grad is not None:
            (sharded if id(param) in sharded_ids else local).append(param.grad)
    sharded_part = _norm_power(sharded, norm_type, device)
    if norm_type == math.inf:
        dist.all_reduce(sharded_part, op=dist.ReduceOp.MAX, group=group)
        total = torch.maximum(sharded_part, _norm_power(local, norm_type, device))
    else:
        dist.all_reduce(sharded_part, op=dist.ReduceOp.SUM, group=group)
        total = (sharded_part + _norm_power(local, norm_type, device)) ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in (*sharded, *local):
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
