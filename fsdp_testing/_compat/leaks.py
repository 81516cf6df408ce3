"""``common_utils.check_leaked_tensors``: the tensors a block of code leaves in reference cycles.

[Note: leaked tensors]
A reference cycle that holds a tensor keeps its memory until the cyclic garbage collector runs,
which in a training loop means steps later or never; torch's pipelining tests wrap their
schedule steps in ``check_leaked_tensors()`` and assert the list it yields is empty. Cycles that
hold no tensor are ignored (Python code has many benign ones). The block runs after full
collections until one finds nothing (freeing garbage runs finalizers and weakref callbacks,
which can drop the last references to more cycles: a suite's earlier tests left garbage that
took three collections to clear, and what a single one left was counted as the block's), under
``gc.DEBUG_SAVEALL``, so what the collection at its end finds unreachable is kept for
inspection instead of freed; the tensors among it are the leak. The saved objects are
released again when the block ends, so the check itself leaks nothing.

The collector is per process: ranks that share a process (thread and local mode) share it, so
a cycle made by one rank's block may be found by whichever rank's block ends first. The test
then fails on that rank, and a test passes only if every rank does.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["check_leaked_tensors"]

_lock = threading.Lock()
_active = 0  # blocks open in this process
_saved_debug = 0  # the collector's debug flags before the first of them


_MAX_COLLECTIONS = 20
"""Full collections before a block at most (see [Note: leaked tensors])."""


def _collect_all() -> None:
    """Collect until a collection finds nothing (``_MAX_COLLECTIONS`` at most)."""
    for _ in range(_MAX_COLLECTIONS):
        if gc.collect() == 0:
            return


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{type(obj).__name__}{list(obj.shape)} {obj.dtype} on {obj.device}"
    return type(obj).__name__


@contextlib.contextmanager
def check_leaked_tensors(
    limit: int = 1, matched_type: type[Any] = torch.Tensor
) -> Iterator[list[Any]]:
    """Yield a list that, when the block ends, holds the objects of ``matched_type`` the block
    left in reference cycles (see [Note: leaked tensors]); assert it is empty after the
    ``with``. A non-empty list also warns, naming the count and the first ``limit`` objects.

    Args:
        limit: how many leaked objects the warning describes (default 1).
        matched_type: the type counted as a leak (default ``torch.Tensor``).
    """
    global _active, _saved_debug
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(
            f"check_leaked_tensors(limit=...) takes how many leaked objects to describe, a "
            f"non-negative int; got {limit!r}"
        )
    if not isinstance(matched_type, type):
        raise TypeError(
            f"check_leaked_tensors(matched_type=...) takes a type such as torch.Tensor; got "
            f"{matched_type!r}"
        )
    _collect_all()
    with _lock:
        if _active == 0:
            _saved_debug = gc.get_debug()
            gc.set_debug(_saved_debug | gc.DEBUG_SAVEALL)
        _active += 1
        start = len(gc.garbage)  # what was there before (uncollectable objects) stays
    leaked: list[Any] = []
    try:
        yield leaked
        gc.collect()
        with _lock:
            garbage = gc.garbage[start:]
            del gc.garbage[start:]
        leaked.extend(obj for obj in garbage if isinstance(obj, matched_type))
        del garbage
        if leaked:
            shown = "; ".join(_describe(obj) for obj in leaked[:limit])
            warnings.warn(
                f"check_leaked_tensors: the block left {len(leaked)} {matched_type.__name__} "
                f"object(s) in reference cycles (first {min(limit, len(leaked))}: {shown}); "
                "find the cycle that holds them (gc.get_referrers) and break it",
                stacklevel=3,
            )
    finally:
        with _lock:
            del gc.garbage[start:]  # what a block that raised had saved
            _active -= 1
            if _active == 0:
                gc.set_debug(_saved_debug)
