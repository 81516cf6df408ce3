"""One fork server for every xdist worker of a session, owned by xdist's controller.

[Note: one fork server for the xdist workers]
Under ``pytest -n N`` each worker is a session of its own, and each used to start its own fork
server: N imports of torch, then of what the ranks import (dynamo, FSDP, DTensor: seconds of
CPU each), all at the start of the run, on machines where N is often the number of cores. Now
the controller starts one fork server (``fork_server --shared``) when it configures its first
worker, and tells each worker its address (``workerinput``). The server imports nothing until a
worker asks (at the end of that worker's collection, when it has process-mode tests: see [Note:
starting the fork server early] in ``fork_link.py``), so a session without process-mode tests pays
only for starting Python. Each worker keeps its own warm ranks, its own socket for them and its
own reports; it sends its environment with each generation (``GenerationSpec.env``), since the
ranks are forked from a process the worker did not start. A worker's ranks are killed when it
leaves, and the server and every rank end with the controller. Figures: docs/benchmarks.md,
"pytest-xdist and the first test".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from fsdp_testing._launch.socket_root import socket_root

__all__ = ["WORKERINPUT_KEY", "SharedForkServer", "auto_workers", "usable_cores", "workers_note"]

WORKERINPUT_KEY = "fsdp_testing_fork_server"
"""Where a worker finds the shared fork server's address in ``config.workerinput``."""

START_TIMEOUT_S = 60.0


class SharedForkServer:
    """The controller's fork server; started on first use, stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._root: str | None = None
        self.address: str | None = None

    def start(self) -> str:
        """Its address, starting it the first time (it binds its socket before it answers)."""
        if self.address is not None:
            return self.address
        self._root, address = socket_root("fsdp-testing-shared-")
        log = open(os.path.join(self._root, "fork_server.log"), "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_testing._launch.fork_server", "--shared", address],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        log.close()
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # "listening": its socket is bound
        if line.strip() != b"listening":
            self._proc.kill()
            raise RuntimeError(
                "fsdp_testing: the fork server for the xdist workers did not start; its log: "
                f"{os.path.join(self._root, 'fork_server.log')}"
            )
        self.address = address
        return address

    def stop(self) -> None:
        """End the server (its ranks end with it) and remove its folder."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self.address = None


# [Note: how many xdist workers]
# Every worker collects the whole suite, imports torch and keeps warm ranks of its own, and a
# world-size-W test keeps W rank processes busy: on a 2-core machine a session of small
# distributed tests was 1.1 to 1.3 times slower with -n 2 than without -n, xdist's own start
# (3.3 s, measured with plain tests) most of the difference (docs/benchmarks.md, "pytest-xdist
# and the first test"). So ``-n auto`` (and ``-n logical``) gives one worker per two cores the
# process may use (a world-size-2 test's ranks get a core each), and no worker below four
# cores: the session runs as without -n. xdist's own rule applies where the user set
# ``PYTEST_XDIST_AUTO_NUM_WORKERS``. An explicit ``-n N`` is left alone; the header says when
# its ranks share fewer cores than that rule would give them.


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def auto_workers(cores: int | None = None) -> int | None:
    """The number of xdist workers for ``-n auto`` on ``cores`` (default: the usable ones);
    None: xdist decides (``PYTEST_XDIST_AUTO_NUM_WORKERS`` is set)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = usable_cores() if cores is None else cores
    return cores // 2 if cores >= 4 else 0


def workers_note(config: Any) -> str | None:
    """A header line when ``-n N`` gives the ranks fewer cores than ``-n auto`` would."""
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 1 or hasattr(config, "workerinput"):
        return None
    cores = usable_cores()
    suggested = auto_workers(cores)
    if suggested is None or workers <= suggested:
        return None
    return (
        f"fsdp_testing: {workers} xdist workers on {cores} cores: the ranks of their tests "
        f"share the cores; -n auto gives {suggested or 'no'} workers here "
        "(docs/pytest-api.md, 'pytest-xdist')"
    )
