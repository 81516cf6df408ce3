"""Patching collectives: every ``torch.distributed`` spelling of a collective family, under one
calling convention, for the calling rank.

The names of each family come from the one table, :mod:`fsdp_testing.collectives`.

[Note: collective calling convention]
torch spells the same collective several ways (``all_gather_into_tensor`` and
``_all_gather_base`` are deprecated aliases of ``all_gather_single``; likewise for
reduce-scatter) and callers mix positional and keyword arguments (FSDP2 passes
``output=``/``input=`` by keyword). A replacement given to :func:`patch_all_gather` or
:func:`patch_reduce_scatter` is always called the same way, whichever name the engine used:
output and input positionally, everything else by keyword::

    new_all_gather(output_tensor, input_tensor, *, group=..., async_op=...)
    new_reduce_scatter(output, input, *, op=..., group=..., async_op=...)

Only the keywords the caller passed are forwarded. The originals of every name accept that call.

[Note: replacements run synchronously]
A replacement is called with ``async_op=False`` even when the engine asked for ``async_op=True``
(fsdp_core does on the CPU over gloo, see [Note: overlap on the CPU] in ``fsdp_core/_overlap.py``;
FSDP2 for ``unshard(async_op=True)``), and the engine gets ``None``, a complete collective, back.
So what a replacement does after calling the next implementation down (round the output, check
it, count bytes) sees the finished result, as it would on a synchronous call; the collectives it
replaces just do not overlap with compute while it is installed.

[Note: list collectives]
On CPU, torch's FSDP1 all-gathers with the list form ``dist.all_gather(tensor_list, tensor)``,
where ``tensor_list`` is ``torch.chunk`` of one flat buffer. :func:`patch_all_gather` replaces
``dist.all_gather`` too (and :func:`patch_reduce_scatter` the list form ``dist.reduce_scatter``):
a call whose list is consecutive equal 1D slices of one buffer reaches the replacement as the
single-tensor call on that buffer (the same collective, so the replacement may run
``dist.all_gather_single`` on it); any other list collective (a test's own ``dist.all_gather`` of
unrelated tensors) bypasses the replacement.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import COLLECTIVE_FAMILIES, Form, spellings
from ..engines import PatchTarget
from ._dispatch import called_name, current_rank, patched, rank_prefix

__all__ = [
    "collective_targets",
    "current_full_precision_param_dtype",
    "normalized_collective",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_reduce_scatter",
    "reduce_scatter_with_assert",
]

_OUTPUT_NAMES = ("output_tensor", "output", "tensor_list", "output_tensor_list")
_INPUT_NAMES = ("input_tensor", "input", "tensor", "input_list", "input_tensor_list")
#: Spellings that move tensors (a patch of a family replaces these; objects and barriers aside).
_TENSOR_FORMS = (Form.TENSOR, Form.LIST, Form.INPLACE)


def collective_targets(family: str) -> list[PatchTarget]:
    """The ``torch.distributed`` functions of one collective family that move tensors and that
    this torch has (the family's spellings in :mod:`fsdp_testing.collectives`), as patch targets
    for :func:`~fsdp_testing.patching.patched`, which replaces them all with one chain of
    replacements.

    Args:
        family: a key of :data:`~fsdp_testing.collectives.COLLECTIVE_FAMILIES`, e.g.
            ``"all_gather"`` (``all_gather_single``, ``all_gather_into_tensor``,
            ``_all_gather_base`` and the list form ``all_gather``) or ``"reduce_scatter"``.

    Raises:
        ValueError: ``family`` is not in the table; the message lists the families.
    """
    if family not in COLLECTIVE_FAMILIES:
        known = ", ".join(COLLECTIVE_FAMILIES)
        raise ValueError(f"collective_targets: unknown family {family!r}; one of {known}")
    return [
        PatchTarget(dist, s.name) for s in spellings(family, _TENSOR_FORMS) if hasattr(dist, s.name)
    ]


def normalized_collective(new: Callable[..., Any], family: str) -> Callable[..., Any]:
    """Wraps ``new`` so that it accepts every spelling of collective ``family`` and is always
    called as ``new(output, input, **rest)`` (see [Note: collective calling convention]); a list
    call on one buffer's chunks reaches it as the single-tensor call, any other list call goes
    to the next implementation down (see [Note: list collectives]).

    Use it with :func:`~fsdp_testing.patching.patched` and :func:`collective_targets`, as
    :func:`patch_all_gather` does, to see calls under one convention whichever name the engine
    used.

    Args:
        new: the function to call.
        family: a family with an ``(output, input)`` form: ``"all_gather"``,
            ``"reduce_scatter"`` or ``"all_to_all"``.

    Raises:
        ValueError: ``family`` has no ``(output, input)`` form.
    """
    c10d = dist.distributed_c10d
    single = [s.name for s in spellings(family, [Form.TENSOR]) if hasattr(c10d, s.name)]
    if not single:
        raise ValueError(
            f"normalized_collective: family {family!r} has no (output, input) spelling in this "
            "torch; use all_gather, reduce_scatter or all_to_all, or patch the function as is"
        )
    trailing = list(inspect.signature(getattr(c10d, single[0])).parameters)[2:]
    lists = [s.name for s in spellings(family, [Form.LIST])]
    list_name = lists[0] if lists else single[0]

    def call(*args: Any, **kwargs: Any) -> Any:
        positional = list(args)
        rest = dict(kwargs)
        output = positional.pop(0) if positional else _pop_any(rest, _OUTPUT_NAMES)
        input_ = positional.pop(0) if positional else _pop_any(rest, _INPUT_NAMES)
        if isinstance(output, list | tuple) or isinstance(input_, list | tuple):
            output, input_ = _flat_view(output), _flat_view(input_)
            if output is None or input_ is None:
                # Not one buffer in chunks: the next implementation down handles it as is.
                return getattr(dist, called_name(list_name))(*args, **kwargs)
        if positional:
            rest = {**dict(zip(trailing, positional, strict=False)), **rest}
        if rest.get("async_op"):  # see [Note: replacements run synchronously]
            new(output, input_, **{**rest, "async_op": False})
            return None
        return new(output, input_, **rest)

    return call


def _pop_any(kwargs: dict[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs.pop(name)
    raise TypeError(f"collective called without any of the arguments {', '.join(names)}")


def _flat_view(value: Any) -> torch.Tensor | None:
    """``value`` if a tensor; if a list, the 1D tensor of which its items are consecutive equal
    slices, if there is one."""
    if isinstance(value, torch.Tensor):
        return value
    chunks: Sequence[Any] = value
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
    """Replaces every all-gather spelling this torch has (``dist.all_gather_single``,
    ``dist.all_gather_into_tensor``, ``dist._all_gather_base``) and FSDP-style calls of
    ``dist.all_gather`` (see [Note: list collectives]), for the calling rank.

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
_dtypes_lock = threading.Lock()


@contextlib.contextmanager
def patch_reduce_scatter(
    new_reduce_scatter: Callable[..., Any],
    full_precision_param_dtype: torch.dtype | None = None,
) -> Iterator[Callable[..., Any]]:
    """Replaces every reduce-scatter spelling this torch has (``dist.reduce_scatter_single``,
    ``dist.reduce_scatter_tensor``, ``dist._reduce_scatter_base``) and FSDP-style calls of
    ``dist.reduce_scatter`` (see [Note: list collectives]) for the calling rank.

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
    with _dtypes_lock:
        _full_precision_dtypes.setdefault(rank, []).append(full_precision_param_dtype)
    try:
        with _patch_collective("reduce_scatter", new_reduce_scatter) as call_next:
            yield call_next
    finally:
        with _dtypes_lock:
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
            f"{rank_prefix()}reduce_scatter_with_assert: no output tensor among the arguments "
            f"(positional: {len(args)}, keywords: {sorted(kwargs)})"
        )
    assert_fn(output)
    return orig_reduce_scatter(*args, **kwargs)
