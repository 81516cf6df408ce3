"""The machinery under every patch: replacing a function reachable under one or more names,
per rank and nestable, safe with thread ranks.

[Note: patching under thread ranks]
With thread ranks every rank shares one ``torch.distributed`` module and one ``FSDPParamGroup``
class. torch's helpers assign the attribute on entry and restore it on exit from every rank, so
the last rank to enter wins (each rank's calls go to *that* rank's closure) and the first rank to
leave restores the original under the others. Here the attribute is replaced once per process by
a dispatcher (reference counted: the first entry installs it, the last exit restores the
original) and each rank registers its replacement with the dispatcher, which calls the
replacement of the calling rank (``dist.get_rank()``; ranks outside any patch run the original).
Barriers keep the ranks in step, as torch's do: one before the dispatcher is installed (a rank
that captures ``orig = dist.all_gather_single`` just before entering gets the real function) and
one after (every rank is inside before any uses the patch); on exit one before the last
replacement is removed (no rank leaves while another still runs patched code) and one after
(every rank sees the original again once its block ends).

[Note: chained patches]
Patches nest: per rank, the innermost ``with`` block's replacement runs first. A call to the
patched name made *from inside* a replacement (the usual ``orig = dist.all_gather_single``
captured before entering, called from the new function) runs the next replacement down, and
finally the original, instead of recursing into itself. This is how :mod:`fsdp_testing.recording`
and a test's own patch see the same calls. The context managers also yield that "next"
callable, so a replacement need not capture anything.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from ..engines import PatchTarget

__all__ = ["called_name", "current_rank", "patched", "rank_prefix"]

_MISSING = object()
_lock = threading.RLock()
_local = threading.local()


def current_rank() -> int:
    """The calling rank's global rank (per thread under thread ranks), or -1 outside a process
    group: the key under which patches and records are kept per rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return -1


def rank_prefix(rank: int | None = None) -> str:
    """``"[rank N] "``, the prefix of every internal assertion message, for ``rank`` (default:
    the calling rank); empty outside a process group.

    Args:
        rank: the rank to name (default: :func:`current_rank`).
    """
    rank = current_rank() if rank is None else rank
    return f"[rank {rank}] " if rank >= 0 else ""


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _no_barrier() -> None:
    pass


def _levels() -> dict[int, int]:
    levels = getattr(_local, "levels", None)
    if levels is None:
        levels = _local.levels = {}
    return levels


class _Binding:
    """One name (``owner.attribute``) under which a patched function is reachable."""

    def __init__(self, family: _Family, owner: Any, attribute: str) -> None:
        self.owner = owner
        self.attribute = attribute
        self.own = False  # whether ``owner`` itself (not a base class) held the attribute
        self.raw: Any = _MISSING  # the attribute as stored (function, staticmethod, ...)
        self.original: Callable[..., Any] = _unavailable(owner, attribute)
        self.installed: Any = _MISSING

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return family.call(self, None, args, kwargs)

        self.dispatch = dispatch

    def install(self) -> None:
        current = self.owner.__dict__.get(self.attribute, _MISSING)
        if current is not _MISSING and current is self.installed:
            return  # still in place from an earlier patch (see _Family.release)
        self.own = current is not _MISSING
        self.raw = current if self.own else inspect.getattr_static(self.owner, self.attribute)
        # Keep the descriptor kind, so a staticmethod (an autograd.Function's backward) or a
        # classmethod receives the same arguments from the dispatcher as it did before.
        if isinstance(self.raw, staticmethod | classmethod):
            self.original = self.raw.__func__
            installed: Any = type(self.raw)(self.dispatch)
        else:
            self.original = self.raw
            installed = self.dispatch
        functools.update_wrapper(self.dispatch, self.original)
        self.installed = installed
        setattr(self.owner, self.attribute, installed)

    def restore(self) -> None:
        if self.owner.__dict__.get(self.attribute, _MISSING) is not self.installed:
            # Someone patched on top of us; their exit puts our dispatcher back, which then
            # passes every call through to the original.
            return
        if self.own:
            setattr(self.owner, self.attribute, self.raw)
        else:
            delattr(self.owner, self.attribute)
        self.installed = _MISSING


def _unavailable(owner: Any, attribute: str) -> Callable[..., Any]:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            f"{rank_prefix()}{owner!r}.{attribute} was called before being patched"
        )

    return missing


class _Family:
    """A function reachable under one or more names, with each rank's stack of replacements.

    See [Note: patching under thread ranks] and [Note: chained patches].
    """

    def __init__(self, targets: Sequence[PatchTarget]) -> None:
        self.bindings = [_Binding(self, t.owner, t.attribute) for t in targets]
        self.stacks: dict[int, list[Callable[..., Any]]] = {}
        self.users = 0

    def acquire(self, rank: int, replacement: Callable[..., Any]) -> None:
        with _lock:
            if self.users == 0:
                for binding in self.bindings:
                    binding.install()
            self.users += 1
            self.stacks.setdefault(rank, []).append(replacement)

    def release(self, rank: int, replacement: Callable[..., Any]) -> None:
        with _lock:
            stack = self.stacks.get(rank, [])
            for index in range(len(stack) - 1, -1, -1):
                if stack[index] is replacement:
                    del stack[index]
                    break
            if not stack:
                self.stacks.pop(rank, None)
            self.users -= 1
            if self.users == 0:
                for binding in self.bindings:
                    binding.restore()

    def call(
        self, binding: _Binding, below: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        stack = self.stacks.get(current_rank(), ())
        levels = _levels()
        key = id(self)
        outer = levels.get(key)
        if below is not None:
            level = below
        elif outer is not None:
            level = outer
        else:
            level = len(stack)
        level = min(level, len(stack))
        if level == 0:
            # The original runs as a fresh call: anything it calls starts from the top again.
            levels.pop(key, None)
            try:
                return binding.original(*args, **kwargs)
            finally:
                if outer is not None:
                    levels[key] = outer
        levels[key] = level - 1
        if below is None:
            _local.called = binding.attribute
        try:
            return stack[level - 1](*args, **kwargs)
        finally:
            if outer is None:
                levels.pop(key, None)
            else:
                levels[key] = outer

    def next_below(self, replacement: Callable[..., Any]) -> Callable[..., Any]:
        """A callable that runs whatever comes after ``replacement`` for the calling rank."""

        def call_next(*args: Any, **kwargs: Any) -> Any:
            stack = self.stacks.get(current_rank(), [])
            index = next((i for i, r in enumerate(stack) if r is replacement), 0)
            return self.call(self.bindings[0], index, args, kwargs)

        return call_next


_families: dict[tuple[tuple[int, str], ...], _Family] = {}


def called_name(default: str) -> str:
    """The name through which the running replacement was called (for twins such as
    ``all_gather_single``/``all_gather_into_tensor``); read it first thing in a replacement."""
    return str(getattr(_local, "called", default))


def _family(targets: Sequence[PatchTarget]) -> _Family:
    key = tuple((id(t.owner), t.attribute) for t in targets)
    with _lock:
        family = _families.get(key)
        if family is None:
            family = _families[key] = _Family(targets)
    return family


@contextlib.contextmanager
def patched(
    target: PatchTarget | Sequence[PatchTarget],
    replacement: Callable[..., Any],
    *,
    barrier: bool = True,
) -> Iterator[Callable[..., Any]]:
    """Within the block, this rank's calls of ``target`` run ``replacement`` instead.

    The building block of every helper in :mod:`fsdp_testing.patching`, safe with thread ranks
    (see [Note: patching under thread ranks]) and nestable (see [Note: chained patches]).

    Args:
        target: where the callable lives, e.g. ``PatchTarget(dist, "all_reduce")`` or
            ``engine.patch_target("reshard")``; or several names of one function (all of them
            are replaced, and share one chain of replacements).
        replacement: called with exactly the arguments of the original (for a method: the
            instance first).
        barrier: synchronize all ranks of the default group on entry and exit (default True);
            pass False where not every rank enters the block.

    Yields:
        a callable that runs the next implementation below ``replacement`` (an outer patch, or
        the original) for the calling rank.
    """
    family = _family([target] if isinstance(target, PatchTarget) else list(target))
    rank = current_rank()
    sync = _barrier if barrier else _no_barrier
    # See [Note: patching under thread ranks]: before and after installing, so that no rank
    # sees the dispatcher before entering, and none sees it after leaving.
    sync()
    family.acquire(rank, replacement)
    try:
        sync()
        yield family.next_below(replacement)
    finally:
        try:
            sync()
        finally:
            family.release(rank, replacement)
        sync()
