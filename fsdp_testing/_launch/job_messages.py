"""What the first process of a launched job and its slots say to each other, and where: keys
of the job's c10d ``TCPStore`` (torch's own rendezvous store, no protocol of ours on the wire).

[Note: job protocol]
Every process of the job is a *slot*: slot ``s`` runs rank ``s`` of every test whose world size
is above ``s``, in a rank process it forks (``job_slot.py``). The first process (global rank 0)
runs the pytest session and is the *coordinator* (``job.py``); its own slot is a helper
process it starts. All keys live under ``fsdp_testing/<job id>/``:

- ``hello/<s>``: a slot's :class:`SlotHello` (host, node, local rank), once.
- ``alive/<s>``: a counter a slot bumps while it works, so the coordinator tells a slot that
  is busy from one that is gone (see ``LIVENESS_S``).
- ``slot/<s>/<n>``: the coordinator's ``n``-th message to slot ``s``
  (:class:`StartGeneration`, :class:`RunTask`, :class:`DumpRank`, :class:`DropGeneration`,
  :class:`Release`); a slot reads its messages in order and deletes each.
- ``ready/<g>/<s>``: a slot's :class:`Ready` for generation ``g`` (its rank joined the world).
- ``task/<k>``: the pickled :class:`~fsdp_testing._protocol.Task` of test ``k``.
- ``res/<k>/<s>``: how rank ``s`` ended test ``k`` (:class:`Finished` or :class:`Died`).
- ``msg/<k>/<s>``: the traceback rank ``s`` wrote after a failed result of test ``k`` (a str;
  [Note: a rank's report is written off the clock] in ``_protocol.py``).
- ``dump/<k>/<s>``: a straggler's :class:`Dumped` stack and collective log.
- ``gen/<g>/...``: the process group of generation ``g`` (c10d's own keys), one prefix per world
  so a rebuilt world never meets the keys of a broken one.
- ``bye/<s>``: the slot read :class:`Release` and stops touching the store.

Nothing waits on a key without a deadline: readers poll ``check`` (a timed-out ``wait`` would
make c10d log a warning on the terminal).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import time
from datetime import timedelta
from typing import Any

from fsdp_testing._launch.torchrun import JobEnv
from fsdp_testing._protocol import RankResult

__all__ = [
    "LIVENESS_S",
    "POLL_S",
    "Died",
    "DropGeneration",
    "DumpRank",
    "Dumped",
    "Finished",
    "Ready",
    "Release",
    "RunTask",
    "SlotHello",
    "StartGeneration",
    "connect_store",
    "job_prefix",
    "liveness_s",
    "take",
]

POLL_S = 0.01
"""How often a waiting reader checks the store for its key."""
LIVENESS_S = 10.0
"""A slot whose ``alive`` counter has not moved for this long is gone (a slot bumps it every
half second while it waits or works; ten seconds leave room for a loaded machine).
``FSDP_TESTING_JOB_LIVENESS_S`` overrides it (a cluster whose nodes stall longer)."""
LIVENESS_ENV = "FSDP_TESTING_JOB_LIVENESS_S"
STORE_TIMEOUT_S = 300.0
"""The store's own timeout for one operation (connecting included)."""


@dataclasses.dataclass(frozen=True)
class SlotHello:
    rank: int
    host: str
    node: int | None
    local_rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class StartGeneration:
    """Fork a rank process that joins world ``gen`` as rank ``s`` of ``world_size``."""

    gen: int
    world_size: int
    backend: str
    pg_timeout_s: float
    sys_path: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    """Variables the rank needs from the session (``--fsdp-engine``)."""
    ranks_on_host: int
    """How many ranks of this world share the slot's host (they share its cores)."""


@dataclasses.dataclass(frozen=True)
class Ready:
    gen: int
    error: str | None = None
    """Why the rank could not join, with its traceback; None when it joined."""


@dataclasses.dataclass(frozen=True)
class RunTask:
    task_id: int
    gen: int


@dataclasses.dataclass(frozen=True)
class DumpRank:
    """The task timed out on this rank: dump its stack and collective log, then kill it."""

    task_id: int
    gen: int


@dataclasses.dataclass(frozen=True)
class DropGeneration:
    gen: int


@dataclasses.dataclass(frozen=True)
class Release:
    """The session is over: stop every rank process, say bye, exit with ``exit_status``."""

    exit_status: int


@dataclasses.dataclass
class Finished:
    result: RankResult
    records: list[dict[str, Any]]


@dataclasses.dataclass
class Died:
    status: str
    """``"exited with code 3"``, ``"killed by SIGKILL"``."""
    last_output: str
    records: list[dict[str, Any]]


@dataclasses.dataclass
class Dumped:
    stack: str
    sources: dict[str, str]
    """Source line of each frame of ``stack`` (``"path:line"``), read on the rank's node."""
    last_output: str
    records: list[dict[str, Any]]


def liveness_s() -> float:
    """``LIVENESS_S``, or the positive number of seconds ``FSDP_TESTING_JOB_LIVENESS_S`` sets."""
    raw = os.environ.get(LIVENESS_ENV, "")
    try:
        value = float(raw) if raw else LIVENESS_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"fsdp_testing: {LIVENESS_ENV}={raw!r} must be a positive number of seconds"
        )
    return value


def job_prefix(job: JobEnv) -> str:
    return f"fsdp_testing/{job.job_id}/"


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    # A TCPStore client that finds no server logs a warning per retry; wait for the port quietly.
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fsdp_testing: nothing listens on {host}:{port} (the job's store, "
                    f"MASTER_ADDR:MASTER_PORT) after {STORE_TIMEOUT_S:.0f} s: did rank 0 start?"
                ) from None
            time.sleep(0.2)


def connect_store(job: JobEnv, *, host: bool) -> Any:
    """The job's store under this job's prefix. ``host``: this process serves the store (global
    rank 0 when the launcher hosts none)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    if host:
        store = dist.TCPStore(
            job.master_addr, job.master_port, None, True, timeout, wait_for_workers=False
        )
    else:
        _wait_for_listener(job.master_addr, job.master_port, time.monotonic() + STORE_TIMEOUT_S)
        store = dist.TCPStore(job.master_addr, job.master_port, None, False, timeout)
    return dist.PrefixStore(job_prefix(job), store)


def take(store: Any, key: str) -> Any:
    """Read and delete ``key`` (it must exist), unpickled."""
    value = pickle.loads(store.get(key))
    store.delete_key(key)
    return value
