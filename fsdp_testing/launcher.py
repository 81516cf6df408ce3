"""Launching a task on the ranks of a process group: the one entry point that the pytest plugin
and the unittest base classes share.

Each mode is one launcher behind the small :class:`Launcher` protocol (``_launch/base.py``):
``process`` (the warm pool of forked rank processes, ``_launch/pool.py``), ``thread``
(``_launch/threads.py``), ``fake`` (one rank of a world of any size, ``_launch/fake.py``),
``local`` (every rank in this process with exact collectives, ``_launch/local.py``), and, when
pytest runs on every process of a launched job (torchrun, srun, a PyTorchJob), the job's ranks
(``_launch/job.py``, started by :func:`start_job`). Launchers are created on first use and live
until :func:`shutdown` (called when the test session ends).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from typing import TYPE_CHECKING

from fsdp_testing._launch.base import Launcher
from fsdp_testing._launch.spec import DEFAULT_TIMEOUT_S, DistSpec, Mode
from fsdp_testing._launch.torchrun import job_env
from fsdp_testing._protocol import FunctionRef, Task
from fsdp_testing._report.expectation import ExpectedFailure
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.verdict import Verdict, VerdictOutcome, judge

if TYPE_CHECKING:
    from fsdp_testing._launch.pool import ProcessLauncher, SentTask

__all__ = [
    "LaunchSettings",
    "Launcher",
    "UnavailableBackend",
    "Verdict",
    "VerdictOutcome",
    "finish_job",
    "get_launcher",
    "last_observation",
    "preload_for_rank_processes",
    "resolve_backend",
    "run_distributed",
    "session_settings",
    "set_session_settings",
    "set_shared_fork_server",
    "shutdown",
    "start_job",
    "start_rank_processes_early",
    "stop_rank_processes",
]


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """Session-wide defaults (from the command line and ini file).

    Args:
        timeout: seconds before a test counts as hung, unless its marker says otherwise.
        backend: backend for process-mode tests whose marker names none (None: automatic).
        pool: keep ranks warm between tests (``--no-dist-pool`` turns it off).
        tbstyle: pytest's ``--tb`` style, for the tracebacks the unittest classes' ranks
            format (the marker's tests take it from their item); ``"auto"`` outside pytest.
    """

    timeout: float = DEFAULT_TIMEOUT_S
    backend: str | None = None
    pool: bool = True
    tbstyle: str = "auto"


class UnavailableBackend(Exception):
    """The test asks for a backend this machine cannot provide; the test is skipped."""


def resolve_backend(spec: DistSpec, default: str | None = None) -> str:
    """The backend a test runs on: the marker's, else ``default``, else nccl when CUDA has at
    least ``world_size`` devices and gloo otherwise; thread, local and fake modes have their own.

    Raises:
        UnavailableBackend: nccl was asked for without ``world_size`` CUDA devices.
        ValueError: the backend does not fit the mode.
    """
    if spec.mode is Mode.THREAD:
        if spec.backend not in (None, "threaded"):
            raise ValueError(
                f"distributed marker: mode='thread' runs on torch's threaded process group; "
                f"backend={spec.backend!r} does not apply (leave backend unset)"
            )
        return "threaded"
    if spec.mode is Mode.FAKE:
        if spec.backend not in (None, "fake"):
            raise ValueError(
                f"distributed marker: mode='fake' runs on torch's fake backend; "
                f"backend={spec.backend!r} does not apply (leave backend unset)"
            )
        return "fake"
    if spec.mode is Mode.LOCAL:
        if spec.backend not in (None, "local"):
            raise ValueError(
                f"distributed marker: mode='local' runs on its own in-process backend, whose "
                f"sums equal gloo's; backend={spec.backend!r} does not apply (leave backend unset)"
            )
        return "local"
    backend = spec.backend or default
    if backend in ("threaded", "fake", "local"):
        mode = {"threaded": "thread", "fake": "fake", "local": "local"}[backend]
        raise ValueError(f"distributed marker: backend={backend!r} needs mode={mode!r}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # In a launched job each rank uses the GPU of its local rank on its own node: what this
    # node must have is one device per process the launcher started here.
    needed = spec.world_size
    if _JOB in _launchers and spec.mode is Mode.PROCESS:
        needed = min(spec.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend is None:
        return "nccl" if gpus >= needed else "gloo"
    if backend == "nccl" and gpus < needed:
        raise UnavailableBackend(
            f"nccl with world_size={spec.world_size} needs {needed} CUDA devices; "
            f"this machine has {gpus}"
        )
    return backend


_launchers: dict[str, Launcher] = {}
_settings = LaunchSettings()
_JOB = "job"


def set_session_settings(settings: LaunchSettings) -> None:
    """Make ``settings`` the defaults for launches that name none (the pytest plugin's options)."""
    global _settings
    _settings = settings


def session_settings() -> LaunchSettings:
    """The defaults set by :func:`set_session_settings` (built-in defaults otherwise)."""
    return _settings


def start_job(*, report: str = "rank 0's terminal") -> None:
    """Make this process the coordinator of the launched job it belongs to (the pytest plugin
    calls it on the job's first process; the others serve as slots, see ``_launch/job.py``):
    from now on process-mode tests run on the job's ranks.

    Args:
        report: where the report is, as the other nodes' one line says (default
            ``"rank 0's terminal"``).
    """
    job = job_env()
    if job is None or _JOB in _launchers:
        return
    from fsdp_testing._launch.job import JobLauncher

    _launchers[_JOB] = JobLauncher(job, report=report)


def finish_job(exit_status: int) -> None:
    """Release the job's other processes, which exit with ``exit_status`` (the session's)."""
    launcher = _launchers.get(_JOB)
    if launcher is not None:
        from fsdp_testing._launch.job import JobLauncher

        assert isinstance(launcher, JobLauncher)
        launcher.release(exit_status)


_shared_fork_server: str | None = None


def set_shared_fork_server(address: str | None) -> None:
    """Fork process-mode ranks from the fork server at ``address`` (an xdist worker's, shared
    with the session's other workers: see [Note: one fork server for the xdist workers] in
    ``_launch/shared_fork_server.py``); None: a fork server of this process's own."""
    global _shared_fork_server
    _shared_fork_server = address


def get_launcher(mode: Mode) -> Launcher:
    """The session's launcher for ``mode``, created on first use. In a launched job (after
    :func:`start_job`) every process-mode test runs on the job's ranks."""
    key = _JOB if mode is Mode.PROCESS and _JOB in _launchers else mode.value
    launcher = _launchers.get(key)
    if launcher is None:
        if mode is Mode.PROCESS:
            from fsdp_testing._launch.pool import ProcessLauncher

            launcher = ProcessLauncher(_shared_fork_server)
        elif mode is Mode.LOCAL:
            from fsdp_testing._launch.local import LocalLauncher

            launcher = LocalLauncher()
        elif mode is Mode.FAKE:
            from fsdp_testing._launch.fake import FakeLauncher

            launcher = FakeLauncher()
        else:
            from fsdp_testing._launch.threads import ThreadLauncher

            launcher = ThreadLauncher()
        _launchers[key] = launcher
    return launcher


def _process_launcher() -> ProcessLauncher | None:
    """Process mode's launcher, unless this is a launched job (whose processes are the ranks)."""
    from fsdp_testing._launch.pool import ProcessLauncher

    launcher = get_launcher(Mode.PROCESS)
    return launcher if isinstance(launcher, ProcessLauncher) else None


def start_rank_processes_early() -> None:
    """Start process mode's fork server now, without waiting for it (see [Note: starting the
    fork server early] in ``_launch/pool.py``)."""
    launcher = _process_launcher()
    if launcher is not None:
        launcher.start_fork_server()


def preload_for_rank_processes() -> None:
    """Have the fork server import what this process imported (the test modules' imports)
    before it forks ranks; returns at once."""
    from fsdp_testing._launch.rank_process import parent_modules

    launcher = _process_launcher()
    if launcher is not None:
        launcher.preload(parent_modules())


def stop_rank_processes() -> None:
    """End process mode's fork server and ranks, if started (no test of the session needs
    them)."""
    launcher = _launchers.pop(Mode.PROCESS.value, None)
    if launcher is not None:
        launcher.shutdown()


def run_distributed(
    task: Task,
    spec: DistSpec,
    settings: LaunchSettings = LaunchSettings(),
    *,
    pool: bool | None = None,
    expect: ExpectedFailure | None = None,
    limit: float | None = None,
) -> Verdict:
    """Run ``task`` on every rank that ``spec`` describes and judge the outcome.

    Args:
        task: what each rank runs.
        spec: world size, backend, mode, timeout (None: ``settings.timeout``) and, in fake
            mode, the rank to play.
        settings: session defaults.
        pool: override ``settings.pool`` for this task.
        expect: the failure the test expects (``fsdp_testing.faults.expect``), if any.
        limit: an outer limit on the ranks' time, seconds from now (what pytest-timeout leaves
            the test): the harness's deadline comes before it. None: no outer limit.
    """
    backend = resolve_backend(spec, settings.backend)
    timeout = _timeout(spec, settings, limit)
    if spec.faults:
        from fsdp_testing.faults import validate_for_mode

        validate_for_mode(spec.faults, spec.mode.value, spec.world_size)
        task = dataclasses.replace(task, faults=spec.faults)
    launcher = get_launcher(spec.mode)
    if spec.mode is Mode.FAKE:
        from fsdp_testing._launch.fake import FakeLauncher

        launcher = FakeLauncher(spec.rank)
    obs = launcher.run(
        task,
        world_size=spec.world_size,
        backend=backend,
        timeout=timeout,
        reuse=settings.pool if pool is None else pool,
    )
    return _judge(obs, expect)


_last_observation: Observation | None = None


def last_observation() -> Observation | None:
    """What the launcher saw of the task judged last in this process: the plugin's per-rank
    report properties (``fsdp_testing/_integrations/rank_properties.py``)."""
    return _last_observation


def _judge(obs: Observation, expect: ExpectedFailure | None) -> Verdict:
    global _last_observation
    _last_observation = obs
    verdict = judge(obs)
    return verdict if expect is None else expect.judge(obs, verdict)


def _timeout(spec: DistSpec, settings: LaunchSettings, limit: float | None = None) -> float:
    """The ranks' deadline: the marker's timeout, else the session's, and never past an outer
    ``limit`` (see [Note: outer timeouts] in ``fsdp_testing/_integrations/timeouts.py``)."""
    own = spec.timeout if spec.timeout is not None else settings.timeout
    return own if limit is None else min(own, limit)


@dataclasses.dataclass
class SentAhead:
    """A task already running on warm ranks (:func:`send_ahead`); :meth:`verdict` waits for it."""

    _launcher: ProcessLauncher
    _sent: SentTask

    def verdict(self, expect: ExpectedFailure | None = None) -> Verdict:
        return _judge(self._launcher.finish(self._sent), expect)


def send_ahead(
    task: Task, spec: DistSpec, settings: LaunchSettings, *, limit: float | None = None
) -> SentAhead | None:
    """Send a process-mode ``task`` to warm ranks now and judge it later; None (nothing sent)
    where ``run_distributed`` has to run it: other modes, no warm ranks ready for it, a job's
    ranks, fresh processes, faults. See [Note: a test sent at the end of its setup] in
    ``fsdp_testing/plugin.py``."""
    if spec.mode is not Mode.PROCESS or not settings.pool or spec.faults:
        return None
    launcher = get_launcher(spec.mode)
    from fsdp_testing._launch.pool import ProcessLauncher

    if not isinstance(launcher, ProcessLauncher):  # a job's ranks: run in the call
        return None
    sent = launcher.send_to_warm_ranks(
        task,
        world_size=spec.world_size,
        backend=resolve_backend(spec, settings.backend),
        timeout=_timeout(spec, settings, limit),
    )
    return None if sent is None else SentAhead(launcher, sent)


def tear_down_rank_fixture(key: str) -> None:
    """Tear down, on every warm rank process that keeps it, the broader-scoped fixture kept
    under ``key``: its scope ended in the parent (see [Note: fixtures on the ranks] in
    ``fsdp_testing/_rank/fixtures.py``). A rank's error fails the teardown of the test that
    ended the scope, with the ranks' report."""
    launcher = _launchers.get(Mode.PROCESS.value)
    from fsdp_testing._launch.pool import ProcessLauncher

    if not isinstance(launcher, ProcessLauncher):
        return
    task = Task(
        target=FunctionRef("fsdp_testing._rank.fixtures", None, "tear_down_key"),
        kwargs={"key": key},
        test_id=f"teardown of {key}",
    )
    for obs in launcher.run_on_warm_ranks(task, timeout=_settings.timeout):
        verdict = _judge(obs, None)
        if verdict.outcome is VerdictOutcome.FAILED:
            import pytest

            pytest.fail(verdict.message, pytrace=False)  # the report is the ranks'


def shutdown() -> None:
    """Stop every rank and helper process this process started."""
    seen: set[int] = set()
    for launcher in _launchers.values():
        if id(launcher) not in seen:
            seen.add(id(launcher))
            launcher.shutdown()
    _launchers.clear()


atexit.register(shutdown)
