"""The unit: the parameters one fully sharded module owns, with one unshard/reshard pair.

A unit knows nothing about hooks, roots or execution order (``_runtime`` drives it), so both
front doors (the ``FullyShardedDataParallel`` wrapper and a future ``fully_shard``) can share it.
Test helpers patch :meth:`FSDPUnit.unshard`, :meth:`FSDPUnit.reshard` and
:meth:`FSDPUnit.post_backward` by name on the class; the runtime always calls them through the
instance so such patches see every call.

Communication per unit: ``unshard`` issues one all-gather of the flat shard buffer (the
concatenation of every parameter's padded dim-0 shard), ``post_backward`` one reduce-scatter
(sharded) or all-reduce (replicated) of all of the unit's gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import _collectives, events
from ._param import ParamSpec, ShardedParam

__all__ = ["FSDPUnit"]


class FSDPUnit:
    """The parameter group of one fully sharded module.

    Args:
        module: the fully sharded module (for the wrapper: the wrapped module).
        specs: the parameters this unit owns, each with the slots that refer to it.
        group: the process group the parameters are sharded over (or replicated across).
        replicate: keep full parameters on every rank and all-reduce gradients (``NO_SHARD``).
            A group of one rank is always replicated.
    """

    def __init__(
        self,
        module: nn.Module,
        specs: Sequence[ParamSpec],
        group: dist.ProcessGroup,
        *,
        replicate: bool,
    ) -> None:
        if not specs:
            raise AssertionError(f"[rank {dist.get_rank()}] FSDPUnit needs at least one parameter")
        self.module = module
        self.group = group
        self.name = type(module).__name__  # the FQN once the root is known
        self.is_unsharded = False
        self.group_size = dist.get_world_size(group)
        self.replicate = replicate or self.group_size == 1
        shard_world = 1 if self.replicate else self.group_size
        shard_rank = 0 if self.replicate else dist.get_rank(group)

        first = specs[0].param
        self.dtype, self.device = first.dtype, first.device
        mixed = [
            s.fqn for s in specs if (s.param.dtype, s.param.device) != (self.dtype, self.device)
        ]
        if mixed:
            raise ValueError(
                f"FullyShardedDataParallel needs one dtype and device per unit, but {mixed} differ "
                f"from {specs[0].fqn} ({self.dtype}, {self.device}). Cast the module with "
                ".to(dtype, device) before wrapping, or wrap those submodules separately."
            )
        numels = [-(-s.param.shape[0] // shard_world) * math.prod(s.param.shape[1:]) for s in specs]
        self._flat_shard = torch.empty(sum(numels), dtype=self.dtype, device=self.device)  # 1D
        self.params: list[ShardedParam] = []
        offset = 0
        for spec, numel in zip(specs, numels, strict=True):
            segment = self._flat_shard[offset : offset + numel]
            self.params.append(
                ShardedParam(spec, segment, shard_world=shard_world, shard_rank=shard_rank)
            )
            offset += numel
        # Offsets of the gradient-requiring parameters in the reduce buffer.
        self._grad_params = [p for p in self.params if p.requires_grad]
        self._grad_offsets: list[int] = []
        offset = 0
        for p in self._grad_params:
            self._grad_offsets.append(offset)
            offset += p.shard_numel
        self._grad_numel = offset
        self._grads_ready: set[int] = set()
        for p in self.params:
            p.use_sharded()

    # ------------------------------------------------------------------ transitions
    def unshard(self, reason: events.UnshardReason = "explicit") -> None:
        """Make the module see full parameters; one all-gather unless replicated."""
        if self.is_unsharded:
            return
        if not self.replicate:
            gathered = torch.empty(
                self.group_size * self._flat_shard.numel(), dtype=self.dtype, device=self.device
            )
            _collectives.all_gather_flat(gathered, self._flat_shard, self.group, unit=self.name)
            blocks = gathered.view(self.group_size, -1)
            offset = 0
            for p in self.params:
                p.alloc_unsharded()
                p.copy_from_gathered(blocks[:, offset : offset + p.shard_numel])
                offset += p.shard_numel
        for p in self.params:
            p.use_unsharded()
        self.is_unsharded = True
        if events.has_subscribers():
            events.publish(
                events.Unshard(
                    unit=self.name,
                    reason=reason,
                    devices=tuple(str(p.unsharded.device) for p in self.params),
                    rank=dist.get_rank(),
                )
            )

    def reshard(self, reason: events.ReshardReason = "explicit") -> None:
        """Free the unsharded parameters; the module sees the local shards again."""
        if not self.is_unsharded:
            return
        for p in self.params:
            p.use_sharded()
            p.free_unsharded()
        self.is_unsharded = False
        if events.has_subscribers():
            events.publish(
                events.Reshard(
                    unit=self.name,
                    reason=reason,
                    devices=tuple(str(p.device) for p in self.params),
                    rank=dist.get_rank(),
                )
            )

    def post_backward(self) -> None:
        """Reshard, then reduce this backward's gradients into the sharded ``.grad``s.

        Gradients are averaged over the group (see [Note: gradient averaging]) and added to any
        gradient already on the sharded parameter, so several backwards accumulate.
        """
        self.reshard("backward")
        grads = [p.unsharded.grad for p in self._grad_params]
        if all(g is None for g in grads):
            return
        if self.replicate:
            self._all_reduce_grads(grads)
        else:
            self._reduce_scatter_grads(grads)
        for p in self._grad_params:
            p.unsharded.grad = None

    def _reduce_scatter_grads(self, grads: list[torch.Tensor | None]) -> None:
        world = self.group_size
        full = torch.zeros((world, self._grad_numel), dtype=self.dtype, device=self.device)
        for p, offset, grad in zip(self._grad_params, self._grad_offsets, grads, strict=True):
            if grad is not None:
                full[:, offset : offset + p.shard_numel].copy_(p.padded_grad_rows(grad))
        full.div_(world)  # See [Note: gradient averaging].
        reduced = torch.empty(self._grad_numel, dtype=self.dtype, device=self.device)
        _collectives.reduce_scatter_flat(reduced, full.view(-1), self.group, unit=self.name)
        for p, offset in zip(self._grad_params, self._grad_offsets, strict=True):
            p.accumulate_sharded_grad(reduced[offset : offset + p.shard_numel])

    def _all_reduce_grads(self, grads: list[torch.Tensor | None]) -> None:
        flat = torch.zeros(self._grad_numel, dtype=self.dtype, device=self.device)
        for p, offset, grad in zip(self._grad_params, self._grad_offsets, grads, strict=True):
            if grad is not None:
                flat[offset : offset + p.shard_numel].copy_(grad.reshape(-1))
        if self.group_size > 1:
            flat.div_(self.group_size)  # See [Note: gradient averaging].
            _collectives.all_reduce_flat(flat, self.group, unit=self.name)
        for p, offset in zip(self._grad_params, self._grad_offsets, strict=True):
            p.accumulate_sharded_grad(flat[offset : offset + p.shard_numel])

    # ------------------------------------------------------------------ backward bookkeeping
    @property
    def grad_params(self) -> list[ShardedParam]:
        """Parameters that require gradients, in registration order."""
        return self._grad_params

    def mark_grad_ready(self, index: int) -> bool:
        """Note that ``grad_params[index]`` got its gradient; True once all of them have."""
        self._grads_ready.add(index)
        return len(self._grads_ready) == len(self._grad_params)

    def has_pending_grads(self) -> bool:
        """Whether some gradient of this backward has not been reduced yet."""
        return any(p.unsharded.grad is not None for p in self._grad_params)

    def reset_backward(self) -> None:
        self._grads_ready.clear()
