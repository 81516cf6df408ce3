"""A tensor-parallel library written from scratch on ``torch.distributed`` (Megatron-style, plain
local shards, no DTensor), the kind of code ``examples/test_tensor_parallel.py`` tests:

- :class:`ColumnParallelLinear` keeps rows ``[out / tp, in]`` of the weight: each rank computes
  its slice of the output features;
- :class:`RowParallelLinear` keeps columns ``[out, in / tp]``: each rank multiplies its slice of
  the input features, and an all-reduce sums the partial outputs;
- :class:`VocabParallelEmbedding` keeps rows of the vocabulary; :func:`vocab_parallel_cross_entropy`
  computes the loss over logits split on the vocabulary (a MAX all-reduce for the softmax's
  maximum, SUM all-reduces for its sum and the target logits);
- :func:`mlp` is column, GELU, row (of :func:`build_mlp`'s full MLP): one all-reduce forward,
  one backward; with ``sequence_parallel=True`` activations outside the MLP are split on the
  sequence dim, gathered before it and reduce-scattered after it;
  :func:`data_and_tensor_parallel` adds DDP across the ``dp`` dim of a 2-D mesh.

Every layer is built from the full (single-device) layer it replaces, by slicing its weights,
so a test trains the two side by side from one initialization: ``check_parity`` in
``examples/test_tensor_parallel.py``, or from the command line (``docs/cli.md``)::

    fsdp-testing check --model tensor_parallel:build_mlp --parallelize tensor_parallel:mlp \
        --reference same-batch --layout 0.weight=0,0.bias=0,2.weight=1 --input-shape 6,8
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "build_mlp",
    "data_and_tensor_parallel",
    "mlp",
    "vocab_parallel_cross_entropy",
]


def _ws(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


class _CopyToParallel(torch.autograd.Function):
    """Forward: the input as it is (every rank holds it); backward: the gradients summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Forward: the partial outputs summed; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel: forward gathers the sequence shards (dim 0); backward reduce-scatters
    the gradient back to them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty((x.shape[0] * _ws(group), *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty((grad.shape[0] // _ws(ctx.group), *grad.shape[1:]), dtype=grad.dtype)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class _ScatterSequence(torch.autograd.Function):
    """Sequence parallel: forward reduce-scatters the partial outputs to sequence shards;
    backward gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty((x.shape[0] // _ws(group), *x.shape[1:]), dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _GatherSequence.forward(ctx, grad, ctx.group), None


def _rows(t: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """This rank's even chunk of ``t`` along ``dim``."""
    return t.detach().chunk(_ws(group), dim=dim)[dist.get_rank(group)].clone()


class ColumnParallelLinear(nn.Module):
    """``full``'s output features split across ``group``: the input must be the same on every
    rank (its gradient is summed over them, unless ``gathered``: a sequence-parallel gather
    before it sums it already); the output is this rank's features."""

    def __init__(
        self, full: nn.Linear, group: dist.ProcessGroup, *, gathered: bool = False
    ) -> None:
        super().__init__()
        self.group = group
        self.gathered = gathered
        self.weight = nn.Parameter(_rows(full.weight, group))  # [out / tp, in]
        self.bias = nn.Parameter(_rows(full.bias, group)) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gathered:
            x = _CopyToParallel.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``full``'s input features split across ``group``: the input is this rank's features
    (a column-parallel layer's output); the output is whole on every rank, summed."""

    def __init__(
        self, full: nn.Linear, group: dist.ProcessGroup, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(_rows(full.weight, group, dim=1))  # [out, in / tp]
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        if self.bias is not None and sequence_parallel:
            # Each rank adds the bias to its sequence shard only: sum its gradient.
            self.bias.register_hook(lambda grad: _ReduceFromParallel.apply(grad, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = _ScatterSequence.apply(partial, self.group)
        else:
            out = _ReduceFromParallel.apply(partial, self.group)
        return out + self.bias if self.bias is not None else out


class _MLP(nn.Sequential):
    def __init__(self, layers: list[nn.Module], group: dist.ProcessGroup, sp: bool) -> None:
        super().__init__(*layers)
        self.group = group
        self.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = _GatherSequence.apply(x, self.group)
        return super().forward(x)


def mlp(full: nn.Sequential, group: dist.ProcessGroup, *, sequence_parallel: bool = False) -> Any:
    """``full`` (``Linear, GELU, Linear``) as column, GELU, row over ``group``; its parameters
    keep ``full``'s names (``0.weight``, ``2.bias``). With ``sequence_parallel`` its input and
    output are split on dim 0 (the sequence) across ``group``."""
    first, act, second = full
    return _MLP(
        [
            ColumnParallelLinear(first, group, gathered=sequence_parallel),
            act,
            RowParallelLinear(second, group, sequence_parallel=sequence_parallel),
        ],
        group,
        sequence_parallel,
    )


def build_mlp(dim: int = 8, hidden: int = 16) -> nn.Sequential:
    """The full (single-device) MLP that :func:`mlp` splits: ``Linear, GELU, Linear``."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def data_and_tensor_parallel(full: nn.Sequential, mesh: Any) -> nn.Module:
    """``full`` on a 2-D ``DeviceMesh`` with dims ``("dp", "tp")``: :func:`mlp` over the ``tp``
    ranks, then DDP over the ``dp`` ranks (each shard's gradient averaged over the replicas)."""
    tp = mlp(full, mesh.get_group("tp"))
    return nn.parallel.DistributedDataParallel(tp, process_group=mesh.get_group("dp"))


class VocabParallelEmbedding(nn.Module):
    """``full``'s vocabulary split across ``group`` (rows ``[vocab / tp, dim]``): each rank
    looks up the ids it holds, zeros the others, and an all-reduce sums the lookups."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(_rows(full.weight, group))
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromParallel.apply(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        # The softmax's maximum over the whole vocabulary: a MAX all-reduce.
        peak = logits.max(dim=-1).values.detach()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        vocab = logits.shape[-1]
        local = target - dist.get_rank(group) * vocab
        mine = (local >= 0) & (local < vocab)
        picked = shifted.gather(-1, local.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~mine, 0.0)
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(local.shape[0])
        grad_logits[rows[mine], local[mine]] -= 1.0
        return grad_logits * grad / local.shape[0], None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ``[N, vocab / tp]`` (this rank's part of the
    vocabulary, in rank order) against ``target`` ``[N]``, equal on every rank of ``group``."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)
