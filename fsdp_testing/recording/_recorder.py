"""The recorder: :class:`FSDPRecorder` and :func:`record_fsdp`, which install a capture for the
block and keep what it records."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType

import torch.distributed as dist
import torch.nn as nn

from ..engines import FSDPEngine, engine_for, resolve_engine
from ..patching import current_rank
from ._assertions import RecordAssertions
from ._capture import Capture
from ._probes import UnitNames
from ._trace import write_chrome_trace

__all__ = ["FSDPRecorder", "record_comms", "record_fsdp"]


class FSDPRecorder(RecordAssertions):
    """Records, for the calling rank, every collective and unit transition inside the block.

    Use :func:`record_fsdp`. Every rank of the default group must enter and leave the block
    together (barriers, as for the patch helpers), unless ``barrier=False``.

    Args:
        model: the root module; when given, units are named by FQN for every engine and the
            sharded modules' forwards are recorded (for :meth:`assert_graph_order`).
        engine: the engine or its name (default: the one that sharded ``model``, else the
            current engine).
        barrier: synchronize the ranks on entry and exit (default True).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        engine: str | FSDPEngine | None = None,
        barrier: bool = True,
    ) -> None:
        super().__init__(current_rank())
        self.model = model
        if engine is None and model is not None:
            engine = engine_for(model)
        self.engine = resolve_engine(engine)
        self._barrier = barrier
        self._names = UnitNames()
        self._stack: contextlib.ExitStack | None = None
        self._capture: Capture | None = None

    def __enter__(self) -> FSDPRecorder:
        self.rank = current_rank()
        capture = Capture(
            self._add, self._amend, rank=self.rank, engine=self.engine, names=self._names
        )
        stack = contextlib.ExitStack()
        try:
            capture.install(stack, self.model)
            if self._barrier and dist.is_available() and dist.is_initialized():
                capture.muted = True  # the recorder's own barrier is not the code's
                dist.barrier()
                capture.muted = False
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        self._capture = capture
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        try:
            if self._barrier and exc is None and dist.is_available() and dist.is_initialized():
                if self._capture is not None:
                    self._capture.muted = True
                dist.barrier()
        finally:
            if stack is not None:
                stack.close()

    def export_chrome_trace(self, path: str | os.PathLike[str], *, all_ranks: bool = False) -> Path:
        """Writes a Chrome/Perfetto trace (JSON): one process per rank, one thread each for
        unit transitions, collectives and forwards; spans where a duration is known.

        Args:
            path: the file to write.
            all_ranks: gather every rank's records (a collective: every rank must call) and
                write them all from rank 0; other ranks write nothing (default False).

        Returns:
            the path.
        """
        return write_chrome_trace(self.records, path, all_ranks=all_ranks)


def record_comms(*, barrier: bool = True) -> FSDPRecorder:
    """Returns a recorder (a context manager) of every collective and point-to-point op the
    calling rank makes in the block, for code that is not an FSDP engine (a pipeline schedule,
    a tensor-parallel layer): :func:`record_fsdp` with no model.

    Args:
        barrier: synchronize the ranks of the default group on entry and exit (default True;
            pass False where not every rank enters the block).
    """
    return FSDPRecorder(barrier=barrier)


def record_fsdp(
    model: nn.Module | None = None,
    *,
    engine: str | FSDPEngine | None = None,
    barrier: bool = True,
) -> FSDPRecorder:
    """Returns an :class:`FSDPRecorder` to use as a context manager (see its arguments)."""
    return FSDPRecorder(model, engine=engine, barrier=barrier)
