"""The model a plan is about, sharded on fake tensors in a fake world, and its training step.

[Note: a fake world]
The planner plays one rank of a world of ``--world-size`` ranks in this process: torch's fake
backend (``init_process_group("fake")``) gives every group its real size and membership while
collectives move nothing, and ``FakeTensorMode`` gives every tensor its real shape, dtype and
device with no storage behind it. The model is built and sharded there exactly as ``fsdp-testing
check`` builds a row (the reference model's ``init`` with the row's engine options, the root
sharded too), so a 1.3B-parameter model at 1,024 ranks costs no memory. ``DeviceMesh`` reads its
ranks from real tensors, so meshes are made outside the fake tensor mode and handed to the
engine (:class:`FakeWorldEngine`). The step that follows is the trainer's (zero the gradients,
forward, loss, backward, optimizer step), counted by ``_plan_memory.StorageCounter``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._matrix import MODELS, Config
from ._plan_args import InputSpec, PlanError, PlanRequest

__all__ = [
    "Built",
    "FakeWorldEngine",
    "build",
    "fake_tensors",
    "fake_world",
    "make_optimizer",
    "shard_model",
    "to_fake",
    "train_step",
]

_SINGLE_GROUP = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}
_OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of a fake world of ``world_size``. See [Note: a fake world]."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise PlanError(
            "fsdp-testing plan makes its own fake world, but this process already has a default "
            "process group; plan from a process without one"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesh(group: Any = None, grid: tuple[int, int] | None = None) -> Any:
    """A CPU mesh over ``group`` (1-D), or over the world as ``grid`` (dims ``replicate,
    shard``), made from real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    with unset_fake_temporarily():
        if grid is None:
            return DeviceMesh.from_group(group, "cpu")
        ranks = torch.arange(grid[0] * grid[1]).view(*grid)
        return DeviceMesh("cpu", ranks, mesh_dim_names=("replicate", "shard"))


@contextlib.contextmanager
def fake_tensors(mode: Any) -> Iterator[None]:
    """Inside ``mode`` (a ``FakeTensorMode``), with ``DeviceMesh.mesh`` computed from real
    tensors: a mesh keeps its ranks in a tensor, which fake tensors have no values for. See
    [Note: a fake world]."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.mesh

    def mesh(self: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            return original.fget(self)  # type: ignore[attr-defined]

    DeviceMesh.mesh = property(mesh)  # type: ignore[method-assign, assignment]
    try:
        with mode:
            yield
    finally:
        DeviceMesh.mesh = original  # type: ignore[method-assign]


def to_fake(module: nn.Module) -> None:
    """Give ``module``'s meta (or real) parameters and buffers fake CPU tensors of the same
    shapes and dtypes, in place, keeping tied ones tied and their Python attributes; call
    inside the ``FakeTensorMode``. See [Note: a fake world]."""
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, FakeTensor) or type(tensor) not in (torch.Tensor, nn.Parameter):
            return tensor  # already fake, or a subclass (a DTensor of a sharded unit)
        if id(tensor) not in made:
            new = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            new.__dict__.update(tensor.__dict__)  # e.g. MixtureOfExperts' ``expert`` flag
            made[id(tensor)] = new
        return made[id(tensor)]

    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                sub._parameters[name] = fake(param)  # type: ignore[assignment]
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = fake(buffer)


class FakeWorldEngine:
    """The request's engine in the fake world. See [Note: a fake world].

    A hybrid request shards over its ``R x S`` mesh (dims ``replicate, shard``) as the check's
    hybrid rows do over theirs; a unit a model puts on another group (``moe``'s expert) keeps
    it, with the single-group strategy. The composable door gets every group as a mesh. Every
    other attribute is the engine's.

    Args:
        engine: the registered engine.
        request: the configuration (its mesh and door).
        mode: the fake tensor mode the engine shards in.
    """

    def __init__(self, engine: Any, request: PlanRequest, mode: Any) -> None:
        self.engine = engine
        self.mode = mode
        self._composable = request.engine == "fsdp_core_fully_shard"
        self.mesh: Any = None
        if request.mesh is not None:
            self.mesh = _mesh(grid=request.mesh)
        elif self._composable:
            self.mesh = _mesh(dist.group.WORLD)
        self._world = request.world_size

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        # Built on the meta device; sharded there (the wrapper) or on fake CPU tensors
        # (the composable door). See [Note: a fake world].
        if not self._composable:
            return self._wrap(module, process_group, {**fsdp_kwargs, "device_id": "meta"})
        with fake_tensors(self.mode), torch.device("cpu"):
            to_fake(module)
            return self._wrap(module, process_group, fsdp_kwargs)

    def _wrap(
        self, module: nn.Module, process_group: Any, fsdp_kwargs: dict[str, Any]
    ) -> nn.Module:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        if ranks is None or len(ranks) == self._world:
            if self.mesh is not None:
                fsdp_kwargs = {**fsdp_kwargs, "device_mesh": self.mesh}
                process_group = None
            return self.engine.wrap(module, process_group, **fsdp_kwargs)
        strategy = fsdp_kwargs.get("sharding_strategy")
        single = _SINGLE_GROUP.get(getattr(strategy, "name", ""))
        if strategy is not None and single is not None:
            fsdp_kwargs = {**fsdp_kwargs, "sharding_strategy": type(strategy)[single]}
        if self._composable:
            fsdp_kwargs = {**fsdp_kwargs, "device_mesh": _mesh(process_group)}
            process_group = None
        return self.engine.wrap(module, process_group, **fsdp_kwargs)

    @property
    def uses_fake_tensors(self) -> bool:
        """The composable door shards on fake CPU tensors, the wrapper on the meta device."""
        return self._composable

    def __getattr__(self, name: str) -> Any:
        if name in ("engine", "mode", "mesh", "_world", "_composable"):  # not set yet
            raise AttributeError(name)
        return getattr(self.engine, name)


class _Inputs:
    """The workload of a user's model without ``get_input``: ``--input-shape`` tensors (zeros:
    fake tensors have no values), the loss the sum of every floating-point output."""

    def __init__(self, specs: tuple[InputSpec, ...], model_text: str) -> None:
        self.specs = specs
        self.model_text = model_text

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in self.specs
        )

    def get_loss(self, input: Any, output: Any) -> torch.Tensor:
        from fsdp_testing.models.user import sum_of_outputs

        try:
            return sum_of_outputs(output, what=f"--model {self.model_text}")
        except ValueError as error:
            raise PlanError(str(error)) from None

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


@dataclasses.dataclass
class Built:
    """A sharded model on fake tensors with what its step needs."""

    model: nn.Module
    workload: Any  # get_input, get_loss, run_backward
    optim: torch.optim.Optimizer
    engine: Any  # the registered engine (its theoretical volume)
    device: torch.device  # where the step computes: meta, or CPU under ``mode``
    mode: Any  # the fake tensor mode to step in, or None (the meta device)

    def stepping(self) -> contextlib.AbstractContextManager[Any]:
        """Where steps run: in :func:`fake_tensors`, if the model needs them."""
        return fake_tensors(self.mode) if self.mode is not None else contextlib.nullcontext()


def _sizes(cls: type, spec_kwargs: tuple[tuple[str, Any], ...], text: str) -> dict[str, Any]:
    """The reference model's size arguments: the keyword-only integers of its constructor."""
    accepted = {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is p.KEYWORD_ONLY and isinstance(p.default, int) and name != "device"
    }
    out = {}
    for key, value in spec_kwargs:
        if key not in accepted:
            valid = ", ".join(accepted) or "none"
            raise PlanError(
                f"--model {text}: {key!r} is not a size argument of this model; valid: {valid}"
            )
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"--model {text}: {key}={value!r}; give a positive integer")
        out[key] = value
    return out


def _reference(request: PlanRequest, engine: Any, options: dict[str, Any]) -> Any:
    from fsdp_testing import models
    from fsdp_testing.engines import use_engine
    from fsdp_testing.parity._reference import find_test_model

    spec = request.model
    assert spec.reference is not None  # for mypy: the caller checked
    cls = getattr(models, MODELS[spec.reference][0])
    sizes = _sizes(cls, spec.kwargs, spec.text)
    group = dist.group.WORLD
    with use_engine(engine):  # as Lockstep.build shards a check row
        # On the CPU, DEVICE_BEFORE's ``.to("cpu")`` keeps every tensor as it is; fake
        # parameters cannot take that path (``_apply`` swaps fake tensors), so stay put.
        model = cls.init(
            group,
            models.FSDPInitMode.RECURSIVE,
            models.DEVICEInitMode.DEVICE_NEVER,
            options,
            deterministic=True,
            device=torch.device("cpu"),
            **sizes,
        )
        if not engine.is_wrapped(model):
            model = engine.wrap(model, group, **options)
    return model, find_test_model(model)


def _user_model(request: PlanRequest, engine: Any, options: dict[str, Any]) -> Any:
    from fsdp_core import unit_views
    from fsdp_testing.models.user import load_factory

    spec = request.model
    try:
        factory = load_factory(
            spec.module or "", spec.attribute or "", option=f"--model {spec.text}"
        )
    except ValueError as error:
        raise PlanError(str(error)) from None
    model = factory(**dict(spec.kwargs))
    if not isinstance(model, nn.Module):
        raise PlanError(
            f"--model {spec.text}: {spec.attribute}() returned {type(model).__name__}, not an "
            "nn.Module"
        )
    if unit_views(model):
        raise PlanError(
            f"--model {spec.text}: {spec.attribute}() returned a sharded model; return it "
            "unsharded (the planner shards it on fake tensors: --wrap CLASS,... picks the units)"
        )
    classes = {type(m).__name__: type(m) for m in model.modules()}
    unknown = [name for name in request.wrap if name not in classes]
    if unknown:
        raise PlanError(
            f"--wrap {','.join(unknown)}: no such module class in the model; its classes: "
            f"{', '.join(sorted(classes))}"
        )
    if request.wrap:
        policy = engine.module_wrap_policy([classes[name] for name in request.wrap])
        options = {**options, "auto_wrap_policy": policy}
    model = engine.wrap(model, None, **options)
    if all(hasattr(model, m) for m in ("get_input", "get_loss", "run_backward")):
        return model, model
    if not request.inputs:
        raise PlanError(
            f"--model {spec.text}: the model has no get_input(device); give its inputs with "
            "--input-shape (once per positional input), e.g. --input-shape 8,1024 or 8,512:int64"
        )
    return model, _Inputs(request.inputs, spec.text)


def shard_model(request: PlanRequest, engine: Any) -> tuple[nn.Module, Any]:
    """The request's model sharded by ``engine`` as ``check`` shards a row (its options from
    the request), and its workload (``get_input``, ``get_loss``, ``run_backward``). The
    planner passes a :class:`FakeWorldEngine` under the meta device; a benchmark that runs the
    same configuration for real passes the registered engine.

    Raises:
        PlanError: the model or the options cannot be used, or the engine refuses them.
    """
    from ._rankwork import fsdp_options

    config = Config(
        model=request.model.reference or "custom",
        strategy=request.strategy,
        prefetch=request.prefetch,
        offload="on" if request.offload else "off",
        mp=request.mp,
        engine=request.engine,
    )
    options = fsdp_options(config)
    try:
        if request.model.reference is not None:
            return _reference(request, engine, options)
        return _user_model(request, engine, options)
    except NotImplementedError as error:
        raise PlanError(f"--engine {request.engine}: {error}") from None


def make_optimizer(request: PlanRequest, model: nn.Module) -> torch.optim.Optimizer:
    """``--optim``'s optimizer over ``model``'s parameters (Adam lr 1e-3; SGD lr 0.01, with
    momentum 0.9 for ``sgd-momentum``)."""
    return _OPTIMIZERS[request.optim](model.parameters())


def build(request: PlanRequest, mode: Any) -> Built:
    """The request's model built on the meta device and sharded in the fake world (the
    composable door on fake tensors in ``mode``, a ``FakeTensorMode``), and its optimizer;
    call inside :func:`fake_world` and step it in :meth:`Built.stepping`. See [Note: a fake
    world]."""
    from fsdp_testing.engines import resolve_engine

    registered = resolve_engine(request.engine)
    engine = FakeWorldEngine(registered, request, mode)
    with torch.device("meta"):
        model, workload = shard_model(request, engine)
    optim = make_optimizer(request, model)
    if engine.uses_fake_tensors:
        return Built(model, workload, optim, registered, torch.device("cpu"), mode)
    return Built(model, workload, optim, registered, torch.device("meta"), None)


def train_step(built: Built, counter: Any = None) -> None:
    """One training step as the trainer runs it; ``counter`` (a ``StorageCounter``) is told the
    phase."""

    def phase(name: str) -> None:
        if counter is not None:
            counter.phase = name

    phase("zero_grad")
    built.optim.zero_grad()
    phase("forward")
    inputs = built.workload.get_input(built.device)
    output = built.model(*inputs)
    loss = built.workload.get_loss(inputs, output)
    phase("backward")
    built.workload.run_backward(loss)
    phase("optimizer step")
    built.optim.step()
