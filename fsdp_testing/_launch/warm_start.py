"""Starting process mode's fork server while pytest collects: a plugin of its own
(``plugin.py`` registers it). See [Note: starting the fork server early] in ``fork_link.py``.

Nothing here imports torch; the launcher is imported once collection meets a test that runs on
rank processes.
"""

from __future__ import annotations

import sys

import pytest

from fsdp_testing._launch.marker_items import spec_of_item
from fsdp_testing._launch.spec import Mode
from fsdp_testing._launch.torchrun import job_env

__all__ = ["pytest_collection_finish", "pytest_itemcollected", "runs_on_rank_processes"]

_started_key = pytest.StashKey[bool]()


def pytest_itemcollected(item: pytest.Item) -> None:
    config = item.config
    if config.stash.get(_started_key, False) or not runs_on_rank_processes(item):
        return
    config.stash[_started_key] = True
    if _starts_nothing(config):
        return
    from fsdp_testing.launcher import start_rank_processes_early

    start_rank_processes_early()


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if not config.stash.get(_started_key, False) or _starts_nothing(config):
        return
    from fsdp_testing.launcher import preload_for_rank_processes, stop_rank_processes

    if any(runs_on_rank_processes(item) for item in session.items):
        preload_for_rank_processes()
    else:  # every such test was deselected
        stop_rank_processes()


def _starts_nothing(config: pytest.Config) -> bool:
    """Collecting only, or a launched job (whose processes are the ranks)."""
    if config.option.collectonly:
        return True
    try:
        return job_env() is not None
    except ValueError:  # the plugin reports a bad job environment
        return True


def runs_on_rank_processes(item: pytest.Item) -> bool:
    """Whether ``item`` runs on rank processes: a process-mode marker, or a unittest class of
    ours in process mode."""
    try:
        spec = spec_of_item(item)
    except (TypeError, ValueError):
        return False
    if spec is not None:
        return spec.mode is Mode.PROCESS
    testcase = sys.modules.get("fsdp_testing.testcase")  # not imported: no class of ours
    cls = getattr(item, "cls", None)
    if testcase is None or not isinstance(cls, type):
        return False
    if not issubclass(cls, testcase._DistributedTestCase):
        return False
    mode = getattr(cls, "dist_mode", None) or cls._mode  # type: ignore[attr-defined]
    return bool(mode == Mode.PROCESS)
