"""``trace_train_step``: forward, loss and backward of a ``fully_shard`` model as one FX graph.

[Note: tracing a fully_shard model]
The door's own hooks gather parameters with in-place collectives and drive the autograd engine
with callbacks, which a tracer cannot record. While tracing, graph mode switches the door's
forward hooks off (``doors_suspended`` in ``_units``; every other hook on the model, the user's
own, keeps running and is traced like the rest of the step) and installs its own through
handles it removes afterwards: a forward pre-hook on each unit module, ahead of the others,
gathers the unit's
``Shard(0)`` local shards with one functional all-gather (copy-in: each shard padded to
``ceil(rows / world)`` rows and flattened; copy-out: each rank's block split per parameter and
cut back to the full rows) and puts the full tensors in the module in place of the DTensors;
a gradient hook on each gathered parameter reduce-scatters the unit's gradients as soon as the
last one arrives, mirroring the copy-in (divided by the group size, then summed, as eager
``fully_shard`` averages). ``make_fx`` records all of it, with
``torch.autograd.grad`` for the backward, as one graph over the local shards and the batch,
returning the loss and each parameter's gradient shard. Tracing runs on fake tensors: no data
moves, every rank traces its own graph (shard shapes differ), and control flow that depends on
tensor values cannot be traced and raises, naming the module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils.hooks import RemovableHandle

from . import _meta, _motion
from ._units import GraphParam, GraphUnit, doors_suspended

__all__ = ["trace_joint_graph"]

_OPS = torch.ops._c10d_functional
_DATA_DEPENDENT = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


def _rows_per_rank(param: GraphParam, world: int) -> int:
    return math.ceil(param.param.shape[0] / world)


class _Tracer:
    """The state of one trace: gathered parameters, gradients waiting for their unit's reduce,
    the order in which units' collectives were issued and the module being run."""

    def __init__(self, model: nn.Module, units: list[GraphUnit], loss_fn: Callable) -> None:
        self.model, self.units, self.loss_fn = model, units, loss_fn
        self.params = [p for unit in units for p in unit.params]
        self.registrations: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    self.registrations.setdefault(id(param), []).append((module, name))
        self.gather_order: list[str] = []  # units whose all-gather was traced, in order
        self.gathered: set[str] = set()
        self.reduce_order: list[str] = []
        self.module_stack: list[str] = []

    # -- forward: one all-gather per unit -----------------------------------------------------
    def _gather(self, unit: GraphUnit) -> None:
        world, name = unit.group.size(), unit.group.group_name
        flats, widths = [], []
        for param in unit.params:
            shard = self.shards[param.fqn]
            rows = _rows_per_rank(param, world)
            if shard.shape[0] != rows:
                shard = F.pad(shard, [0, 0] * (shard.dim() - 1) + [0, rows - shard.shape[0]])
            flats.append(shard.reshape(-1))
            widths.append(flats[-1].numel())
        self.gathered.add(unit.fqn)
        if world == 1:  # a group of one moves nothing, as in eager mode
            gathered = torch.cat(flats)
        else:
            gathered = _OPS.all_gather_into_tensor(torch.cat(flats), world, name)
            gathered = _OPS.wait_tensor(gathered)
            self.gather_order.append(unit.fqn)
        columns = gathered.view(world, -1).split(widths, dim=1)
        for param, column in zip(unit.params, columns, strict=True):
            full_shape = tuple(param.param.shape)
            full = column.reshape(world * _rows_per_rank(param, world), *full_shape[1:])
            full = full[: full_shape[0]].detach().requires_grad_(param.param.requires_grad)
            self.full[param.fqn] = full
            for owner, key in self.registrations[id(param.param)]:
                owner._parameters[key] = full
            if full.requires_grad:
                full.register_hook(self._grad_hook(unit, param))

    # -- backward: one reduce-scatter per unit once its gradients are in -----------------------
    def _grad_hook(self, unit: GraphUnit, param: GraphParam) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self.grads[param.fqn] = grad
            if all(p.fqn in self.grads for p in unit.params if self.full[p.fqn].requires_grad):
                self._reduce(unit)

        return hook

    def _reduce(self, unit: GraphUnit) -> None:
        if unit.fqn in self.reduced_units:
            return
        params = [p for p in unit.params if p.fqn in self.grads]
        if not params:
            return
        self.reduced_units.add(unit.fqn)
        world, name = unit.group.size(), unit.group.group_name
        blocks, widths = [], []
        for param in params:
            grad, rows = self.grads[param.fqn], _rows_per_rank(param, world)
            if grad.shape[0] != rows * world:
                pad = rows * world - grad.shape[0]
                grad = F.pad(grad, [0, 0] * (grad.dim() - 1) + [0, pad])
            blocks.append(grad.reshape(world, -1))
            widths.append(blocks[-1].shape[1])
        # Pre-divided, then summed: eager fully_shard's arithmetic (see [Note: gradient
        # averaging] in fsdp_core/_collectives.py), so gradients match it bitwise at any size.
        flat = torch.cat(blocks, dim=1).reshape(-1)
        if world == 1:
            reduced = flat
        else:
            reduced = _OPS.reduce_scatter_tensor(flat / world, "sum", world, name)
            reduced = _OPS.wait_tensor(reduced)
            self.reduce_order.append(unit.fqn)
        self.reduced.append((unit, params, widths, reduced))

    def _copy_out_gradients(self) -> None:
        # After the whole backward, so that nothing reads a reduce-scatter's result early and
        # bucketing may issue it later (see [Note: bucketing without crossing a dependency]).
        for unit, params, widths, reduced in self.reduced:
            world = unit.group.size()
            for param, piece in zip(params, reduced.split(widths), strict=True):
                local = self.shards[param.fqn]
                piece = piece.view(_rows_per_rank(param, world), *local.shape[1:])
                self.sharded_grads[param.fqn] = piece[: local.shape[0]]

    # -- the traced function --------------------------------------------------------------------
    def step(self, *flat: torch.Tensor) -> tuple[Any, ...]:
        shards, batch = flat[: len(self.params)], flat[len(self.params) :]
        self.shards = {p.fqn: s for p, s in zip(self.params, shards, strict=True)}
        self.full: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.sharded_grads: dict[str, torch.Tensor] = {}
        self.reduced_units: set[str] = set()
        self.reduced: list[tuple[GraphUnit, list[GraphParam], list[int], torch.Tensor]] = []
        with torch.enable_grad():
            loss = self.loss_fn(self.model, *batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    "trace_train_step(loss_fn=...) must return a scalar loss tensor, got "
                    f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}"
                )
            wanted = [self.full[p.fqn] for p in self.params if p.fqn in self.full]
            wanted = [t for t in wanted if t.requires_grad]
            torch.autograd.grad(loss, wanted, allow_unused=True)
        for unit in self.units:  # units some of whose parameters got no gradient
            self._reduce(unit)
        self._copy_out_gradients()
        return (loss.detach(), *(self.sharded_grads.get(p.fqn) for p in self.params))

    # -- hooks in place while tracing -----------------------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        params = {
            (module, key): module._parameters[key]
            for registrations in self.registrations.values()
            for module, key in registrations
        }
        handles: list[RemovableHandle] = []
        try:
            with doors_suspended("trace_train_step", self.model):
                for name, module in self.model.named_modules():
                    handles += [
                        module.register_forward_pre_hook(self._enter(name), prepend=True),
                        module.register_forward_hook(self._leave),
                    ]
                for unit in self.units:
                    # Registered last with prepend: the first to run, so that every other
                    # pre-hook of the module already sees the gathered parameters.
                    handles.append(
                        unit.module.register_forward_pre_hook(
                            self._unit_pre_forward(unit), prepend=True
                        )
                    )
                yield
        finally:
            for handle in handles:
                handle.remove()
            for (module, key), param in params.items():
                module._parameters[key] = param

    def _enter(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.module_stack.append(name)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.module_stack.pop()

    def _unit_pre_forward(self, unit: GraphUnit) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            if unit.fqn not in self.gathered:
                self._gather(unit)

        return hook


def _describe(tracer: _Tracer) -> str:
    if not tracer.module_stack:
        return "in loss_fn, outside the model's modules"
    name = tracer.module_stack[-1]
    module = tracer.model.get_submodule(name)
    return f"in module {name or '<root>'!r} ({type(module).__name__})"


def _tag(gm: torch.fx.GraphModule, tracer: _Tracer) -> None:
    gathers = [n for n in gm.graph.nodes if _meta.is_all_gather(n)]
    scatters = [n for n in gm.graph.nodes if _meta.is_reduce_scatter(n)]
    if len(gathers) != len(tracer.gather_order) or len(scatters) != len(tracer.reduce_order):
        raise AssertionError(
            f"traced {len(gathers)} all-gathers and {len(scatters)} reduce-scatters for "
            f"{tracer.gather_order} and {tracer.reduce_order}"
        )
    for nodes, units in ((gathers, tracer.gather_order), (scatters, tracer.reduce_order)):
        for node, unit in zip(nodes, units, strict=True):
            for member in [*_motion.exclusive_inputs(node), node, _meta.wait_of(node)]:
                member.meta[_meta.UNIT] = unit


def trace_joint_graph(
    model: nn.Module, units: list[GraphUnit], loss_fn: Callable, batch: Sequence[torch.Tensor]
) -> tuple[torch.fx.GraphModule, list[GraphParam]]:
    """Trace one step; see [Note: tracing a fully_shard model]."""
    tracer = _Tracer(model, units, loss_fn)
    shards = [p.param.to_local() for p in tracer.params]
    try:
        with tracer.installed():
            gm = make_fx(tracer.step, tracing_mode="fake", _allow_non_fake_inputs=True)(
                *shards, *batch
            )
    except _DATA_DEPENDENT as error:
        raise NotImplementedError(
            f"trace_train_step cannot trace control flow or shapes that depend on tensor values "
            f"{_describe(tracer)}: {type(error).__name__}: {str(error).splitlines()[0]}. Make "
            "the branch depend on Python values or shapes, or use torch.where / torch.cond, "
            "or train that model in eager mode."
        ) from error
    _tag(gm, tracer)
    gm.meta["fsdp_gather_order"] = list(tracer.gather_order)
    return gm, tracer.params
