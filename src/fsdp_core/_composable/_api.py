"""The composable door's policies, with torch FSDP2's names: frozen, keyword-only, validated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "default_reduce_dtype",
    "reduce_follows_grad_dtype",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and outputs (torch FSDP2's policy; its first
    four fields may be given positionally, in this order, as torch's).

    The rule for ``reduce_dtype=None`` follows the installed torch, which changed it in 2.15
    (docs/core.md, "Mixed precision"): before 2.15, gradients are reduced in ``param_dtype``
    when it is set; from 2.15 on, in the dtype of the parameters' gradients (their original
    dtype), so fp32 parameters with ``param_dtype=torch.bfloat16`` reduce in fp32. Sharded
    parameters, gradients and optimizer state keep the original dtype.

    Args:
        param_dtype: dtype of the unsharded parameters in forward/backward; the all-gather
            moves this dtype (default ``None``: the original dtype).
        reduce_dtype: dtype of the gradient reduction, and of gradients accumulated while
            ``set_requires_gradient_sync(False)`` (default ``None``: see the rule above,
            :func:`default_reduce_dtype`).
        output_dtype: dtype the floating-point forward outputs are cast to (default ``None``:
            no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype`` (default
            ``True``).
        param_dtype_override_fn: keyword only; ``fn(param)`` called once per parameter when
            ``fully_shard`` is applied, returning ``None`` or ``param_dtype`` (use
            ``param_dtype``) or the parameter's own dtype (keep that parameter in it, e.g. a
            router or norm weight in fp32); any other dtype is a ``ValueError``. It must
            answer alike on every rank. Input casting still uses ``param_dtype`` (default
            ``None``: every parameter uses ``param_dtype``).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(
                    f"MixedPrecisionPolicy({name}={value!r}) takes a floating-point "
                    "torch.dtype or None, e.g. torch.bfloat16."
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy(cast_forward_inputs=...) takes a bool, got "
                f"{self.cast_forward_inputs!r}."
            )
        if self.param_dtype_override_fn is not None and not callable(self.param_dtype_override_fn):
            raise TypeError(
                "MixedPrecisionPolicy(param_dtype_override_fn=...) takes a callable "
                "fn(param) -> torch.dtype | None, got "
                f"{self.param_dtype_override_fn!r}."
            )

    def param_dtype_for(self, param: nn.Parameter, fqn: str = "") -> torch.dtype | None:
        """The compute dtype of ``param`` under this policy: ``param_dtype``, or what
        ``param_dtype_override_fn`` answers for it (``None`` there means ``param_dtype``).

        Args:
            param: the parameter, before sharding.
            fqn: its name, for the error (default ``""``).
        """
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        answer = self.param_dtype_override_fn(param)
        if answer is None:
            return self.param_dtype
        if not isinstance(answer, torch.dtype):
            raise ValueError(
                "MixedPrecisionPolicy.param_dtype_override_fn must return a torch.dtype or "
                f"None but got {type(answer)} for parameter {fqn!r}."
            )
        if answer not in (self.param_dtype, param.dtype):
            raise ValueError(
                "MixedPrecisionPolicy.param_dtype_override_fn must return None, param_dtype, "
                f"or the parameter's original dtype but got {answer} for parameter {fqn!r} "
                f"with dtype {param.dtype} and param_dtype {self.param_dtype}. Return "
                f"{param.dtype} to keep it in its dtype, or None for param_dtype."
            )
        return answer


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters stay on the compute device (the default policy)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and the optimizer step on the CPU.

    Each all-gather copies the local shard to the compute device first; each reduced gradient
    shard is copied back.

    Args:
        pin_memory: pin the host shards (default ``True``; may be given positionally, as in
            torch); only where an accelerator exists, since pinned memory needs one.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(
                f"CPUOffloadPolicy(pin_memory=...) takes a bool, got {self.pin_memory!r}."
            )


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dimensions of a full SPMD ``DeviceMesh`` are data parallel (torch's meaning).

    Passed to ``fully_shard(dp_mesh_dims=...)`` when the parameters are already ``DTensor``s
    on that mesh: ``shard`` names the dimension(s) FSDP shards over, ``replicate`` the one(s)
    it replicates over (HSDP or DDP). A tuple of names is flattened into one dimension.
    Both may be given positionally (``shard`` first), as in torch.

    Args:
        shard: mesh dimension name(s) to shard on (default ``None``).
        replicate: mesh dimension name(s) to replicate on (default ``None``).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims: At least one of shard or replicate must be set, e.g. "
                "DataParallelMeshDims(shard='dp')."
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """The shard dimension names, as a tuple (empty when unset)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """The replicate dimension names, as a tuple (empty when unset)."""
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def reduce_follows_grad_dtype() -> bool:
    """Whether ``reduce_dtype=None`` means the gradients' dtype (torch 2.15 and later) rather
    than ``param_dtype`` (before): the installed torch decides, as its ``fully_shard`` does.
    See "Mixed precision" in docs/core.md."""
    return _torch_release() >= (2, 15)


def default_reduce_dtype(policy: MixedPrecisionPolicy, grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype a unit reduces in under ``policy``: ``reduce_dtype`` when set, else
    ``grad_dtype`` (the parameters' original dtype) from torch 2.15 on, else ``param_dtype``
    when set, else ``grad_dtype``.

    Args:
        policy: the unit's policy.
        grad_dtype: the dtype of the parameters' gradients (their original dtype).
    """
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    if reduce_follows_grad_dtype():
        return grad_dtype
    return policy.param_dtype or grad_dtype


def _torch_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch (``2.15.0.dev2026...`` is ``(2, 15)``)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
