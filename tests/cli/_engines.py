"""Deliberately broken engines that ``fsdp-testing check --engine module:attr`` must catch."""

from __future__ import annotations

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
