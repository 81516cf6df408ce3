"""``common_dtensor``'s checks of DTensor sharding rules: whether an op run on the local shards
of its inputs gives the full result (:func:`validate_sharding_rule_sample`) and the full
gradients (:func:`validate_sharding_rule_sample_backward`), and a strategy registered for the
length of a block (:func:`op_strategy_context`). DTensor's internals are imported on use."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "op_strategy_context",
    "validate_sharding_rule_sample",
    "validate_sharding_rule_sample_backward",
]


def _tensors_in(*trees: Any) -> list[torch.Tensor]:
    return [
        leaf
        for tree in trees
        for leaf in pytree.tree_leaves(tree)
        if isinstance(leaf, torch.Tensor)
    ]


def _with_tensors(args: Any, kwargs: Any, replacements: Sequence[Any]) -> Any:
    """``(args, kwargs)`` with their tensors replaced, in order, by ``replacements``."""
    it = iter(replacements)
    return pytree.tree_map(lambda a: next(it) if isinstance(a, torch.Tensor) else a, (args, kwargs))


def validate_sharding_rule_sample(
    op: Callable[..., Any],
    full_args: Any,
    full_kwargs: Any,
    input_placements: Sequence[Any],
    output_placements: Sequence[Any],
    device_mesh: Any,
) -> bool:
    """Whether running ``op`` on the local shards of its inputs (placed as
    ``input_placements``) gives outputs that, read as ``output_placements`` and replicated,
    equal ``op`` on the full inputs (``atol=rtol=1e-5``, NaNs equal).

    Args:
        op: the operator.
        full_args: its positional arguments, with full tensors.
        full_kwargs: its keyword arguments.
        input_placements: one placement per input tensor (1-D mesh).
        output_placements: one placement per output tensor.
        device_mesh: the 1-D mesh.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    inputs = _tensors_in(full_args, full_kwargs)
    shards = [
        distribute_tensor(t, device_mesh, (p,)).to_local()
        for t, p in zip(inputs, input_placements, strict=False)
    ]
    local_args, local_kwargs = _with_tensors(full_args, full_kwargs, shards)
    expected = _tensors_in(op(*full_args, **full_kwargs))
    got = _tensors_in(op(*local_args, **local_kwargs))
    for ref, local, placement in zip(expected, got, output_placements, strict=False):
        placed = DTensor.from_local(local, device_mesh, (placement,))
        full = placed.redistribute(device_mesh, (Replicate(),)).to_local()
        if ref.shape != full.shape or not torch.allclose(
            ref, full, atol=1e-5, rtol=1e-5, equal_nan=True
        ):
            return False
    return True


def _backward_of(outputs: Any) -> bool:
    """Backpropagate the sum of ``outputs``' differentiable float tensors; False if none."""
    differentiable = [
        t
        for t in pytree.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not differentiable:
        return False
    total: Any = sum(t.sum() for t in differentiable)
    total.backward()
    return True


def _leaves_with_grad(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    copies = []
    for t in tensors:
        c = t.detach().clone()
        if c.is_floating_point():
            c.requires_grad_(True)
        copies.append(c)
    return copies


def validate_sharding_rule_sample_backward(
    op: Callable[..., Any],
    full_args: Any,
    full_kwargs: Any,
    input_placements: Sequence[Any],
    device_mesh: Any,
) -> bool | None:
    """Whether ``op``'s gradients through DTensors placed as ``input_placements`` equal its
    gradients on full tensors (``atol=1e-5, rtol=1.3e-6``, NaNs equal).

    Returns:
        None when the check does not apply (no float inputs, no differentiable output, the
        reference backward fails, or DTensor has no sharding strategy for the op), else
        whether every gradient matched.

    Args:
        op: the operator.
        full_args: its positional arguments, with full tensors.
        full_kwargs: its keyword arguments.
        input_placements: one placement per input tensor (1-D mesh).
        device_mesh: the 1-D mesh.

    Raises:
        ValueError: ``input_placements`` does not have one placement per input tensor.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    inputs = _tensors_in(full_args, full_kwargs)
    if not any(t.is_floating_point() for t in inputs):
        return None
    reference = _leaves_with_grad(inputs)
    ref_args, ref_kwargs = _with_tensors(full_args, full_kwargs, reference)
    try:
        if not _backward_of(op(*ref_args, **ref_kwargs)):
            return None
    except RuntimeError:
        return None
    if len(input_placements) != len(inputs):
        raise ValueError(
            f"validate_sharding_rule_sample_backward: {len(input_placements)} placements for "
            f"{len(inputs)} input tensors; pass one placement per tensor"
        )
    distributed = [
        distribute_tensor(c, device_mesh, (p,))
        for c, p in zip(_leaves_with_grad(inputs), input_placements, strict=True)
    ]
    dt_args, dt_kwargs = _with_tensors(full_args, full_kwargs, distributed)
    try:
        if not _backward_of(op(*dt_args, **dt_kwargs)):
            return None
    except Exception as exc:
        message = str(exc)
        if (
            "does not have a sharding strategy registered" in message
            or "got mixed torch.Tensor and DTensor" in message
        ):
            return None
        raise
    for ref, dt in zip(reference, distributed, strict=True):
        if not ref.is_floating_point() or ref.grad is None:
            continue
        if dt.grad is None:
            return False
        grad = dt.grad.full_tensor() if isinstance(dt.grad, DTensor) else dt.grad
        if ref.grad.shape != grad.shape or not torch.allclose(
            ref.grad, grad, atol=1e-5, rtol=1.3e-6, equal_nan=True
        ):
            return False
    return True


@contextlib.contextmanager
def op_strategy_context(
    op_overload: Any, strategy_func: Callable[..., Any], schema_info: Any = None
) -> Iterator[None]:
    """Within the block, DTensor shards ``op_overload`` with ``strategy_func`` (registered as
    ``register_op_strategy`` does); afterwards its previous strategy and schema info are back
    and the sharding caches are cleared.

    Args:
        op_overload: the operator overload, e.g. ``torch.ops.aten.mm.default``.
        strategy_func: the strategy function.
        schema_info: the ``RuntimeSchemaInfo`` to register with it (default None).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    saved_strategy = propagator.op_strategy_funcs.pop(op_overload, None)
    saved_schema = propagator.op_to_schema_info.pop(op_overload, None)
    try:
        register_op_strategy(op_overload, schema_info=schema_info)(strategy_func)
        yield
    finally:
        tables: list[tuple[dict[Any, Any], Any]] = [
            (propagator.op_strategy_funcs, saved_strategy),
            (propagator.op_to_schema_info, saved_schema),
        ]
        for table, saved in tables:
            if saved is None:
                table.pop(op_overload, None)
            else:
                table[op_overload] = saved
        _clear_sharding_prop_cache()
