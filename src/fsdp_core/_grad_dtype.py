"""Per-parameter gradient dtypes: ``param.grad_dtype`` under ``fully_shard`` from torch 2.15 on.

[Note: per-parameter gradient dtypes]
A tensor's ``grad_dtype`` says which dtype its ``.grad`` has: unset (the default) means the
tensor's own dtype; an explicit dtype means that one (fp32 gradients on a bf16 parameter); an
explicit ``None`` accepts whatever dtype autograd produces. torch 2.15's ``fully_shard`` honours
it per parameter, and so does the composable door here when the installed torch has it (the
door follows the installed torch, as with ``reduce_dtype=None``; see :func:`applies`):

- The policy (:class:`GradDtypePolicy`) is captured from the original parameter at
  ``fully_shard``, and again from the sharded parameter when it is replaced (``module.to``,
  ``load_state_dict(assign=True)``) or at the root's lazy init: a ``grad_dtype`` set on the
  sharded parameter before the first forward counts. An explicit policy is never unset, and a
  replacement parameter without one inherits it (``nn.Module._apply`` drops ``grad_dtype``).
- The sharded parameter carries the explicit policy, so its ``.grad`` may have that dtype.
- The unsharded parameter's ``grad_dtype`` is the dtype gradients accumulate in while they are
  not reduced (``set_requires_gradient_sync(False)``): ``reduce_dtype`` when the policy names
  one, else the parameter's explicit ``grad_dtype`` (``None``: the incoming dtype), else its
  original dtype. These pending gradients stay on the unsharded parameter's ``.grad``.
- A unit reduces in ``reduce_dtype`` when set, else in the promoted dtype of its gradients'
  accumulation dtypes (fp32 for bf16 and fp32; a ``None`` policy contributes its gradient's
  dtype), and each sharded gradient is cast to its parameter's explicit ``grad_dtype``
  (``None``: left in the reduction's dtype), else to the parameter's original dtype.
- ``set_reduce_scatter_unused_params(True)`` builds zeros for unused parameters, which need a
  dtype every rank agrees on: a trainable parameter with ``grad_dtype=None`` then needs an
  explicit ``reduce_dtype`` (``ValueError`` otherwise, when set and at backward).

Before torch 2.15 ``fully_shard`` ignores ``grad_dtype`` (its sharded parameters are new
tensors without it), and so does this door there.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ._param import ShardedParam

__all__ = [
    "GradDtypePolicy",
    "applies",
    "give_back_grads",
    "promoted",
    "set_grad_dtype",
    "take_explicit_grads",
]


@functools.cache
def applies() -> bool:
    """Whether the installed torch's ``fully_shard`` follows ``param.grad_dtype``: tensors
    that tell an explicit ``grad_dtype`` from the default (``_has_grad_dtype_override``,
    torch 2.15 and later)."""
    return hasattr(torch.Tensor, "_has_grad_dtype_override")


@dataclass
class GradDtypePolicy:
    """One parameter's ``grad_dtype`` policy: ``explicit`` False is the default (its dtype)."""

    explicit: bool = False
    dtype: torch.dtype | None = None

    def capture(self, tensor: torch.Tensor) -> None:
        """Take ``tensor``'s ``grad_dtype`` if set explicitly (an explicit one stays)."""
        if applies() and getattr(tensor, "_has_grad_dtype_override", False):
            self.explicit, self.dtype = True, tensor.grad_dtype

    def restore_on(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` the explicit policy, unless it has an explicit one of its own."""
        if self.explicit and not getattr(tensor, "_has_grad_dtype_override", False):
            set_grad_dtype(tensor, self.dtype)

    def sharded(self, default: torch.dtype) -> torch.dtype | None:
        """The dtype of the sharded ``.grad`` (``None``: the reduction's)."""
        return self.dtype if self.explicit else default

    def unsharded(self, reduce_dtype: torch.dtype | None, orig: torch.dtype) -> torch.dtype | None:
        """The dtype unreduced gradients accumulate in (``None``: as they come)."""
        if reduce_dtype is not None:
            return reduce_dtype
        return self.dtype if self.explicit else orig


def set_grad_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Set ``tensor.grad_dtype``, casting a ``.grad`` it holds to ``dtype`` first (torch refuses
    a ``grad_dtype`` its current gradient does not match)."""
    grad = tensor.grad
    if grad is not None and dtype is not None and grad.dtype != dtype:
        tensor.grad = None
        tensor.grad_dtype = dtype
        tensor.grad = grad.to(dtype)
        return
    tensor.grad_dtype = dtype


def promoted(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The dtype that holds all of ``dtypes`` (``torch.promote_types`` over them), or None."""
    result: torch.dtype | None = None
    for dtype in dtypes:
        result = dtype if result is None else torch.promote_types(result, dtype)
    return result


def take_explicit_grads(params: Iterable[ShardedParam]) -> dict[ShardedParam, torch.Tensor]:
    """Before ``nn.Module._apply``: take the ``.grad`` of each sharded parameter whose explicit
    ``grad_dtype`` (not the parameter's dtype) owns it. ``_apply`` would convert it with the
    parameter and attach it to a replacement that has no ``grad_dtype`` yet, which refuses it.
    :func:`give_back_grads` attaches them again once the unit adopted the replacements."""
    taken: dict[ShardedParam, torch.Tensor] = {}
    for p in params:
        p.grad_policy.capture(p.sharded)  # set on it since ``fully_shard``
        grad = p.sharded.grad
        if grad is not None and p.grad_policy.explicit:
            taken[p] = grad
            p.sharded.grad = None
    return taken


def give_back_grads(taken: dict[ShardedParam, torch.Tensor]) -> None:
    """The gradients of :func:`take_explicit_grads` on the (adopted) sharded parameters, moved
    to their device, in their own dtype."""
    for p, grad in taken.items():
        p.sharded.grad = grad.to(device=p.sharded.device)
