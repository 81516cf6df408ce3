"""The reference a sharded model trains against: the same model, replicated and data parallel
(DDP, or a wrapper such as ``DummyDDP`` for a model that averages its own gradients), and under
mixed precision running the policy's precision by hand.

[Note: mixed precision parity]
Under a ``MixedPrecision`` policy the reference is the same model, replicated, running the
policy's precision by hand (:class:`MixedPrecisionReference`):

- its parameters stay float32: the masters the optimizer steps, like the engine's sharded
  parameters;
- each forward computes with every parameter cast to ``param_dtype``, except those of the module
  classes the policy keeps in full precision (batch norms: FSDP1 wraps them with mixed precision
  off, and the reference models do the same for the other engines); float buffers are cast to
  ``buffer_dtype`` when it is set, and float inputs to ``param_dtype`` (the root's
  ``cast_forward_inputs``);
- autograd returns each gradient to its float32 master (exactly: a low-precision value fits in
  float32), and it is averaged in ``reduce_dtype`` (default ``param_dtype``) as the engines
  average: cast to the reduce dtype, divided by the world size, summed, cast back. A DDP
  reference does exactly that (a communication hook); a reference that averages by itself
  (``DummyDDP`` around a model with its own averaging) averages in float32, and the average is
  then rounded to the reduce dtype: at world size 2 the float32 sum of two low-precision values
  is exact, so rounding it once equals summing in the reduce dtype, except where a gradient is
  subnormal in the reduce dtype (halving it there loses a bit);
- the optimizer steps the float32 masters with the same SGD and momentum as the sharded model.

Both sides then do the same arithmetic, and losses (in ``param_dtype``) and full parameters
(float32) are compared under [Note: parity rule]: bitwise at world size 2 on the CPU, within
tolerances derived from the reduce dtype elsewhere. torch's ``_test_fsdp_parity`` compares with
DDP under ``torch.autocast`` instead, losses only: autocast keeps some operations (softmax,
norms, losses) and the parameters in float32, a different computation whose losses drift from
the sharded model's by up to 2.5% in three steps (the transformer in bf16, with every engine
alike), so only a loose tolerance on losses could hold, and parameters could not be compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..models import DummyDDP, FSDPTestModel

__all__ = ["MixedPrecisionReference", "build_reference", "find_test_model", "reference_body"]


class MixedPrecisionReference(nn.Module):
    """A module running a mixed precision policy by hand around float32 parameters. See [Note:
    mixed precision parity].

    Args:
        module: the plain model (kept as ``self.module``, parameters float32).
        mixed_precision: the policy (``param_dtype``, ``reduce_dtype``, ``buffer_dtype``;
            ``_module_classes_to_ignore`` where the policy has it, else batch norms).
    """

    def __init__(self, module: nn.Module, mixed_precision: Any) -> None:
        super().__init__()
        self.module = module
        self.param_dtype: torch.dtype | None = getattr(mixed_precision, "param_dtype", None)
        self.reduce_dtype: torch.dtype | None = (
            getattr(mixed_precision, "reduce_dtype", None) or self.param_dtype
        )
        self.buffer_dtype: torch.dtype | None = getattr(mixed_precision, "buffer_dtype", None)
        kept = tuple(
            getattr(
                mixed_precision, "_module_classes_to_ignore", (nn.modules.batchnorm._BatchNorm,)
            )
        )
        full = [m for m in module.modules() if kept and isinstance(m, kept)]
        #: ids of the parameters and buffers kept in full precision.
        self.full_precision_ids = {id(t) for m in full for t in (*m.parameters(), *m.buffers())}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.param_dtype is None:
            return self.module(*args, **kwargs)
        args = tuple(_cast(a, self.param_dtype) for a in args)
        kwargs = {k: _cast(v, self.param_dtype) for k, v in kwargs.items()}
        low: dict[str, torch.Tensor] = {
            name: param.to(self.param_dtype)
            for name, param in self.module.named_parameters()
            if id(param) not in self.full_precision_ids
        }
        if self.buffer_dtype is not None:
            low.update(
                (name, buffer.to(self.buffer_dtype))
                for name, buffer in self.module.named_buffers()
                if buffer.is_floating_point() and id(buffer) not in self.full_precision_ids
            )
        return torch.func.functional_call(self.module, low, args, kwargs)

    def round_gradients(self) -> None:
        """Rounds each averaged gradient to ``reduce_dtype`` (in place, staying float32), as if
        it had been summed in that dtype; call after the backward and the averaging."""
        if self.reduce_dtype is None:
            return
        with torch.no_grad():
            for param in self.module.parameters():
                if param.grad is not None and id(param) not in self.full_precision_ids:
                    param.grad.copy_(param.grad.to(self.reduce_dtype))


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def build_reference(
    plain: nn.Module,
    *,
    process_group: dist.ProcessGroup,
    device: torch.device,
    ref_init_fn: Callable[[nn.Module], nn.Module] | None = None,
    mixed_precision: Any = None,
    use_pure_fp16: bool = False,
) -> tuple[nn.Module, Callable[[], None] | None]:
    """The reference for ``plain``: under ``mixed_precision`` a
    :class:`MixedPrecisionReference` of it, then made data parallel by ``ref_init_fn``
    (default: DDP over ``process_group``); in fp16 with ``use_pure_fp16``.

    Returns:
        the reference, and what to run after each of its backward passes (the precision
        reference's :meth:`~MixedPrecisionReference.round_gradients`, or None).
    """
    body: nn.Module = plain
    after_backward = None
    if mixed_precision is not None and not use_pure_fp16:
        precise = MixedPrecisionReference(plain, mixed_precision)
        body, after_backward = precise, precise.round_gradients
    if ref_init_fn is not None:
        reference = ref_init_fn(body)
    else:
        ids = [device.index] if device.type == "cuda" and device.index is not None else None
        reference = DistributedDataParallel(body, device_ids=ids, process_group=process_group)
    if isinstance(body, MixedPrecisionReference) and isinstance(reference, DistributedDataParallel):
        if body.reduce_dtype not in (None, torch.float32):
            hook = _average_in(body.reduce_dtype, body.full_precision_ids)
            reference.register_comm_hook(process_group, hook)
    if use_pure_fp16:
        reference = reference.half()
    return reference, after_backward


def _average_in(
    dtype: torch.dtype, full_precision: set[int]
) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """A DDP communication hook that averages each bucket in ``dtype`` as the engines average
    gradients (cast, divide by the world size, sum, cast back), except the gradients of
    parameters in ``full_precision`` (ids), which it averages in the bucket's dtype."""

    def hook(group: dist.ProcessGroup, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()  # 1D, the bucket's gradients back to back, in bucket order
        world = dist.get_world_size(group)
        low = buffer.to(dtype).div_(world)
        dist.all_reduce(low, group=group)
        averaged = low.to(buffer.dtype)
        offset, kept = 0, []
        for param in bucket.parameters():
            if id(param) in full_precision:
                kept.append((offset, param.numel()))
            offset += param.numel()
        if kept:
            full = buffer.div(world)
            dist.all_reduce(full, group=group)
            for start, numel in kept:
                averaged[start : start + numel] = full[start : start + numel]
        buffer.copy_(averaged)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks a hook's annotations, which are strings in this module: give it the types.
    hook.__annotations__ = {
        "group": dist.ProcessGroup,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def find_test_model(model: nn.Module) -> FSDPTestModel:
    """The :class:`FSDPTestModel` inside wrappers (DDP, FSDP1, ``DummyDDP``, a precision
    reference)."""
    inner: Any = model
    while not isinstance(inner, FSDPTestModel):
        inner = getattr(inner, "module", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(
                f"{type(model).__name__} does not contain an FSDPTestModel (get_input, get_loss, "
                "run_backward); parity training needs one, or pass workload="
            )
    return inner


def reference_body(model: nn.Module) -> nn.Module:
    """The plain model inside a reference's wrappers (DDP, ``DummyDDP``, a precision
    reference), whose parameter names are the user's."""
    while isinstance(model, DistributedDataParallel | DummyDDP | MixedPrecisionReference):
        model = model.module
    return model
