"""Mixed precision: the dtypes a unit computes and reduces in, input casting, buffer casting.

[Note: mixed precision]
A unit keeps its sharded parameters (what the optimizer steps) in their original dtype. With a
policy, ``unshard`` casts the local shard to ``param_dtype`` before the all-gather, so the
collective moves low-precision bytes and forward/backward run on low-precision unsharded
parameters; their gradients arrive in ``param_dtype``. ``post_backward`` copies them into the
reduce buffer in ``reduce_dtype`` (``param_dtype`` when only that is set), pre-divides, reduces,
and casts the result to the original dtype unless ``keep_low_precision_grads``. A dtype equal to
the original one resolves to "no cast", which is what makes such a policy a no-op.

Buffers belong to the FSDP instance whose module owns them (not a nested instance's); each
instance casts its floating-point buffers to its own ``buffer_dtype`` at root lazy init and
remembers the original dtype per (module, buffer name), so full state dicts restore it per
buffer even when nested modules use the same buffer name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .api import MixedPrecision

__all__ = ["BufferSlot", "UnitPrecision", "cast_floating_tensors"]


@dataclass(frozen=True)
class UnitPrecision:
    """The dtypes one unit works in, with every ``None`` of the policy resolved.

    See [Note: mixed precision].
    """

    orig_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    keep_low_precision_grads: bool = False
    # Which of param_dtype and reduce_dtype the policy named (the others follow orig_dtype).
    policy_sets_param: bool = False
    policy_sets_reduce: bool = False

    @classmethod
    def resolve(cls, policy: MixedPrecision | None, orig_dtype: torch.dtype) -> UnitPrecision:
        if policy is None:
            return cls(orig_dtype, orig_dtype, orig_dtype)
        param_dtype = policy.param_dtype or orig_dtype
        reduce_dtype = policy.reduce_dtype or policy.param_dtype or orig_dtype
        return cls(
            orig_dtype,
            param_dtype,
            reduce_dtype,
            policy.keep_low_precision_grads,
            policy_sets_param=policy.param_dtype is not None,
            policy_sets_reduce=(policy.reduce_dtype or policy.param_dtype) is not None,
        )

    def with_orig_dtype(self, orig_dtype: torch.dtype) -> UnitPrecision:
        """The dtypes after the parameters became ``orig_dtype`` (``module.to(dtype)``): what
        followed the original dtype follows it, what the policy named stays, also when it
        named the old original dtype (bf16 parameters under a bf16 policy cast to fp32 still
        compute and reduce in bf16, as in FSDP2)."""
        return UnitPrecision(
            orig_dtype,
            self.param_dtype if self.policy_sets_param else orig_dtype,
            self.reduce_dtype if self.policy_sets_reduce else orig_dtype,
            self.keep_low_precision_grads,
            policy_sets_param=self.policy_sets_param,
            policy_sets_reduce=self.policy_sets_reduce,
        )

    def compute_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The compute dtype of a parameter of ``dtype``: ``param_dtype`` for the unit's
        own; for a frozen one of another dtype (see [Note: mixed dtypes in one unit] in
        ``_flat``), the policy's ``param_dtype`` if it names one, else its own, as FSDP2."""
        if dtype == self.orig_dtype or self.policy_sets_param:
            return self.param_dtype
        return dtype

    @property
    def casts_params(self) -> bool:
        return self.param_dtype != self.orig_dtype

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients end in on the sharded parameters."""
        return self.reduce_dtype if self.keep_low_precision_grads else self.orig_dtype


def cast_floating_tensors(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor leaf cast to ``dtype`` (others untouched)."""

    def cast(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return pytree.tree_map(cast, tree)


@dataclass(frozen=True)
class BufferSlot:
    """A floating-point buffer one FSDP instance owns, with the dtype it had at wrap time."""

    module: nn.Module
    name: str
    orig_dtype: torch.dtype

    def cast(self, dtype: torch.dtype) -> None:
        buffer = self.module._buffers.get(self.name)
        if buffer is not None and buffer.dtype != dtype:
            self.module._buffers[self.name] = buffer.to(dtype)
