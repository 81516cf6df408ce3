"""Public configuration types: strategies, prefetch modes, offload and precision policies."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
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
    """FULL_SHARD inside a shard group (default: a node), replicated across the replicate group:
    gradients are reduce-scattered inside, then all-reduced across (see ``docs/core.md``)."""
    _HYBRID_SHARD_ZERO2 = enum.auto()
    """HYBRID_SHARD keeping the unsharded parameters from forward to backward (SHARD_GRAD_OP
    inside the shard group)."""


class BackwardPrefetch(enum.Enum):
    """When to all-gather the next unit's parameters during backward."""

    BACKWARD_PRE = enum.auto()
    """Before computing the current unit's gradients (more overlap, more memory)."""
    BACKWARD_POST = enum.auto()
    """After the current unit's gradients are computed and reduced (less memory)."""


class StateDictType(enum.Enum):
    """Which state dict layout ``state_dict()`` produces and ``load_state_dict()`` expects."""

    FULL_STATE_DICT = enum.auto()
    """Unsharded tensors under the unwrapped names, as a plain ``nn.Module`` would produce."""
    LOCAL_STATE_DICT = enum.auto()
    """Each unit's flat local shard under ``<module>._flat_param``; loads only at the same
    world size and wrapping."""
    SHARDED_STATE_DICT = enum.auto()
    """``DTensor`` shards (``Shard(0)``) under the unwrapped names; DCP reshards them."""


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
    SUMMON_FULL_PARAMS = enum.auto()
    """Inside ``summon_full_params`` (or a full state dict save/load that uses it)."""


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

    The rule (docs/core.md, "Mixed precision"): if ``param_dtype`` is set and ``reduce_dtype``
    is not, gradients are reduced in ``param_dtype``. A dtype equal to the parameters' own dtype
    is a no-op, so ``MixedPrecision(param_dtype=torch.float32)`` on an fp32 model changes
    nothing.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward/backward (default
            ``None``: keep the original dtype). The sharded parameters, the optimizer state and
            (by default) the gradients stay in the original dtype.
        reduce_dtype: dtype of the gradient reduction (default ``None``: ``param_dtype`` if set,
            else the original dtype).
        buffer_dtype: dtype floating-point buffers are cast to for compute (default ``None``:
            unchanged). Full state dicts hold buffers in their original dtype.
        keep_low_precision_grads: leave the reduced gradients in the reduce dtype instead of
            casting them to the parameters' dtype (default ``False``).
        cast_forward_inputs: every FSDP instance casts the floating-point tensors among its
            forward arguments to ``param_dtype`` (default ``False``).
        cast_root_forward_inputs: the root instance casts its forward inputs to
            ``param_dtype`` (default ``True``, as in torch), so a model fed fp32 batches
            computes in ``param_dtype`` from its first layer on.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecision({field_name}=...) takes a torch.dtype or None, got {value!r}."
                )
            if value is not None and not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecision({field_name}={value}) must be a floating-point dtype, e.g. "
                    "torch.bfloat16 or torch.float16."
                )
        for field_name in (
            "keep_low_precision_grads",
            "cast_forward_inputs",
            "cast_root_forward_inputs",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, bool):
                raise TypeError(f"MixedPrecision({field_name}=...) takes a bool, got {value!r}.")


def _validate_bools(config: object) -> None:
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if field.type in ("bool", bool) and not isinstance(value, bool):
            raise TypeError(
                f"{type(config).__name__}({field.name}=...) takes a bool, got {value!r}."
            )


@dataclass(frozen=True, kw_only=True)
class StateDictConfig:
    """Options every model state dict layout shares (torch's base class).

    Args:
        offload_to_cpu: return the tensors on the CPU (default ``False``).
    """

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        _validate_bools(self)


@dataclass(frozen=True, kw_only=True)
class FullStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.FULL_STATE_DICT``.

    Args:
        offload_to_cpu: return the full tensors on the CPU (default ``False``).
        rank0_only: only global rank 0 receives the full state dict; every other rank gets an
            empty dict (default ``False``). All ranks must still call ``state_dict()``: the
            parameters are gathered collectively. Loading always needs the full state dict on
            every rank.
    """

    rank0_only: bool = False


@dataclass(frozen=True, kw_only=True)
class LocalStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.LOCAL_STATE_DICT`` (``offload_to_cpu`` only)."""


@dataclass(frozen=True, kw_only=True)
class ShardedStateDictConfig(StateDictConfig):
    """Options of ``StateDictType.SHARDED_STATE_DICT``.

    Args:
        offload_to_cpu: the ``DTensor``s' local shards are CPU copies (default ``False``).
        _use_dtensor: accepted for torch compatibility; the values are always ``DTensor``s.
    """

    _use_dtensor: bool = True


@dataclass(frozen=True, kw_only=True)
class OptimStateDictConfig:
    """Options every optimizer state dict layout shares (torch's base class).

    Args:
        offload_to_cpu: return the state tensors on the CPU (default ``True``, as in torch).
    """

    offload_to_cpu: bool = True

    def __post_init__(self) -> None:
        _validate_bools(self)


@dataclass(frozen=True, kw_only=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Options of the full optimizer state dict (unsharded state under parameter names).

    Args:
        offload_to_cpu: return the state tensors on the CPU (default ``True``).
        rank0_only: only global rank 0 receives the state tensors; the others get an empty
            dict (default ``False``). Every rank must call ``FSDP.optim_state_dict``.
    """

    rank0_only: bool = False


@dataclass(frozen=True, kw_only=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Options of the local optimizer state dict (each rank's own state, as it holds it).

    Args:
        offload_to_cpu: return the state tensors on the CPU (default ``False``).
    """

    offload_to_cpu: bool = False


@dataclass(frozen=True, kw_only=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Options of the sharded optimizer state dict (``DTensor`` state under parameter names).

    Args:
        offload_to_cpu: the local shards are CPU copies (default ``True``).
        _use_dtensor: accepted for torch compatibility; the values are always ``DTensor``s.
    """

    _use_dtensor: bool = True


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict names its parameters."""

    PARAM_NAME = enum.auto()
    """By fully qualified parameter name (what ``FSDP.optim_state_dict`` returns)."""
    PARAM_ID = enum.auto()
    """By the optimizer's integer parameter index (what ``optim.state_dict()`` returns)."""


@dataclass(frozen=True)
class StateDictSettings:
    """What ``FSDP.set_state_dict_type`` / ``get_state_dict_type`` return: the layout and
    both configurations in effect."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def default_state_dict_settings() -> StateDictSettings:
    """Full state dicts with the default configurations: every FSDP instance starts so."""
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )
