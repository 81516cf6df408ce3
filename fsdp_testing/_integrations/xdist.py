"""pytest-xdist: the controller's fork server for its workers, and each worker's use of it. A
plugin of its own (``plugin.py`` registers it); see [Note: one fork server for the xdist
workers] in ``fsdp_testing/_launch/shared_fork_server.py``. ``-n auto`` is ``plugin.py``'s
``pytest_xdist_auto_num_workers`` (xdist asks before any plugin is configured)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from fsdp_testing._launch.shared_fork_server import WORKERINPUT_KEY, SharedForkServer

__all__ = ["pytest_configure_node", "pytest_unconfigure", "use_shared_fork_server"]

_server_key = pytest.StashKey[SharedForkServer]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller, for each worker it starts: the shared fork server's address."""
    config = node.config
    if _server_key not in config.stash:
        config.stash[_server_key] = SharedForkServer()
    try:
        node.workerinput[WORKERINPUT_KEY] = config.stash[_server_key].start()
    except (OSError, RuntimeError) as exc:  # each worker starts its own, as before
        warnings.warn(f"{exc}; each xdist worker starts its own fork server", stacklevel=1)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _server_key in config.stash:
        config.stash[_server_key].stop()


def use_shared_fork_server(config: pytest.Config) -> None:
    """A worker: fork ranks from the controller's fork server, if it has one."""
    from fsdp_testing.launcher import set_shared_fork_server

    workerinput = getattr(config, "workerinput", None) or {}
    set_shared_fork_server(workerinput.get(WORKERINPUT_KEY))
