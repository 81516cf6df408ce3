"""The composable door's policies, with torch FSDP2's names: frozen, keyword-only, validated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute, gradient reduction and outputs (torch FSDP2's policy; its fields
    may be given positionally, in this order, as torch's).

    The rule (docs/core.md, "Mixed precision"): if ``param_dtype`` is set and ``reduce_dtype``
    is not, gradients are reduced in ``param_dtype``. Sharded parameters, gradients and
    optimizer state keep the original dtype.

    Args:
        param_dtype: dtype of the unsharded parameters in forward/backward; the all-gather
            moves this dtype (default ``None``: the original dtype).
        reduce_dtype: dtype of the gradient reduction (default ``None``: ``param_dtype``).
        output_dtype: dtype the floating-point forward outputs are cast to (default ``None``:
            no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype`` (default
            ``True``).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

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


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters stay on the compute device (the default policy)."""


@dataclass(frozen=True, kw_only=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients and the optimizer step on the CPU.

    Each all-gather copies the local shard to the compute device first; each reduced gradient
    shard is copied back.

    Args:
        pin_memory: pin the host shards (default ``True``); only where an accelerator exists,
            since pinned memory needs one.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(
                f"CPUOffloadPolicy(pin_memory=...) takes a bool, got {self.pin_memory!r}."
            )


@dataclass(frozen=True, kw_only=True)
class DataParallelMeshDims:
    """Which dimensions of a full SPMD ``DeviceMesh`` are data parallel (torch's meaning).

    Passed to ``fully_shard(dp_mesh_dims=...)`` when the parameters are already ``DTensor``s
    on that mesh: ``shard`` names the dimension(s) FSDP shards over, ``replicate`` the one(s)
    it replicates over (HSDP or DDP). A tuple of names is flattened into one dimension.

    Args:
        shard: mesh dimension name(s) to shard on (default ``None``).
        replicate: mesh dimension name(s) to replicate on (default ``None``).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "DataParallelMeshDims needs at least one of shard=... and replicate=..., e.g. "
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
