"""``RuntimeConfig``: the options of one FSDP instance, resolved by its front door, that the
runtime (``_runtime``) acts on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .api import BackwardPrefetch

__all__ = ["RuntimeConfig"]


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The options of one FSDP instance that the runtime acts on, resolved by its front door.

    Args:
        reshard_after_forward: free the unsharded parameters after forward (``True``), keep
            them for backward (``False``), or keep a copy sharded over groups of that many
            ranks (an int; see [Note: reshard after forward to a smaller world] in
            ``_post_forward``).
        reshard_root_after_forward: whether the root honours ``reshard_after_forward``; the
            root's parameters are the first that backward needs, so both doors keep them by
            default.
        backward_prefetch: when backward gathers the next unit in graph order, or ``None``
            (no automatic backward prefetch).
        forward_prefetch: gather the next unit in forward order when a forward starts.
        limit_all_gathers: skip a prefetch while two non-root units are unsharded.
        buffer_dtype: the dtype floating-point buffers are cast to for compute, or ``None``.
        input_dtype: the dtype this instance casts floating-point forward inputs to, or
            ``None``.
        root_input_dtype: the same, when this instance is the root.
        output_dtype: the dtype floating-point forward outputs are cast to, or ``None``.
        api: the door that made the instance, for messages and door-specific behaviour:
            ``"FullyShardedDataParallel"`` (default), ``"fully_shard"`` or ``"replicate"``.
        cast_inputs_always: cast inputs to ``input_dtype`` also when the unit's parameters
            keep their dtype (FSDP2; the wrapper treats such a policy as a no-op, see [Note:
            mixed precision]).
    """

    reshard_after_forward: bool | int = True
    reshard_root_after_forward: bool = False
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    buffer_dtype: torch.dtype | None = None
    input_dtype: torch.dtype | None = None
    root_input_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs_always: bool = False
    api: str = "FullyShardedDataParallel"
