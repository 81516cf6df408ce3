"""The reference-model interface, the init-mode enums and device placement helpers."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engines import current_engine, has_nested_units

__all__ = [
    "CUDAInitMode",
    "DEVICEInitMode",
    "FSDPInitMode",
    "FSDPTestModel",
    "as_device_init_mode",
    "as_fsdp_init_mode",
    "default_device",
    "resolve_device",
]

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


class FSDPInitMode(enum.Enum):
    """How a reference model's ``init()`` applies sharding."""

    #: Plain module, no sharding (the data parallel reference).
    NO_FSDP = 1
    #: Shard as torch's model of the same name does: ``TransformerWithSharedParams`` and
    #: ``AlwaysWrapNestedWrappedModule`` shard the root (its units nested inside);
    #: ``NestedWrappedModule``, ``NonUniformReqGradNWM``, ``MixtureOfExperts`` and
    #: ``NestedWrappedModuleWithDelay`` shard nested units only, and the parity check (as
    #: torch's) wraps the root before training.
    RECURSIVE = 2


class DEVICEInitMode(enum.Enum):
    """When a reference model moves to its compute device. ``CUDA_*`` are aliases."""

    #: Move to the device before sharding.
    DEVICE_BEFORE = 1
    #: Move to the device after sharding.
    DEVICE_AFTER = 2
    #: Stay on the CPU.
    DEVICE_NEVER = 3
    CUDA_BEFORE = 1
    CUDA_AFTER = 2
    CUDA_NEVER = 3


#: torch's older name; its members ``CUDA_BEFORE/CUDA_AFTER/CUDA_NEVER`` are the same objects
#: as ``DEVICEInitMode.DEVICE_BEFORE/DEVICE_AFTER/DEVICE_NEVER``.
CUDAInitMode = DEVICEInitMode


def _by_name(value: Any, enum_cls: type[enum.Enum], api: str) -> Any:
    if isinstance(value, enum_cls):
        return value
    name = getattr(value, "name", value)
    if isinstance(name, str) and name in enum_cls.__members__:
        return enum_cls[name]
    valid = ", ".join(enum_cls.__members__)
    raise ValueError(f"{api}: unsupported {enum_cls.__name__} {value!r}; valid: {valid}")


def as_fsdp_init_mode(value: Any) -> FSDPInitMode:
    """Accepts our :class:`FSDPInitMode`, torch's, or a member name."""
    return _by_name(value, FSDPInitMode, "fsdp_init_mode")


def as_device_init_mode(value: Any) -> DEVICEInitMode:
    """Accepts our :class:`DEVICEInitMode`, torch's ``DEVICEInitMode``/``CUDAInitMode``, or a
    member name."""
    return _by_name(value, DEVICEInitMode, "device_init_mode")


def default_device() -> torch.device:
    """Where this rank computes: the current CUDA device when CUDA is available, unless the
    default process group runs on a CPU backend (gloo, threads, local or fake ranks: a rank's
    ``device`` fixture is the CPU there, also on a machine with GPUs), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_available() and dist.is_initialized() and "nccl" not in dist.get_backend():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``None`` means :func:`default_device`; an int is a CUDA index."""
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def placer(mode: DEVICEInitMode, device: torch.device) -> Callable[[_ModuleT], _ModuleT]:
    """Returns the function that places a freshly built layer according to ``mode``."""
    if mode is DEVICEInitMode.DEVICE_BEFORE:
        return lambda module: module.to(device)
    return lambda module: module


def sharder(
    enabled: bool, group: Any, fsdp_kwargs: dict[str, Any]
) -> Callable[[nn.Module], nn.Module]:
    """Returns the function that shards one submodule with the active engine, or the identity
    (also for a root-only engine: see [Note: root-only engines] in ``engines/_root_only.py``)."""
    engine = current_engine()
    if not enabled or not has_nested_units(engine):
        return lambda module: module
    return lambda module: engine.wrap(module, group, **fsdp_kwargs)


def finish_placement(
    model: _ModuleT, mode: DEVICEInitMode, device: torch.device, sharded: bool
) -> _ModuleT:
    """Moves a sharded model for ``DEVICE_AFTER``."""
    if sharded and mode is DEVICEInitMode.DEVICE_AFTER:
        return model.to(device)
    return model


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """Rank and size of a process group (or the first of a tuple of groups, as for hybrid
    sharding); ``None`` means the default group."""
    if isinstance(group, tuple):
        group = group[0]
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return group.rank(), group.size()


class FSDPTestModel(nn.Module, ABC):
    """The interface the parity checks drive: inputs, loss, backward and construction."""

    @abstractmethod
    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Returns the positional inputs of ``forward`` on ``device`` (same on every call)."""

    @abstractmethod
    def get_loss(self, input: Any, output: Any) -> torch.Tensor:
        """Returns the scalar loss for ``output`` computed from ``input``."""

    @abstractmethod
    def run_backward(self, loss: torch.Tensor) -> None:
        """Runs the backward pass for ``loss`` (and any manual gradient reduction)."""

    @staticmethod
    @abstractmethod
    def init(*args: Any, **kwargs: Any) -> nn.Module:
        """Builds the model, sharded or not according to the init modes."""
