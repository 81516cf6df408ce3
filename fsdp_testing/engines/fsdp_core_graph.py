"""Engine for fsdp_core's graph mode: ``fsdp_core.fully_shard`` units, each step one traced graph.

It shards exactly as ``fsdp_core_fully_shard`` does (the same ``engines/_core.py`` composable
engine: same option mapping, same units, patch targets and probe), marks the root, and steps
the model itself (:class:`~fsdp_testing.engines.StepsItself`): the first step of
a batch shape traces forward, loss and backward with ``fsdp_core.graph.trace_train_step`` and
applies the passes the options ask for; every step runs that graph, observed (its collectives
go through ``torch.distributed`` and publish ``fsdp_core.events``, see [Note: observed graph
runs] in ``fsdp_core/graph/_observed.py``), so the recorder, collective counts and fault
injection see it as they see eager mode.

Passes: ``FULL_SHARD`` (the default) applies ``reshard_after_forward``, ``SHARD_GRAD_OP`` does
not; ``prefetch(depth=1)`` always (the graph's counterpart of ``BACKWARD_PRE``). Graph mode
traces neither mixed precision nor CPU offload (tracing raises ``NotImplementedError`` naming
the units), nor models whose forward branches on tensor values or that update buffers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._core import CoreComposableEngine
from ._volume import CommVolume, UnitVolume, padded_bytes

__all__ = ["FSDPCoreGraphEngine"]

# The root's ``__dict__`` entries: the passes chosen at wrap time, the traced steps by batch.
_PASSES = "_fsdp_graph_passes"
_STEPS = "_fsdp_graph_steps"


def _graph() -> Any:
    return importlib.import_module("fsdp_core.graph")


class FSDPCoreGraphEngine(CoreComposableEngine):
    """:class:`~fsdp_testing.engines.FSDPEngine` for fsdp_core's graph mode."""

    name = "fsdp_core_graph"

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        reshard = self._fully_shard_kwargs(fsdp_kwargs).get("reshard_after_forward", True)
        module = super().wrap(module, process_group, **fsdp_kwargs)
        module.__dict__[_PASSES] = ("reshard_after_forward",) * bool(reshard) + ("prefetch",)
        module.__dict__[_STEPS] = {}
        return module

    def manages(self, module: nn.Module) -> bool:
        return any(_PASSES in m.__dict__ for m in module.modules())

    def train_step(
        self,
        module: nn.Module,
        inputs: tuple[Any, ...],
        loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor],
    ) -> torch.Tensor:
        """Trace (once per batch shape) and run one observed graph step; returns the loss."""
        return self._step_for(module, inputs, loss_fn)(*inputs, observed=True).detach()

    def _step_for(
        self,
        module: nn.Module,
        inputs: tuple[Any, ...],
        loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor],
    ) -> Any:
        if _PASSES not in module.__dict__:
            raise ValueError(
                f"engine {self.name!r}: {type(module).__name__} was not sharded by this engine; "
                f"shard it with get_engine({self.name!r}).wrap(module) first."
            )
        if not all(isinstance(t, torch.Tensor) for t in inputs):
            raise NotImplementedError(
                f"engine {self.name!r} traces batches of tensors only; the model's inputs are "
                f"{[type(t).__name__ for t in inputs]}. Use another engine for this model."
            )
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        steps: dict[Any, Any] = module.__dict__[_STEPS]
        if key not in steps:
            graph = _graph()
            passes = {
                "reshard_after_forward": graph.passes.reshard_after_forward,
                "prefetch": graph.passes.prefetch,
            }
            step = graph.trace_train_step(module, lambda m, *b: loss_fn(m, b), tuple(inputs))
            steps[key] = step.with_passes(*(passes[n] for n in module.__dict__[_PASSES]))
        return steps[key]

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        """Per unit over more than one rank: the all-gathers of its padded parameters that the
        traced graph issues for it (one, and one more where ``reshard_after_forward`` re-gathers
        it for backward: not a unit whose backward reads none of its parameters), one
        reduce-scatter of its trainable parameters' padded gradients; no order tags. Measured
        against it: the collectives a run actually sends. ``None`` before the first step."""
        steps: dict[Any, Any] = module.__dict__.get(_STEPS) or {}
        if not steps:
            return None
        step = next(iter(steps.values()))
        regathered = step.gathers_per_unit()
        volumes = []
        for unit in step.units:
            world = unit.group.size()
            if world == 1:
                continue  # a group of one moves nothing
            shapes = [(tuple(p.param.shape), p.param.element_size()) for p in unit.params]
            trainable = [
                (tuple(p.param.shape), p.param.element_size())
                for p in unit.params
                if p.param.requires_grad
            ]
            volumes.append(
                UnitVolume(
                    name=unit.fqn or "<root>",
                    gather_bytes=sum(padded_bytes(s, world, size) for s, size in shapes),
                    reduce_bytes=sum(padded_bytes(s, world, size) for s, size in trainable),
                    gathers=regathered.get(unit.fqn, 0),
                    reduce_kind="reduce_scatter" if trainable else None,
                )
            )
        if not volumes:
            return None
        return CommVolume("fsdp_core graph mode: per-parameter dim-0 padding", tuple(volumes))
