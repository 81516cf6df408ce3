"""Deliberately broken engines that ``fsdp-testing check --engine module:attr`` must catch."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_testing.engines.fsdp_core import FSDPCoreEngine


class NoAveragingEngine(FSDPCoreEngine):
    """fsdp_core, but every unit sums gradients over the ranks instead of averaging them."""

    name = "no_averaging"

    def wrap(self, module: Any, process_group: Any = None, **fsdp_kwargs: Any) -> Any:
        from fsdp_core import FullyShardedDataParallel

        wrapped = super().wrap(module, process_group, **fsdp_kwargs)
        for instance in FullyShardedDataParallel.fsdp_modules(wrapped):
            unit = instance._unit
            if unit is not None and not getattr(unit, "_no_averaging", False):
                unit._no_averaging = True
                original = unit.post_backward

                def post_backward(
                    *args: Any, unit: Any = unit, original: Any = original, **kwargs: Any
                ) -> Any:
                    for p in unit.grad_params:
                        if p.unsharded.grad is not None:
                            p.unsharded.grad.mul_(unit.groups.world)
                    return original(*args, **kwargs)

                unit.post_backward = post_backward
        return wrapped


class _HybridReductionEngine(FSDPCoreEngine):
    """fsdp_core, but each hybrid unit's gradient reduction runs over other groups than its
    own (``_groups``); everything else, the theory included, is fsdp_core's."""

    def _groups(self, groups: Any) -> Any:
        raise NotImplementedError

    def wrap(self, module: Any, process_group: Any = None, **fsdp_kwargs: Any) -> Any:
        from fsdp_core import FullyShardedDataParallel
        from fsdp_core._reduce import reduce_gradients

        wrapped = super().wrap(module, process_group, **fsdp_kwargs)
        for instance in FullyShardedDataParallel.fsdp_modules(wrapped):
            unit = instance._unit
            if unit is None or not unit.groups.is_hybrid or "_reduce" in vars(unit):
                continue
            groups = self._groups(unit.groups)

            def reduce(reduce_input: Any, unit: Any = unit, groups: Any = groups) -> Any:
                numel = unit._grad_numel
                tags = (
                    unit._reduce_tags(reduce_input.dtype) if reduce_input.shape[1] > numel else None
                )
                return reduce_gradients(reduce_input, numel, groups, tags, unit=unit.name)

            unit._reduce = reduce
        return wrapped


class NoReplicaReduceEngine(_HybridReductionEngine):
    """Hybrid units reduce-scatter inside the shard group and skip the all-reduce across the
    replicate group (each replica keeps its own gradients)."""

    name = "no_replica_reduce"

    def _groups(self, groups: Any) -> Any:
        return dataclasses.replace(groups, replicate=None, grid=None)


class WrongReplicaGroupEngine(_HybridReductionEngine):
    """Hybrid units all-reduce across the anti-diagonal of the 2 x 2 grid ({0, 3} and
    {1, 2}) instead of their replicate group: the same calls and bytes, the wrong peers."""

    name = "wrong_replica_group"

    def _groups(self, groups: Any) -> Any:
        import torch.distributed as dist

        pairs = ((0, 3), (1, 2))
        made = [dist.new_group(list(pair)) for pair in pairs]  # every rank makes both
        mine = next(g for g, pair in zip(made, pairs, strict=True) if dist.get_rank() in pair)
        return dataclasses.replace(groups, replicate=mine, grid=None)
