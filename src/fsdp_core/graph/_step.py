"""``TrainStep``: a traced joint graph bound to its model, run as one training step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .. import events
from . import _meta
from ._observed import ObservedRun
from ._trace import trace_joint_graph
from ._units import GraphParam, GraphUnit, find_units

__all__ = ["TrainStep", "trace_train_step"]

GraphPass = Callable[[torch.fx.GraphModule], torch.fx.GraphModule]


class TrainStep:
    """One traced training step of a ``fully_shard`` model: forward, loss and backward.

    ``step.gm`` is the joint graph (inputs: the parameters' local shards, then the batch;
    outputs: the loss, then each parameter's gradient shard). Calling ``step(*batch)`` runs it,
    returns the loss and accumulates the gradients into the sharded parameters' ``.grad`` as
    eager ``fully_shard`` does. ``step.units`` are the units the graph gathers and reduces,
    outermost first. Build one with :func:`trace_train_step`.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        params: Sequence[GraphParam],
        example_batch: Sequence[torch.Tensor],
        passes: tuple[str, ...] = (),
    ) -> None:
        self.gm = gm
        self.passes = passes
        self._params = tuple(params)
        self._batch_specs = tuple((tuple(t.shape), t.dtype) for t in example_batch)
        self.units: tuple[GraphUnit, ...] = ()  # set by trace_train_step
        # Set by trace_train_step: each unit's group by name, each unit's parameter count.
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._unit_params: dict[str, int] = {}

    def gathers_per_unit(self) -> dict[str, int]:
        """How many all-gathers ``gm`` issues for each unit (by FQN, ``""`` for the root); a
        bucketed all-gather counts once for every unit it serves."""
        counts = {unit.fqn: 0 for unit in self.units}
        for node in self.gm.graph.nodes:
            if _meta.is_all_gather(node):
                for name in _meta.unit_names(node):
                    counts[name] = counts.get(name, 0) + 1
        return counts

    def with_passes(self, *passes: GraphPass) -> TrainStep:
        """A new ``TrainStep`` over ``gm`` transformed by ``passes`` in order (this one is
        unchanged). Pass options by keyword with ``functools.partial``."""
        gm = self.gm
        names = list(self.passes)
        for graph_pass in passes:
            if not callable(graph_pass):
                raise TypeError(
                    f"TrainStep.with_passes takes GraphModule -> GraphModule functions, got "
                    f"{graph_pass!r}; e.g. functools.partial(bucket_all_gathers, bucket_bytes=n)"
                )
            gm = graph_pass(gm)
            names.append(getattr(graph_pass, "__name__", None) or repr(graph_pass))
        step = TrainStep(gm, self._params, [], tuple(names))
        step._batch_specs = self._batch_specs
        step.units = self.units
        step._unit_params = self._unit_params
        step._groups = self._groups
        return step

    def __call__(self, *batch: torch.Tensor, observed: bool | None = None) -> torch.Tensor:
        """Run one step on ``batch``; returns the loss and accumulates the gradient shards.

        Args:
            batch: tensors of the traced shapes and dtypes.
            observed: run each collective through ``torch.distributed`` and publish
                ``fsdp_core.events`` (see [Note: observed graph runs]); default ``None``: when
                ``events`` has subscribers. ``False`` runs the compiled graph.
        """
        specs = tuple((tuple(t.shape), t.dtype) for t in batch)
        if specs != self._batch_specs:
            raise ValueError(
                f"TrainStep was traced for a batch of {self._batch_specs} (shape, dtype) and got "
                f"{specs}; the graph has static shapes: trace again for another batch shape"
            )
        shards = [p.param.to_local() for p in self._params]
        # The graph holds the backward itself: autograd records nothing here. (torch 2.15
        # refused an in-place op of the traced MoE step on a shard, a view of a leaf that
        # requires grad, when the graph ran with grad mode on.)
        with torch.no_grad():
            if events.has_subscribers() if observed is None else observed:
                run = ObservedRun(self.gm, self._groups, self._unit_params)
                outputs = run.run(*shards, *batch)
            else:
                outputs = self.gm(*shards, *batch)
        loss, grads = outputs[0], outputs[1:]
        with torch.no_grad():
            for param, grad in zip(self._params, grads, strict=True):
                if grad is None:
                    continue
                sharded = param.param
                if sharded.grad is None:
                    sharded.grad = DTensor.from_local(
                        grad,
                        sharded.device_mesh,
                        [Shard(0)],
                        run_check=False,
                        shape=sharded.shape,
                        stride=sharded.stride(),
                    )
                else:
                    existing = sharded.grad
                    if not isinstance(existing, DTensor):
                        raise AssertionError(
                            f"[rank {dist.get_rank()}] {param.fqn}.grad is a "
                            f"{type(existing).__name__}, not a DTensor like its parameter"
                        )
                    existing.to_local().add_(grad)
        return loss


def trace_train_step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    example_batch: tuple[torch.Tensor, ...],
) -> TrainStep:
    """Trace forward, loss and backward of a ``fully_shard`` model as one joint FX graph.

    Every rank of the model's group must call it (each traces its own graph: shard shapes
    differ); no collective runs while tracing. See [Note: tracing a fully_shard model] in
    ``fsdp_core/graph/_trace.py`` and [Note: graph-mode node conventions] in ``_meta.py``.

    Args:
        model: the root of a model sharded by ``fully_shard`` (every parameter a ``Shard(0)``
            DTensor; the root itself fully sharded).
        loss_fn: ``loss_fn(model, *batch)`` returns the scalar loss.
        example_batch: a tuple of tensors; the graph is specialized to their shapes and dtypes.

    Returns:
        A :class:`TrainStep`.

    Raises:
        ValueError: the model is not sharded by ``fully_shard``, or ``loss_fn`` returns no
            scalar.
        TypeError: ``example_batch`` is not a tuple of tensors.
        NotImplementedError: the step has control flow that depends on tensor values (the
            message names the module).
    """
    if not isinstance(example_batch, tuple) or not all(
        isinstance(t, torch.Tensor) for t in example_batch
    ):
        raise TypeError(
            "trace_train_step(example_batch=...) must be a tuple of tensors, got "
            f"{type(example_batch).__name__}; pass e.g. (inputs, targets)"
        )
    units = find_units("trace_train_step", model)
    gm, params = trace_joint_graph(model, units, loss_fn, example_batch)
    step = TrainStep(gm, params, example_batch)
    step.units = tuple(units)
    step._unit_params = {unit.fqn: len(unit.params) for unit in units}
    step._groups = {unit.group.group_name: unit.group for unit in units}
    return step
