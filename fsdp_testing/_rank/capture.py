"""Capturing what each rank prints, per rank, even when thread ranks share one ``sys.stdout``."""

from __future__ import annotations

import io
import sys
import threading
from typing import TextIO

__all__ = ["CaptureRouter", "install_router"]


class CaptureRouter(io.TextIOBase):
    """A ``sys.stdout``/``sys.stderr`` stand-in that sends each thread's writes to that thread's
    buffer while one is registered (thread ranks share one ``sys.stdout``), and to ``tee``
    as well, so a rank that crashes still leaves its last output behind."""

    def __init__(self, fallback: TextIO, tee: TextIO | None = None) -> None:
        self._fallback = fallback
        self._tee = tee
        self._buffers: dict[int, io.StringIO] = {}

    def begin(self) -> None:
        self._buffers[threading.get_ident()] = io.StringIO()

    def end(self) -> str:
        buf = self._buffers.pop(threading.get_ident(), None)
        return buf.getvalue() if buf is not None else ""

    def write(self, s: str) -> int:
        buf = self._buffers.get(threading.get_ident())
        if buf is None:
            return self._fallback.write(s)
        buf.write(s)
        if self._tee is not None:
            self._tee.write(s)
            self._tee.flush()
        return len(s)

    def flush(self) -> None:
        self._fallback.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fallback.fileno()


def install_router(tee: TextIO | None = None) -> CaptureRouter:
    """Route ``sys.stdout`` and ``sys.stderr`` of this process through one router."""
    router = CaptureRouter(sys.stdout, tee)
    sys.stdout = router
    sys.stderr = router
    return router
