"""What an engine tells the recorder: :class:`Probe`, the default every engine module refines.

The recorder (:mod:`fsdp_testing.recording`) wraps an engine's unit transitions; what it cannot
see from the arguments of a call alone it asks the engine's probe (``engine.probe()``): which
unit the call is about, whether that unit is unsharded, where its parameters are, why the call
happened, and which events the engine publishes itself. What each engine's answers mean (exact
or inferred) is [Note: what is exact and what is inferred] in
:mod:`fsdp_testing.recording._probes`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch.nn as nn

__all__ = ["Probe", "infer_reason_from_torch_caller"]


class Probe:
    """The default probe: an engine the recorder knows nothing about. Every call of a
    transition is recorded, with reason ``"explicit"``; no events, no offload copies."""

    #: The engine publishes its own unshard/reshard/collective events through :meth:`subscribe`,
    #: so nothing is inferred from the transitions' arguments.
    exact = False

    @property
    def reports_offload_copies(self) -> bool:
        """Whether the engine publishes its offload copies (``OffloadCopy`` events)."""
        return False

    def subscribe(self, callback: Callable[[Any], None]) -> contextlib.AbstractContextManager[Any]:
        """Within the block, ``callback`` receives each event the engine publishes."""
        return contextlib.nullcontext()

    def unit(self, args: tuple[Any, ...]) -> Any:
        """The unit a transition was called for, from the call's positional arguments."""
        return args[0] if args else None

    def unsharded(self, unit: Any) -> bool | None:
        """Whether ``unit`` holds its unsharded parameters (None: cannot tell)."""
        return None

    def devices(self, unit: Any, *, sharded: bool) -> tuple[str, ...]:
        """The devices of ``unit``'s sharded or unsharded parameters."""
        return ()

    def offload(self, unit: Any) -> bool | None:
        """Whether the engine offloads ``unit``'s parameters (None: not reported)."""
        return None

    def modules(self, unit: Any) -> tuple[nn.Module, ...]:
        """The modules whose parameters ``unit`` manages (to name it by FQN)."""
        return ()

    def fallback_name(self, unit: Any) -> str:
        """A name for ``unit`` when none of its modules is in the recorded model."""
        return f"{type(unit).__name__}@{id(unit):x}"

    def reason(self, kind: str, args: tuple[Any, ...]) -> str:
        """Why the transition ``kind`` (``"unshard"``/``"reshard"``) running now, called with
        positional ``args``, was called: forward, forward_prefetch, backward,
        backward_prefetch or explicit."""
        return "explicit"


@functools.cache
def _torch_fsdp_dir() -> str:
    import torch.distributed.fsdp

    return os.path.dirname(os.path.abspath(torch.distributed.fsdp.__file__))


def _torch_fsdp_caller(depth: int = 40) -> FrameType | None:
    """The nearest calling frame that belongs to torch's FSDP packages."""
    prefix = _torch_fsdp_dir()
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_filename.startswith(prefix):
            return frame
        frame = frame.f_back
    return None


def infer_reason_from_torch_caller(kind: str, table: Mapping[str, str], prefetch_local: str) -> str:
    """The reason of a torch FSDP transition, from the FSDP function that called it.

    Args:
        kind: ``"unshard"`` or ``"reshard"``.
        table: FSDP function name to reason, e.g. ``{"pre_forward": "forward"}``.
        prefetch_local: the local variable of the prefetch function that holds the pass
            (FSDP1 ``prefetch_mode``, FSDP2 ``pass_type``); a prefetching unshard is
            ``forward_prefetch`` or ``backward_prefetch`` by its value.

    Returns:
        the reason; ``"explicit"`` when no known FSDP function called.
    """
    frame = _torch_fsdp_caller()
    if frame is None:
        return "explicit"
    name = frame.f_code.co_name
    if kind == "unshard" and name in ("_prefetch_handle", "_prefetch_unshard"):
        mode = frame.f_locals.get(prefetch_local)
        mode_name = str(getattr(mode, "name", mode)).lower()
        return "forward_prefetch" if mode_name == "forward" else "backward_prefetch"
    return table.get(name, "explicit")
