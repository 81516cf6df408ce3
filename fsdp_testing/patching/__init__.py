"""Context managers that swap a collective or a unit transition for a test's own function.

The names and signatures follow ``torch.testing._internal.common_fsdp`` so that a migrated test
only changes its import; the behaviour differs where torch's would be wrong or narrow:

- every engine: the unit transitions are found through
  :meth:`~fsdp_testing.engines.FSDPEngine.patch_target` (pass ``engine=``, default the current
  engine), so ``patch_unshard`` reaches ``fsdp_core``'s ``FSDPUnit.unshard``, FSDP1's
  ``_runtime_utils._unshard`` or FSDP2's ``FSDPParamGroup.unshard``;
- every torch spelling of a collective (the table in :mod:`fsdp_testing.collectives`):
  ``patch_all_gather`` replaces ``all_gather_single``, ``all_gather_into_tensor`` and
  ``_all_gather_base`` (whichever exist, and the list form FSDP1 uses on CPU), likewise
  ``patch_reduce_scatter``; see [Note: collective calling convention] and [Note: list
  collectives] in ``_collectives``;
- thread ranks: see [Note: patching under thread ranks] in ``_dispatch``.

The package, by role: ``_dispatch`` (:func:`patched`, the per-rank, nestable replacement every
helper is built on), ``_collectives`` (the collective helpers), ``_transitions`` (the unit
transition helpers) and :mod:`~fsdp_testing.patching.delays` (sleeping before chosen calls).
"""

from ..collectives import COLLECTIVE_FAMILIES
from ..engines import resolve_engine
from ._collectives import (
    collective_targets,
    current_full_precision_param_dtype,
    normalized_collective,
    patch_all_gather,
    patch_all_reduce,
    patch_reduce_scatter,
    reduce_scatter_with_assert,
)
from ._dispatch import called_name, current_rank, patched, rank_prefix
from ._transitions import (
    patch_post_backward,
    patch_register_post_backward_hook_backward,
    patch_reshard,
    patch_unshard,
)
from .delays import delayed_calls, sleep_ms

__all__ = [
    "COLLECTIVE_FAMILIES",
    "called_name",
    "collective_targets",
    "current_full_precision_param_dtype",
    "current_rank",
    "delayed_calls",
    "normalized_collective",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_post_backward",
    "patch_reduce_scatter",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
    "patched",
    "rank_prefix",
    "reduce_scatter_with_assert",
    "resolve_engine",
    "sleep_ms",
]
