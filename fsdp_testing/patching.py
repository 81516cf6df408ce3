"""Context managers that swap a collective or a unit transition for a test's own function.

The names and signatures follow ``torch.testing._internal.common_fsdp`` so that a migrated test
only changes its import; the behaviour differs where torch's would be wrong or narrow:

- every engine: the unit transitions are found through
  :meth:`~fsdp_testing.engines.FSDPEngine.patch_target` (pass ``engine=``, default the current
  engine), so ``patch_unshard`` reaches ``fsdp_core``'s ``FSDPUnit.unshard``, FSDP1's
  ``_runtime_utils._unshard`` or FSDP2's ``FSDPParamGroup.unshard``;
- both torch spellings of a collective: ``patch_all_gather`` replaces ``all_gather_single`` and
  ``all_gather_into_tensor`` (whichever exist, and the list form FSDP1 uses on CPU),
  ``patch_reduce_scatter`` replaces ``reduce_scatter_single`` and ``reduce_scatter_tensor``; see
  [Note: collective calling convention] and [Note: list all-gather];
- thread ranks: see [Note: patching under thread ranks].

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

[Note: collective calling convention]
torch spells the same collective twice (``all_gather_into_tensor`` is a deprecated alias of
``all_gather_single``; likewise ``reduce_scatter_tensor``) and callers mix positional and keyword
arguments (FSDP2 passes ``output=``/``input=`` by keyword). A replacement given to
:func:`patch_all_gather` or :func:`patch_reduce_scatter` is always called the same way, whichever
name the engine used: output and input positionally, everything else by keyword::

    new_all_gather(output_tensor, input_tensor, *, group=..., async_op=...)
    new_reduce_scatter(output, input, *, op=..., group=..., async_op=...)

Only the keywords the caller passed are forwarded. The originals of both names accept that call.

[Note: list all-gather]
On CPU, torch's FSDP1 all-gathers with the list form ``dist.all_gather(tensor_list, tensor)``,
where ``tensor_list`` is ``torch.chunk`` of one flat buffer. :func:`patch_all_gather` replaces
``dist.all_gather`` too: a call whose list is consecutive equal 1D slices of one buffer reaches
the replacement as the single-tensor call on that buffer (the same collective, so the replacement
may run ``dist.all_gather_single`` on it); any other list all-gather (a test's own
``dist.all_gather`` of unrelated tensors) bypasses the replacement.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .engines import FSDPEngine, PatchTarget, current_engine, get_engine

__all__ = [
    "COLLECTIVE_FAMILIES",
    "called_name",
    "collective_targets",
    "current_full_precision_param_dtype",
    "current_rank",
    "normalized_collective",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_post_backward",
    "patch_reduce_scatter",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
    "patched",
    "reduce_scatter_with_assert",
    "resolve_engine",
]

#: torch.distributed names that are one collective, by family: the single-tensor spellings
#: (new, old) and, for all-gather, the list form that FSDP1 uses on CPU. Read-only. See [Note:
#: collective calling convention] and [Note: list all-gather].
COLLECTIVE_FAMILIES: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {
        "all_gather": ("all_gather_single", "all_gather_into_tensor", "all_gather"),
        "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    }
)
_OUTPUT_NAMES = ("output_tensor", "output", "tensor_list")
_INPUT_NAMES = ("input_tensor", "input", "tensor")

_MISSING = object()
_lock = threading.RLock()
_local = threading.local()


def current_rank() -> int:
    """The calling rank's global rank (per thread under thread ranks), or -1 outside a process
    group: the key under which patches and records are kept per rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return -1


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
        raise AssertionError(f"{_rank_tag()}{owner!r}.{attribute} was called before being patched")

    return missing


def _rank_tag() -> str:
    rank = current_rank()
    return f"[rank {rank}] " if rank >= 0 else ""


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


def collective_targets(family: str) -> list[PatchTarget]:
    """The ``torch.distributed`` names of one collective that this torch has, as patch targets
    for :func:`patched` (which replaces them all with one chain of replacements).

    Args:
        family: a key of :data:`COLLECTIVE_FAMILIES` (``"all_gather"`` or
            ``"reduce_scatter"``).

    Raises:
        ValueError: for another name.
    """
    if family not in COLLECTIVE_FAMILIES:
        known = ", ".join(sorted(COLLECTIVE_FAMILIES))
        raise ValueError(f"collective_targets: unknown family {family!r}; one of {known}")
    return [PatchTarget(dist, n) for n in COLLECTIVE_FAMILIES[family] if hasattr(dist, n)]


@contextlib.contextmanager
def patched(
    target: PatchTarget | Sequence[PatchTarget],
    replacement: Callable[..., Any],
    *,
    barrier: bool = True,
) -> Iterator[Callable[..., Any]]:
    """Within the block, this rank's calls of ``target`` run ``replacement`` instead.

    The building block of every helper in this module, safe with thread ranks (see [Note:
    patching under thread ranks]) and nestable (see [Note: chained patches]).

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


def normalized_collective(new: Callable[..., Any], family: str) -> Callable[..., Any]:
    """Wraps ``new`` so that it accepts every spelling of collective ``family`` and is always
    called as ``new(output, input, **rest)`` (see [Note: collective calling convention]); a list
    all-gather of one buffer's chunks reaches it as the single-tensor call, any other list
    all-gather goes to the next implementation down (see [Note: list all-gather]).

    Use it with :func:`patched` and :func:`collective_targets`, as :func:`patch_all_gather`
    does, to see calls under one convention whichever name the engine used.

    Args:
        new: the function to call.
        family: a key of :data:`COLLECTIVE_FAMILIES`.
    """
    c10d = dist.distributed_c10d
    reference = next(getattr(c10d, n) for n in COLLECTIVE_FAMILIES[family] if hasattr(c10d, n))
    trailing = list(inspect.signature(reference).parameters)[2:]  # (op,) group, async_op

    def call(*args: Any, **kwargs: Any) -> Any:
        positional = list(args)
        rest = dict(kwargs)
        output = positional.pop(0) if positional else _pop_any(rest, _OUTPUT_NAMES)
        input_ = positional.pop(0) if positional else _pop_any(rest, _INPUT_NAMES)
        if isinstance(output, list | tuple):
            flat = _flat_view(output)
            if flat is None:
                # Not one buffer in chunks: the next implementation down handles it as is.
                return getattr(dist, called_name("all_gather"))(*args, **kwargs)
            output = flat
        if positional:
            rest = {**dict(zip(trailing, positional, strict=False)), **rest}
        return new(output, input_, **rest)

    return call


def _pop_any(kwargs: dict[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs.pop(name)
    raise TypeError(f"collective called without any of the arguments {', '.join(names)}")


def _flat_view(chunks: Sequence[Any]) -> torch.Tensor | None:
    """The 1D tensor of which ``chunks`` are consecutive equal slices, if there is one."""
    if not chunks or not all(isinstance(c, torch.Tensor) for c in chunks):
        return None
    first = chunks[0]
    numel = first.numel()
    for index, chunk in enumerate(chunks):
        if (
            chunk.dim() != 1
            or not chunk.is_contiguous()
            or chunk.numel() != numel
            or chunk.dtype != first.dtype
            or chunk.device != first.device
            or chunk.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or chunk.storage_offset() != first.storage_offset() + index * numel
        ):
            return None
    return first.as_strided((numel * len(chunks),), (1,), first.storage_offset())


@contextlib.contextmanager
def _patch_collective(family: str, new: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    targets = collective_targets(family)
    if not targets:
        raise NotImplementedError(
            f"torch {torch.__version__} has none of torch.distributed."
            f"{' / '.join(COLLECTIVE_FAMILIES[family])}"
        )
    with patched(targets, normalized_collective(new, family)) as call_next:
        yield call_next


@contextlib.contextmanager
def patch_all_gather(new_all_gather: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replaces ``dist.all_gather_single`` and ``dist.all_gather_into_tensor`` (whichever this
    torch has), and FSDP-style calls of ``dist.all_gather`` (see [Note: list all-gather]), for
    the calling rank.

    ``new_all_gather`` is called as ``new_all_gather(output_tensor, input_tensor, **kwargs)``
    whichever name the engine used (see [Note: collective calling convention]); to run the real
    collective, call ``dist.all_gather_single`` captured before entering, or the yielded callable.

    Args:
        new_all_gather: the replacement.

    Yields:
        the next implementation down (see [Note: chained patches]).
    """
    with _patch_collective("all_gather", new_all_gather) as call_next:
        yield call_next


# Per rank: the stack of ``full_precision_param_dtype`` values of the active
# ``patch_reduce_scatter`` blocks.
_full_precision_dtypes: dict[int, list[torch.dtype | None]] = {}


@contextlib.contextmanager
def patch_reduce_scatter(
    new_reduce_scatter: Callable[..., Any],
    full_precision_param_dtype: torch.dtype | None = None,
) -> Iterator[Callable[..., Any]]:
    """Replaces ``dist.reduce_scatter_single`` and ``dist.reduce_scatter_tensor`` (whichever
    this torch has) for the calling rank.

    ``new_reduce_scatter`` is called as ``new_reduce_scatter(output, input, **kwargs)`` whichever
    name and argument style the engine used (see [Note: collective calling convention]).

    Args:
        new_reduce_scatter: the replacement.
        full_precision_param_dtype: the parameters' dtype without mixed precision, for mixed
            precision checks inside the replacement; read it with
            :func:`current_full_precision_param_dtype` (default None).

    Yields:
        the next implementation down (see [Note: chained patches]).
    """
    rank = current_rank()
    with _lock:
        _full_precision_dtypes.setdefault(rank, []).append(full_precision_param_dtype)
    try:
        with _patch_collective("reduce_scatter", new_reduce_scatter) as call_next:
            yield call_next
    finally:
        with _lock:
            stack = _full_precision_dtypes[rank]
            stack.pop()
            if not stack:
                del _full_precision_dtypes[rank]


def current_full_precision_param_dtype() -> torch.dtype | None:
    """The ``full_precision_param_dtype`` of this rank's innermost :func:`patch_reduce_scatter`,
    or None outside one."""
    stack = _full_precision_dtypes.get(current_rank())
    return stack[-1] if stack else None


@contextlib.contextmanager
def patch_all_reduce(new_all_reduce: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replaces ``dist.all_reduce`` for the calling rank; ``new_all_reduce`` receives the
    caller's arguments unchanged.

    Args:
        new_all_reduce: the replacement.

    Yields:
        the next implementation down (see [Note: chained patches]).
    """
    with patched(PatchTarget(dist, "all_reduce"), new_all_reduce) as call_next:
        yield call_next


def resolve_engine(engine: str | FSDPEngine | None) -> FSDPEngine:
    """The engine that an ``engine=`` argument names: None means
    :func:`~fsdp_testing.engines.current_engine`, a string a registered engine's name.

    Args:
        engine: an engine, its registered name, or None.
    """
    if engine is None:
        return current_engine()
    return get_engine(engine) if isinstance(engine, str) else engine


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


def reduce_scatter_with_assert(
    cls: object,
    orig_reduce_scatter: Callable[..., Any],
    assert_fn: Callable[[torch.Tensor], Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Calls ``assert_fn(output)`` on the reduce-scatter output tensor, then the collective.

    Meant for ``patch_reduce_scatter(functools.partial(reduce_scatter_with_assert, self,
    orig_reduce_scatter, assert_fn))``; the output is the first positional argument or the
    ``output``/``output_tensor`` keyword.

    Args:
        cls: the calling test case (unused; kept for torch's signature).
        orig_reduce_scatter: the real collective, e.g. ``dist.reduce_scatter_single``.
        assert_fn: raises if the output tensor is not as expected.
        args: the collective's positional arguments.
        kwargs: the collective's keyword arguments.
    """
    if args:
        output = args[0]
    elif "output" in kwargs or "output_tensor" in kwargs:
        output = kwargs.get("output", kwargs.get("output_tensor"))
    else:
        raise AssertionError(
            f"{_rank_tag()}reduce_scatter_with_assert: no output tensor among the arguments "
            f"(positional: {len(args)}, keywords: {sorted(kwargs)})"
        )
    assert_fn(output)
    return orig_reduce_scatter(*args, **kwargs)
