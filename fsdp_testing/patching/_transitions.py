"""Patching an engine's unit transitions (unshard, reshard, post-backward), wherever the engine
keeps them: each engine names its functions (:meth:`~fsdp_testing.engines.FSDPEngine.patch_target`),
so one helper reaches ``fsdp_core``'s ``FSDPUnit.unshard``, FSDP1's ``_runtime_utils._unshard``
and FSDP2's ``FSDPParamGroup.unshard``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..engines import FSDPEngine, resolve_engine
from ._dispatch import patched

__all__ = [
    "patch_post_backward",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
]


@contextlib.contextmanager
def _patch_unit(
    event: str, new: Callable[..., Any], engine: str | FSDPEngine | None
) -> Iterator[Callable[..., Any]]:
    with patched(resolve_engine(engine).patch_target(event), new) as call_next:
        yield call_next


def patch_unshard(
    new_unshard: Callable[..., Any], *, engine: str | FSDPEngine | None = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replaces the engine's unshard transition for the calling rank.

    The replacement receives the engine's arguments unchanged; forward ``*args, **kwargs``:
    ``fsdp_core``: ``(unit: FSDPUnit, reason)``; ``torch_fsdp2``: ``(param_group, async_op)``;
    ``torch_fsdp1``: ``(state, handle, unshard_stream, pre_unshard_stream)`` (FSDP1's
    ``summon_full_params`` imports ``_unshard`` by name and is not reached).

    Args:
        new_unshard: the replacement.
        engine: an engine or its name (default: the current engine).

    Returns:
        a context manager yielding the next implementation down.
    """
    return _patch_unit("unshard", new_unshard, engine)


def patch_reshard(
    new_reshard: Callable[..., Any], *, engine: str | FSDPEngine | None = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replaces the engine's reshard transition for the calling rank.

    Arguments as received: ``fsdp_core``: ``(unit, reason)``; ``torch_fsdp2``:
    ``(param_group,)``; ``torch_fsdp1``: ``(state, handle, free_unsharded_flat_param)``.

    Args:
        new_reshard: the replacement.
        engine: an engine or its name (default: the current engine).

    Returns:
        a context manager yielding the next implementation down.
    """
    return _patch_unit("reshard", new_reshard, engine)


def patch_post_backward(
    new_post_backward: Callable[..., Any], *, engine: str | FSDPEngine | None = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replaces the engine's post-backward step (reshard and reduce one unit's gradients).

    Arguments as received: ``fsdp_core``: ``(unit,)``; ``torch_fsdp2``: ``(param_group,
    *unused)``; ``torch_fsdp1``: ``(state, handle, flat_param, *unused)``. FSDP1 binds its hook
    (``functools.partial(_post_backward_hook, ...)``) at a model's first forward: enter the
    block before that forward, or the model keeps calling what was installed then.

    Args:
        new_post_backward: the replacement.
        engine: an engine or its name (default: the current engine).

    Returns:
        a context manager yielding the next implementation down.
    """
    return _patch_unit("post_backward", new_post_backward, engine)


def patch_register_post_backward_hook_backward(
    new_backward: Callable[..., Any], *, engine: str | FSDPEngine | None = None
) -> contextlib.AbstractContextManager[Callable[..., Any]]:
    """Replaces the backward of the autograd function around which an engine runs its
    post-backward (FSDP2's ``RegisterPostBackwardFunction.backward(ctx, *grads)``).

    Only engines that have such a function support this (``torch_fsdp2``); the others raise
    NotImplementedError, and :func:`patch_post_backward` reaches the same point in them.

    Args:
        new_backward: the replacement, called as ``new_backward(ctx, *grads)``.
        engine: an engine or its name (default: the current engine).

    Returns:
        a context manager yielding the next implementation down.
    """
    resolved = resolve_engine(engine)
    try:
        target = resolved.patch_target("register_post_backward_hook_backward")
    except ValueError as error:
        raise NotImplementedError(
            f"patch_register_post_backward_hook_backward: engine {resolved.name!r} runs its "
            "post-backward without an autograd function; use patch_post_backward(...) for it, "
            "or select engine 'torch_fsdp2'"
        ) from error
    return patched(target, new_backward)
