"""Public configuration types: strategies, prefetch modes, offload and precision policies."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "ShardingStrategy",
    "StateDictType",
    "TrainingState",
]


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are spread over the group."""

    FULL_SHARD = enum.auto()
    """Shard parameters and gradients; free the unsharded parameters after forward and backward."""
    SHARD_GRAD_OP = enum.auto()
    """Shard parameters and gradients; keep the unsharded parameters from forward to backward."""
    NO_SHARD = enum.auto()
    """Replicate parameters (like DDP); all-reduce gradients once per unit."""
    HYBRID_SHARD = enum.auto()
    """FULL_SHARD within a node, replicate across nodes (arrives in a later issue)."""
    _HYBRID_SHARD_ZERO2 = enum.auto()
    """SHARD_GRAD_OP within a node, replicate across nodes (arrives in a later issue)."""


class BackwardPrefetch(enum.Enum):
    """When to all-gather the next unit's parameters during backward."""

    BACKWARD_PRE = enum.auto()
    """Before computing the current unit's gradients (more overlap, more memory)."""
    BACKWARD_POST = enum.auto()
    """After the current unit's gradients are computed and reduced (less memory)."""


class StateDictType(enum.Enum):
    """Which state dict layout ``state_dict()`` produces (implemented with the state dict work)."""

    FULL_STATE_DICT = enum.auto()
    """Unsharded tensors, as a plain ``nn.Module`` would produce."""
    LOCAL_STATE_DICT = enum.auto()
    """Each rank's flat local shards."""
    SHARDED_STATE_DICT = enum.auto()
    """Each rank's shards, with the metadata needed to reload at another world size."""


class TrainingState(enum.Enum):
    """Where an FSDP instance or unit is in the training step."""

    IDLE = enum.auto()
    """Between steps: no forward or backward in progress."""
    FORWARD = enum.auto()
    """Inside the module's forward."""
    PRE_BACKWARD = enum.auto()
    """Backward has reached the unit's outputs; its gradients are being computed."""
    POST_BACKWARD = enum.auto()
    """The unit's gradients are computed and being (or have been) reduced."""


@dataclass(frozen=True, kw_only=True)
class CPUOffload:
    """Keep sharded parameters (and their gradients) on the CPU between uses.

    Args:
        offload_params: move sharded parameters to the CPU (default ``False``).
    """

    offload_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(
                f"CPUOffload(offload_params=...) takes a bool, got {self.offload_params!r}."
            )


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward/backward (default
            ``None``: keep the original dtype).
        reduce_dtype: dtype of the gradient reduction (default ``None``: ``param_dtype`` if set,
            else the original dtype).
        buffer_dtype: dtype buffers are cast to for compute (default ``None``: unchanged).
        keep_low_precision_grads: leave gradients in the reduce dtype (default ``False``).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecision({field_name}=...) takes a torch.dtype or None, got {value!r}."
                )
