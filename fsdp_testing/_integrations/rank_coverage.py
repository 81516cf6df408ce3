"""Coverage on the ranks: lines a rank process runs count in the session's coverage report.

[Note: coverage on rank processes]
coverage.py measures the process it was started in, and the threads that process starts after
it (so thread, local and fake mode need nothing). A process-mode rank is forked from the fork
server, a fresh interpreter that coverage never started in, and ends with ``os._exit``, which
skips coverage's save at exit. So, when coverage.py measures the pytest process (pytest-cov,
``coverage run -m pytest``, with or without ``[run] patch``):

- the parent puts its coverage configuration (``CoverageConfig.serialize``, the data file made
  absolute) in the environment (``ENV``) before it starts a fork server or a job's helper slot
  (:func:`export_for_ranks`); the fork server itself measures nothing, so forking stays cheap;
- each rank starts its own ``Coverage`` from that configuration (or, in a job's slot, from the
  slot's own pytest-cov or ``coverage run``), stopping any it inherited, with a data file of
  its own beside the parent's: ``<data_file>.fsdp-testing.<host>.pid<pid>.r<rank>.<random>``
  (:func:`start_in_rank`);
- the rank saves after every task, before it sends its result (:func:`save_in_rank`): the
  parent may kill a rank as soon as it has the result (a failed test's ranks are discarded);
- the files are combined by coverage.py's own machinery: pytest-cov combines every
  ``<data_file>.*`` file at the end of the test loop (under pytest-xdist, in the controller),
  ``coverage combine`` does the same, and under ``coverage run -m pytest`` the plugin combines
  the ranks' files of this session into the running measurement when the session ends
  (:func:`combine_into_session`), so ``coverage report`` needs no extra step.

A rank killed mid-test (a hang's stragglers at the timeout, a crash) loses the lines of that
test only: what it ran before was saved with its earlier results. Nothing of this runs when
coverage.py is not measuring: ``export_for_ranks`` is only called once ``coverage`` is imported,
and a rank without ``ENV`` and without an inherited measurement does nothing.
"""

from __future__ import annotations

import glob
import json
import os
import random
import socket
import sys
from typing import Any

__all__ = ["ENV", "combine_into_session", "export_for_ranks", "save_in_rank", "start_in_rank"]

ENV = "FSDP_TESTING_COVERAGE"
"""The parent's coverage configuration for its ranks (JSON: ``config``, ``session``)."""
_TAG = "fsdp-testing"
_QUIET = ["no-data-collected", "module-not-imported", "module-not-measured", "already-imported"]
"""Warnings a rank's measurement would print into its output for no fault of the test (a rank
that ran no measured line, a source package the rank never imported)."""

_exported: dict[str, Any] = {}
"""The parent's measurement its ranks were told about (``cov``) and the session's tag."""
_rank_cov: Any = None


def _current() -> Any:
    """The ``coverage.Coverage`` measuring this process, if any (without importing coverage)."""
    module = sys.modules.get("coverage")
    current = getattr(getattr(module, "Coverage", None), "current", None)
    return current() if current is not None else None


def export_for_ranks() -> bool:
    """In the parent: if coverage.py measures this process, have the rank processes started
    from now on measure themselves alike (see [Note: coverage on rank processes]). Returns
    whether it does."""
    cov = _current()
    if cov is None:  # also one inherited from a measured parent session: not for these ranks
        os.environ.pop(ENV, None)
        _exported.clear()
        return False
    session = _exported.get("session") or f"{os.getpid()}x{random.randrange(16**6):06x}"
    os.environ[ENV] = json.dumps({"config": cov.config.serialize(), "session": session})
    _exported.update(cov=cov, session=session, data_file=os.path.abspath(cov.config.data_file))
    return True


def combine_into_session() -> None:
    """In the parent, once the ranks are stopped: combine this session's rank data files into
    the measurement that is still running (``coverage run -m pytest``). Under pytest-cov the
    measurement has ended by now and pytest-cov has combined the files itself."""
    cov = _exported.get("cov")
    if cov is None or _current() is not cov:
        return
    from coverage import CoverageData

    pattern = f"{_exported['data_file']}.{_TAG}.{_exported['session']}.*"
    data = cov.get_data()
    # CoverageData.update rather than Coverage.combine, which prints "Combined N files" after
    # pytest's summary. The ranks ran on this machine: their paths need no remapping.
    for path in sorted(glob.glob(pattern)):
        part = CoverageData(basename=path)
        part.read()
        data.update(part)
        os.remove(path)


def start_in_rank(rank: int) -> None:
    """In a rank process just forked: start measuring, from the parent's configuration (``ENV``)
    or from the measurement inherited from the forking process (a job's slot under pytest-cov);
    nothing when neither is there."""
    global _rank_cov
    inherited = _current()
    raw = os.environ.get(ENV)
    if raw is None and inherited is None:
        return
    from coverage import Coverage
    from coverage.config import CoverageConfig

    if raw is not None:
        exported = json.loads(raw)
        config, session = CoverageConfig.deserialize(exported["config"]), exported["session"]
    else:
        config, session = inherited.config, f"{os.getppid()}"
    if inherited is not None:
        # Its data is the forking process's: never saved from here.
        inherited._auto_save = False
        inherited.stop()
    # This module saves after every task; coverage's own ``_exit`` patch would save again as
    # the rank stops, after the session combined its files, and leave a file behind.
    config.patch = [p for p in config.patch if p != "_exit"]
    config.disable_warnings = [*config.disable_warnings, *_QUIET]
    suffix = (
        f"{_TAG}.{session}.{socket.gethostname()}.pid{os.getpid()}.r{rank}."
        f"{random.randrange(16**6):06x}"
    )
    cov = Coverage(config_file=":data:" + config.serialize(), data_suffix=suffix)
    cov.start()
    _rank_cov = cov


def save_in_rank() -> None:
    """In a rank process: write what was measured since the last save (a no-op when the rank
    does not measure)."""
    if _rank_cov is not None:
        _rank_cov.save()
