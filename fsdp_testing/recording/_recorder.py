"""The recorder: :class:`FSDPRecorder` and :func:`record_fsdp`, which install a capture for the
block and keep what it records."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ..engines import FSDPEngine, engine_for, resolve_engine
from ..patching import current_rank
from ._assertions import RecordAssertions
from ._capture import Capture
from ._phases import DTensorComms, MeshDims
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
        mesh: a ``DeviceMesh``: each record's group is named by the mesh dims it spans
            (``mesh_dims``; default None).
        dtensor: also count DTensor's collectives per module and phase, as torch's
            ``CommDebugMode`` does (:meth:`dtensor_comms`; default False: the mode sees every
            op of the block).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        engine: str | FSDPEngine | None = None,
        barrier: bool = True,
        mesh: Any = None,
        dtensor: bool = False,
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
        self._mesh = mesh
        self._dtensor = DTensorComms() if dtensor else None

    def __enter__(self) -> FSDPRecorder:
        self.rank = current_rank()
        capture = Capture(
            self._add, self._amend, rank=self.rank, engine=self.engine, names=self._names
        )
        capture.mesh = MeshDims(self._mesh)
        stack = contextlib.ExitStack()
        try:
            capture.install(stack, self.model)
            if self._dtensor is not None:
                stack.enter_context(self._dtensor.counting())
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

    def dtensor_comms(self, module: str | None = None, phase: str | None = None) -> dict[str, int]:
        """DTensor's collectives in the block, by name (``{"all_gather_into_tensor": 2}``), of
        one module (its FQN; ``"Global"``: every module) and phase (``"forward"``,
        ``"backward"``), or all; needs ``dtensor=True``."""
        if self._dtensor is None:
            raise ValueError(
                "dtensor_comms: this recorder did not count DTensor's collectives; record with "
                "record_comms(dtensor=True) or record_fsdp(..., dtensor=True)"
            )
        return self._dtensor.counts(module, phase)

    def assert_dtensor_comms(
        self, expected: dict[str, int], *, module: str | None = None, phase: str | None = None
    ) -> None:
        """Asserts DTensor's collectives (see :meth:`dtensor_comms`), e.g.
        ``rec.assert_dtensor_comms({"all_reduce": 1}, module="mlp", phase="forward")``."""
        actual = self.dtensor_comms(module, phase)
        if actual != dict(expected):
            where = "".join(
                f" {what} {value!r}" for what, value in (("of", module), ("in", phase)) if value
            )
            raise self._fail(
                f"expected DTensor collectives{where} {dict(expected)}, counted {actual}"
            )

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


def record_comms(*, barrier: bool = True, mesh: Any = None, dtensor: bool = False) -> FSDPRecorder:
    """Returns a recorder (a context manager) of every collective and point-to-point op the
    calling rank makes in the block, for code that is not an FSDP engine (a pipeline schedule,
    a tensor-parallel layer): :func:`record_fsdp` with no model.

    Args:
        barrier: synchronize the ranks of the default group on entry and exit (default True;
            pass False where not every rank enters the block).
        mesh: name each record's group by the dims of this ``DeviceMesh`` it spans.
        dtensor: count DTensor's collectives too (see :meth:`FSDPRecorder.dtensor_comms`).
    """
    return FSDPRecorder(barrier=barrier, mesh=mesh, dtensor=dtensor)


def record_fsdp(
    model: nn.Module | None = None,
    *,
    engine: str | FSDPEngine | None = None,
    barrier: bool = True,
    mesh: Any = None,
    dtensor: bool = False,
) -> FSDPRecorder:
    """Returns an :class:`FSDPRecorder` to use as a context manager (see its arguments)."""
    return FSDPRecorder(model, engine=engine, barrier=barrier, mesh=mesh, dtensor=dtensor)
