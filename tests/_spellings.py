"""The single-tensor all-gather and reduce-scatter under the newest name this torch has.

torch 2.13 added ``all_gather_single`` and ``reduce_scatter_single``; older torch (2.11 on a GPU
machine, say) has ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` as their newest
names. fsdp_core and the patch helpers call and patch the newest one; a test that names it, or
calls it directly, reads it here. The callables look the name up on every call, so a test's
patch of ``torch.distributed`` is the function they reach.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fsdp_testing.collectives import Form, spellings

__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "all_gather_single", "reduce_scatter_single"]


def _newest(family: str) -> str:
    return next(s.name for s in spellings(family, [Form.TENSOR]) if hasattr(dist, s.name))


#: ``"all_gather_single"`` on torch 2.13 and later, ``"all_gather_into_tensor"`` before.
ALL_GATHER = _newest("all_gather")
#: ``"reduce_scatter_single"`` on torch 2.13 and later, ``"reduce_scatter_tensor"`` before.
REDUCE_SCATTER = _newest("reduce_scatter")


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """``dist.<ALL_GATHER>(*args, **kwargs)``, looked up now."""
    return getattr(dist, ALL_GATHER)(*args, **kwargs)


def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    """``dist.<REDUCE_SCATTER>(*args, **kwargs)``, looked up now."""
    return getattr(dist, REDUCE_SCATTER)(*args, **kwargs)
