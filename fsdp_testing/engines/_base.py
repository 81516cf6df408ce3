"""The engine protocol, the defaults an engine inherits, and the helpers engine modules share.

An engine is the one place that knows how a sharding implementation spells "wrap this module",
"show me the full parameters", "which function reshards a unit", "what does a unit look like to
the recorder" and "how many bytes should one step send". Models, parity checks, patching, the
recorder and the command line talk to engines only through :class:`FSDPEngine`, so the same test
runs against ``fsdp_core``, torch's FSDP1 wrapper and torch's FSDP2 ``fully_shard``, and adding
an engine is writing one module (see ``docs/models.md``, "Adding an engine").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from ._probe import Probe
from ._volume import CommVolume

__all__ = [
    "OPTIONAL_PATCH_EVENTS",
    "UNIT_EVENTS",
    "BaseEngine",
    "FSDPEngine",
    "PatchTarget",
    "StepsItself",
    "broadcast_module_states",
    "clean_param_name",
    "default_process_group",
    "engine_optimizer",
    "has_accelerator",
    "has_nested_units",
    "modules_selected_by_policy",
    "translate_kwargs",
]

#: The unit transitions whose implementing function an engine names for patching.
UNIT_EVENTS = ("unshard", "reshard", "post_backward")

#: Patch points that only some engines have; :meth:`FSDPEngine.patch_target` raises ValueError
#: for those it lacks. ``register_post_backward_hook_backward``: the ``backward`` of the autograd
#: function around which FSDP2 runs its post-backward (``RegisterPostBackwardFunction``).
OPTIONAL_PATCH_EVENTS = ("register_post_backward_hook_backward",)

# Name parts that wrappers insert (FSDP1, activation checkpointing, torch.compile); removing them
# gives the names the user wrote.
_WRAPPER_NAMES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


class PatchTarget(NamedTuple):
    """Where an engine keeps the callable that implements one unit transition.

    ``owner`` is a class (the method is looked up on instances) or a module (a free function that
    the engine calls through its module globals). Patching ``setattr(owner, attribute, new)``
    reaches every call the engine makes.
    """

    owner: Any
    attribute: str

    def get(self) -> Callable[..., Any]:
        """Returns the callable currently installed at this target."""
        return getattr(self.owner, self.attribute)


@runtime_checkable
class FSDPEngine(Protocol):
    """What the models and parity checks need from a sharding implementation.

    Engines are stateless singletons obtained from :func:`fsdp_testing.engines.get_engine`.
    """

    #: Registry name, e.g. ``"torch_fsdp1"``.
    name: str

    #: Whether the engine shards submodules as units of their own. False for a root-only
    #: engine (DDP- or ZeRO-style: one wrapper around the whole model): the reference models
    #: then leave their submodules plain and the root is wrapped (see [Note: root-only
    #: engines]).
    nested_units: bool

    def wrap(
        self, module: nn.Module, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> nn.Module:
        """Shards ``module`` with FSDP1-style keyword arguments (including
        ``auto_wrap_policy``) and returns the module to train."""
        ...

    def is_wrapped(self, module: nn.Module) -> bool:
        """Whether ``module`` itself is a sharded unit of this engine."""
        ...

    def manages(self, module: nn.Module) -> bool:
        """Whether ``module`` or any submodule is a sharded unit of this engine."""
        ...

    def module_wrap_policy(self, module_classes: Iterable[type[nn.Module]]) -> Any:
        """Returns this engine's policy that wraps every instance of ``module_classes``."""
        ...

    def always_wrap_policy(self) -> Any:
        """Returns this engine's policy that wraps every submodule."""
        ...

    def enable_wrap(
        self, process_group: dist.ProcessGroup | None = None, **fsdp_kwargs: Any
    ) -> AbstractContextManager[None]:
        """Context in which :meth:`wrap_if_enabled` wraps with ``fsdp_kwargs``."""
        ...

    def wrap_if_enabled(self, module: nn.Module) -> nn.Module:
        """Wraps ``module`` inside :meth:`enable_wrap`, returns it unchanged outside."""
        ...

    def full_params(
        self, module: nn.Module, *, recurse: bool = True, writeback: bool = True
    ) -> AbstractContextManager[None]:
        """Context in which ``module.parameters()`` are the full, unsharded parameters;
        with ``writeback`` in-place changes are sharded back on exit."""
        ...

    def named_full_params(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Detached copies of the full parameters, named as in the unwrapped module."""
        ...

    def full_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """A state dict of full (unsharded) tensors, cloned, that
        :meth:`load_full_state_dict` accepts."""
        ...

    def load_full_state_dict(self, module: nn.Module, state_dict: dict[str, Any]) -> None:
        """Loads a state dict produced by :meth:`full_state_dict`."""
        ...

    @property
    def unit_class(self) -> type:
        """The class of this engine's unit (one all-gather, one reduce-scatter)."""
        ...

    def patch_target(self, event: str) -> PatchTarget:
        """Where the callable for ``event`` (one of :data:`UNIT_EVENTS`, or of
        :data:`OPTIONAL_PATCH_EVENTS` where the engine has it) lives.

        The call signature of the callable differs between engines: a patch should forward
        ``*args, **kwargs`` unchanged.
        """
        ...

    def probe(self) -> Probe:
        """What the recorder asks about this engine's units (see :class:`Probe`)."""
        ...

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        """The collectives one training step of ``module`` (sharded by this engine) should
        send, or None when the engine has no theory for it. See [Note: theoretical volume] in
        ``engines/_volume.py``.

        Args:
            module: the sharded model.
            full_shard: units reshard after forward (``FULL_SHARD``).
        """
        ...

    def full_precision_classes(self, mixed_precision: Any) -> tuple[type[nn.Module], ...]:
        """Module classes that this engine itself keeps out of ``mixed_precision`` (FSDP1
        wraps batch norms separately with mixed precision off); empty for the others."""
        ...

    def make_optimizer(
        self, module: nn.Module, build: Callable[[Iterable[nn.Parameter]], Any]
    ) -> Any:
        """The optimizer (``step()``, ``zero_grad()``) that trains ``module`` (sharded by this
        engine), given how the test builds one over parameters: ``build(module.parameters())``
        for engines whose optimizer steps the module's parameters; an engine that shards the
        optimizer itself (ZeRO) builds it over its shards."""
        ...


@runtime_checkable
class StepsItself(Protocol):
    """An engine that runs a step's forward, loss and backward itself (graph mode runs one
    traced graph, not the module's forward); the parity trainer calls :meth:`train_step` in
    their place and then steps the optimizer as for any engine."""

    def train_step(
        self,
        module: nn.Module,
        inputs: tuple[Any, ...],
        loss_fn: Callable[[nn.Module, tuple[Any, ...]], torch.Tensor],
    ) -> torch.Tensor:
        """Forward, loss (``loss_fn(module, inputs)``) and backward of ``module`` sharded by
        this engine; returns the loss, detached, with the gradients on the parameters."""
        ...


class BaseEngine:
    """Defaults for the parts of :class:`FSDPEngine` that an engine may leave out: nested
    units, a recorder probe that infers nothing, no theoretical volume, no module kept out of
    mixed precision, the test's optimizer over the module's parameters."""

    name: str = ""
    nested_units: bool = True

    def make_optimizer(
        self, module: nn.Module, build: Callable[[Iterable[nn.Parameter]], Any]
    ) -> Any:
        return build(module.parameters())

    def probe(self) -> Probe:
        return Probe()

    def theoretical_volume(self, module: nn.Module, *, full_shard: bool) -> CommVolume | None:
        return None

    def full_precision_classes(self, mixed_precision: Any) -> tuple[type[nn.Module], ...]:
        return ()

    def __repr__(self) -> str:
        return f"<engine {self.name}>"


def has_nested_units(engine: Any) -> bool:
    """``engine.nested_units``, True for an engine that does not say (see
    :attr:`FSDPEngine.nested_units`)."""
    return bool(getattr(engine, "nested_units", True))


def engine_optimizer(
    engine: Any, module: nn.Module, build: Callable[[Iterable[nn.Parameter]], Any]
) -> Any:
    """``engine.make_optimizer(module, build)``, or ``build(module.parameters())`` for an
    engine without it (see :meth:`FSDPEngine.make_optimizer`)."""
    make = getattr(engine, "make_optimizer", None)
    return make(module, build) if make is not None else build(module.parameters())


def clean_param_name(name: str) -> str:
    """A parameter or module name without the parts that wrappers insert (FSDP1's
    ``_fsdp_wrapped_module``, activation checkpointing, ``torch.compile``):
    ``"_fsdp_wrapped_module.0._fsdp_wrapped_module.weight"`` -> ``"0.weight"``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def has_accelerator() -> bool:
    """Whether torch sees a non-CPU accelerator (CUDA, XPU, ...)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


_ACCELERATOR_BACKENDS = ("nccl", "xccl", "hccl")


def computes_on_cpu(group: dist.ProcessGroup | None) -> bool:
    """Whether ranks of ``group`` (default: the default group) compute on the CPU: no
    accelerator, or a group whose backend moves CPU tensors only (gloo, threads, local or fake
    ranks), where the rank's ``device`` is the CPU also on a machine with GPUs."""
    if not has_accelerator():
        return True
    if not dist.is_initialized():
        return False
    backend = str(dist.get_backend(group))
    return not any(name in backend for name in _ACCELERATOR_BACKENDS)


def default_process_group() -> dist.ProcessGroup:
    """The default process group of the calling rank (also per thread under threaded groups)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fsdp_testing: no process group is initialized; run inside a "
            "@pytest.mark.distributed test or call torch.distributed.init_process_group first"
        )
    return dist.distributed_c10d._get_default_group()


def broadcast_module_states(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    *,
    skip: Callable[[nn.Module], bool] = lambda _: False,
) -> None:
    """Copies rank 0's parameters and buffers of ``module`` to every rank of the group.

    Subtrees for which ``skip`` is true are left alone: they are already sharded, and their
    local tensors are per-rank shards that must not be overwritten.

    Args:
        module: the module whose states to synchronize in place.
        process_group: the group; ``None`` means the default group.
        skip: predicate on submodules whose parameters and buffers must not be touched.
    """
    group = process_group if process_group is not None else default_process_group()
    source = dist.get_global_rank(group, 0)
    seen: set[int] = set()
    pending = [module]
    while pending:
        current = pending.pop()
        if current is not module and skip(current):
            continue
        states = [*current.parameters(recurse=False), *current.buffers(recurse=False)]
        with torch.no_grad():
            for tensor in states:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                dist.broadcast(tensor.data, src=source, group=group)
        pending.extend(current.children())


def modules_selected_by_policy(root: nn.Module, policy: Any) -> list[nn.Module]:
    """The submodules of ``root`` (not ``root`` itself) that an FSDP1-style auto-wrap policy
    wraps, children before parents, so that wrapping them in order is bottom-up.

    Args:
        root: the module about to be sharded.
        policy: an object with ``_run_policy(root, ignored_modules, root_kwargs)`` (torch's
            ``ModuleWrapPolicy`` and friends) or a callable
            ``policy(module=, recurse=, nonwrapped_numel=)`` (``size_based_auto_wrap_policy``).
    """
    if hasattr(policy, "_run_policy"):
        targets = policy._run_policy(root, set(), {})
        return [m for m in _post_order(root) if m is not root and m in targets]
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a policy object or a callable, got {type(policy).__name__}"
        )
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        # Returns the number of parameter elements left unwrapped under ``module``.
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            child_numel = sum(p.numel() for p in child.parameters())
            if policy(module=child, recurse=True, nonwrapped_numel=child_numel):
                remaining += visit(child)
            else:
                remaining += child_numel
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            chosen.append(module)
            return 0
        return remaining

    visit(root)
    return chosen


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def translate_kwargs(fsdp_kwargs: dict[str, Any], targets: dict[str, type]) -> dict[str, Any]:
    """Converts option values written for another engine into this engine's types.

    Enums are matched by member name (``ShardingStrategy.FULL_SHARD`` of torch becomes
    ``fsdp_core.ShardingStrategy.FULL_SHARD``); dataclass configs (``CPUOffload``,
    ``MixedPrecision``) are rebuilt from the fields both classes have. Values already of the
    target type, ``None`` and options not in ``targets`` pass through.

    Args:
        fsdp_kwargs: the options as given by the test.
        targets: option name to this engine's type for that option.
    """
    translated = dict(fsdp_kwargs)
    for key, target in targets.items():
        value = translated.get(key)
        if value is None or isinstance(value, target):
            continue
        if issubclass(target, enum.Enum) and isinstance(value, enum.Enum):
            if value.name not in target.__members__:
                raise ValueError(
                    f"{key}={value!r} has no counterpart in {target.__module__}.{target.__name__}"
                    f"; valid members: {', '.join(target.__members__)}"
                )
            translated[key] = target[value.name]
        elif dataclasses.is_dataclass(target) and dataclasses.is_dataclass(value):
            names = {f.name for f in dataclasses.fields(target) if f.init}
            fields = {
                f.name: getattr(value, f.name)
                for f in dataclasses.fields(value)
                if f.name in names and not f.name.startswith("_")
            }
            translated[key] = target(**fields)
    return translated
