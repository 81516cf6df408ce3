"""``tmp_path_factory`` for process-mode ranks.

pytest's ``TempPathFactory`` cannot be pickled once the session has made a temporary folder (it
then holds the exit stack that removes old folders), so a process-mode test that asked for it
failed as soon as another test had used ``tmp_path``. The ranks get this stand-in instead: the
same base folder, and ``mktemp`` making a new folder in it on the rank that calls it (each rank
its own, as two processes calling pytest's ``mktemp`` would get). ``tmp_path`` itself is made
once in the pytest process and sent as a path: every rank sees the same folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["RankTempPathFactory", "portable"]


class RankTempPathFactory:
    """The part of ``pytest.TempPathFactory`` a test body uses: ``getbasetemp`` and ``mktemp``."""

    def __init__(self, basetemp: Path) -> None:
        self._basetemp = basetemp

    def getbasetemp(self) -> Path:
        """The session's base temporary folder (the same on every rank)."""
        return self._basetemp

    def mktemp(self, basename: str, numbered: bool = True) -> Path:
        """A new folder under the base folder; ``numbered`` gives it a unique suffix (made on
        this rank: ranks calling it get a folder each), else it is ``basename`` itself."""
        if os.path.normpath(basename) != basename or os.path.isabs(basename) or os.sep in basename:
            raise ValueError(
                f"tmp_path_factory.mktemp({basename!r}): the name must be a plain folder name, "
                "relative to the base folder, without path separators"
            )
        if numbered:
            return Path(tempfile.mkdtemp(prefix=f"{basename}-", dir=self._basetemp))
        path = self._basetemp / basename
        path.mkdir()
        return path


def portable(value: object) -> object:
    """``value`` as a rank process can receive it: a ``TempPathFactory`` becomes its stand-in."""
    import pytest

    if isinstance(value, pytest.TempPathFactory):
        return RankTempPathFactory(value.getbasetemp())
    return value
