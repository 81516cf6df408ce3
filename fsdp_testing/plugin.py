"""pytest plugin entry point (registered through the ``pytest11`` entry point).

Kept thin and free of torch imports so that ``pytest --help`` stays fast: options, the marker,
the rank fixtures and the call hook. The launching machinery is imported when the first
distributed test runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any

import pytest

from fsdp_testing._launch.fixtures import (
    device,
    dist_backend,
    fail_if_refused,
    process_group,
    pytest_fixture_setup,
    rank,
    refuse_at_setup,
    refuse_outside_distributed_tests,
    world_size,
)
from fsdp_testing._launch.marker_items import parametrize, spec_of, spec_of_item
from fsdp_testing._launch.options import add_options, configure_cpu_world_size, settings_from
from fsdp_testing._launch.spec import MARKER_SIGNATURE, DistSpec, Mode
from fsdp_testing._launch.task_build import NotPortable, build_task
from fsdp_testing._launch.torchrun import job_env
from fsdp_testing._protocol import ENGINE_ENV

__all__ = [
    "device",
    "dist_backend",
    "process_group",
    "pytest_fixture_setup",
    "rank",
    "world_size",
]

_settings_key = pytest.StashKey["Any"]()
_engine_env_key = pytest.StashKey["str | None"]()
_exit_status_key = pytest.StashKey[int]()
# pytest-timeout's and faulthandler_timeout's timers (see [Note: outer timeouts]).
_timeouts_key = pytest.StashKey["Any"]()
_limit_note_key = pytest.StashKey[str]()
_headline_key = pytest.StashKey[str]()  # a failed distributed test's first report line


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER_SIGNATURE}: run the test body once on each rank of a process group "
        "(mode: process, thread, local or fake; fake plays rank=R of the world). A list of "
        "world sizes, or of fake ranks, parametrizes the test.",
    )
    config.addinivalue_line(
        "markers",
        "no_dist_pool: run this distributed test on freshly forked rank processes instead of "
        "the warm pool (as --no-dist-pool does for every test).",
    )
    # torch 2.15's common_utils markers, which fsdp_testing.common_utils attaches too.
    config.addinivalue_line("markers", "multigpu: needs two GPUs or more (requires_multigpu)")
    config.addinivalue_line(
        "markers", "periodic: runs in CI only with TEST_WITH_PERIODIC (periodic)"
    )
    # A collective in a test that is not distributed: see fsdp_testing/_report/no_group.py.
    config.pluginmanager.register(importlib.import_module("fsdp_testing._report.no_group"))
    # Starting the fork server while pytest collects; pytest-xdist's workers sharing one.
    config.pluginmanager.register(importlib.import_module("fsdp_testing._launch.warm_start"))
    config.pluginmanager.register(importlib.import_module("fsdp_testing._integrations.xdist"))
    config.stash[_settings_key] = settings = settings_from(config)
    configure_cpu_world_size(config)
    if not config.option.help:
        from fsdp_testing.launcher import set_session_settings

        set_session_settings(settings)
        sys.modules["fsdp_testing._integrations.xdist"].use_shared_fork_server(config)
        _select_engine(config)
        _export_coverage()  # before a job's helper slot starts
        if _job() is not None:
            from fsdp_testing._integrations import seeds

            config.stash[_seed_key] = seeds.export_for_ranks(config, in_a_job=True)
        _start_job(config)
        from fsdp_testing._integrations import timeouts

        config.stash[_timeouts_key] = timeouts.install(config)
        if config.getoption("usepdb", False):
            _enable_rank_post_mortems(config)


# --- a launched job (torchrun, srun, a PyTorchJob): see docs/multinode.md -------------------


def _job() -> Any:
    try:
        return job_env()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    # Every process of a launched job but the first serves ranks of the first one's session
    # instead of running a session of its own (see [Note: jobs across nodes] in _launch/job.py).
    job = _job()
    if job is None or job.rank == 0 or config.option.help or config.option.version:
        return None
    from fsdp_testing._integrations import seeds
    from fsdp_testing._launch.job_slot import serve_slot

    seeds.export_for_ranks(config, in_a_job=True)  # see [Note: per-rank seeds]

    return serve_slot(job)


def _start_job(config: pytest.Config) -> None:
    job = _job()
    if job is None:
        return
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            f"fsdp_testing: -n (pytest-xdist) does not combine with {job.describe()}: its "
            f"{job.world_size} processes already run the ranks of every distributed test; "
            "drop -n"
        )
    report = "rank 0's terminal"
    xml = getattr(config.option, "xmlpath", None)
    if xml:
        report += f" and the JUnit XML {os.path.abspath(os.path.expanduser(xml))}"
    from fsdp_testing.launcher import start_job

    try:
        start_job(report=report)
    except Exception as exc:
        raise pytest.UsageError(
            f"fsdp_testing: could not reach the store of {job.describe()} at "
            f"{job.master_addr}:{job.master_port} (MASTER_ADDR:MASTER_PORT): {exc}"
        ) from None


# --- other plugins: see docs/pytest-api.md, "With other plugins" ---------------------------


def _export_coverage() -> None:
    # See [Note: coverage on rank processes] in _integrations/rank_coverage.py; free when
    # coverage.py is not imported.
    if "coverage" in sys.modules:
        from fsdp_testing._integrations import rank_coverage

        rank_coverage.export_for_ranks()


# pytest-randomly's seed the ranks reseed from (None: they do not): see [Note: per-rank seeds].
_seed_key = pytest.StashKey["int | None"]()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    # After pytest-cov's own pytest_sessionstart, which starts measuring an xdist worker, and
    # after pytest-randomly's pytest_configure, which settles its seed (a job's ranks got
    # theirs in pytest_configure).
    _export_coverage()
    if _seed_key not in session.config.stash:
        from fsdp_testing._integrations import seeds

        session.config.stash[_seed_key] = seeds.export_for_ranks(session.config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    from fsdp_testing._integrations import seeds
    from fsdp_testing._launch.shared_fork_server import workers_note

    # The header comes before pytest_sessionstart.
    seed = seeds.session_seed(config, in_a_job=_job() is not None)
    lines = [] if seed is None else [seeds.describe(seed)]
    note = workers_note(config)
    return lines if note is None else [*lines, note]


def _add_rank_properties(item: pytest.Function, failed: bool) -> None:
    """Each rank's ending (and seed) as report properties: see [Note: per-rank properties] in
    ``_integrations/rank_properties.py``."""
    from fsdp_testing._integrations.rank_properties import rank_properties
    from fsdp_testing.launcher import last_observation

    obs = last_observation()
    if obs is None:
        return
    seed = item.config.stash.get(_seed_key, None)
    properties = rank_properties(obs, test_id=item.nodeid, seed=seed)
    item.user_properties.extend(properties)
    if failed and seed is not None:
        item.add_report_section(
            "call",
            "per-rank seeds",
            "".join(f"{name}: {value}\n" for name, value in properties if name.endswith("seed")),
        )


def _open_harness_window(item: pytest.Item, spec: DistSpec) -> float | None:
    """The ranks are about to get ``item``: the outer limit on their time (None: none), with
    the outer timers pushed back until :func:`_close_harness_window`. See [Note: outer
    timeouts] in ``_integrations/timeouts.py``."""
    bridge = item.config.stash.get(_timeouts_key, None)
    if bridge is None:
        return None
    limit = bridge.limit(item)
    bridge.before_harness(item)
    if limit is None:
        return None
    own = spec.timeout if spec.timeout is not None else item.config.stash[_settings_key].timeout
    if limit[0] < own:
        item.stash[_limit_note_key] = f"the ranks' deadline, {limit[0]:g} s: {limit[1]}"
    return limit[0]


_pdb_dir_key = pytest.StashKey[str]()
_rank_error_key = pytest.StashKey["tuple[int, BaseException]"]()


def _enable_rank_post_mortems(config: pytest.Config) -> None:
    """``--pdb``: see [Note: debugging a rank] in ``_integrations/debugging.py``."""
    import tempfile

    from fsdp_testing._integrations import debugging

    debugging.enable_in_process()
    folder = config.stash[_pdb_dir_key] = tempfile.mkdtemp(prefix="fsdp-testing-pdb-")
    os.environ[debugging.ENV] = folder  # for the rank processes forked from now on


@pytest.hookimpl(tryfirst=True)
def pytest_exception_interact(node: Any, call: pytest.CallInfo[Any], report: Any) -> None:
    # Before pytest's --pdb: its post-mortem opens on the failing rank's frames.
    if _pdb_dir_key not in node.config.stash or not isinstance(node, pytest.Item):
        return
    from fsdp_testing._integrations import debugging

    write = node.config.pluginmanager.getplugin("terminalreporter").write_line
    error = node.stash.get(_rank_error_key, None)
    if error is not None:
        del node.stash[_rank_error_key]
        write(f"fsdp_testing: --pdb opens on rank {error[0]}'s frames (the first rank to fail)")
        call.excinfo = pytest.ExceptionInfo.from_exception(error[1])
    elif debugging.wait_for_rank_sessions(node.config.stash[_pdb_dir_key], write):
        pytest.exit("Quitting debugger")


def _rank_thread_breakpoints(config: pytest.Config, portable: bool) -> Any:
    """``breakpoint()`` on rank threads under ``-s``: see [Note: debugging a rank]."""
    import contextlib

    if portable or config.getoption("capture", None) != "no":
        return contextlib.nullcontext()
    from fsdp_testing._integrations import debugging

    return debugging.rank_thread_breakpoints()


def _close_harness_window(item: pytest.Item) -> None:
    bridge = item.config.stash.get(_timeouts_key, None)
    if bridge is not None:
        bridge.after_harness(item)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_exit_status_key] = int(exitstatus)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # A torch-style test run at another world size than its class declares says so.
    report = yield
    headline = item.stash.get(_headline_key, None)
    crash = getattr(report.longrepr, "reprcrash", None)
    if headline is not None and call.when == "call" and crash is not None:
        # The short summary line (and JUnit's failure message) is the report's headline: pytest
        # puts the whole message there on CI, where it does not cut it to one line, and the
        # report would be printed twice.
        crash.message = f"Failed: {headline}"
    note = getattr(getattr(item, "instance", None), "_fsdp_testing_note", None)
    if note and call.when == "call":
        report.user_properties.append(("fsdp_testing_world", note))
    if call.excinfo is not None and "fsdp_testing.testcase" in sys.modules:
        from fsdp_testing._report.unittest_failure import report_as_ranks_did

        report_as_ranks_did(item, call, report)
    return report


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> Any:
    # Collection reports have no user_properties.
    note = dict(getattr(report, "user_properties", ())).get("fsdp_testing_world")
    if note and report.when == "call" and report.passed:
        return "passed", ".", f"PASSED ({note})"
    return None


# --- pytest-xdist: see [Note: how many xdist workers] in _launch/shared_fork_server.py ------


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``/``-n logical``: one worker per two cores, none below four."""
    from fsdp_testing._launch.shared_fork_server import auto_workers

    return auto_workers()


def _select_engine(config: pytest.Config) -> None:
    name = config.getoption("fsdp_engine") or config.getini("fsdp_engine")
    if not name:
        return
    from fsdp_testing.engines import set_default_engine

    try:
        set_default_engine(name)
    except ValueError as exc:
        raise pytest.UsageError(f"--fsdp-engine / fsdp_engine: {exc}") from None
    # Rank processes are forked later from a server started with this environment.
    config.stash[_engine_env_key] = os.environ.get(ENGINE_ENV)
    os.environ[ENGINE_ENV] = name


def pytest_unconfigure(config: pytest.Config) -> None:
    if _engine_env_key in config.stash:
        previous = config.stash[_engine_env_key]
        if previous is None:
            os.environ.pop(ENGINE_ENV, None)
        else:
            os.environ[ENGINE_ENV] = previous

    if "fsdp_testing.launcher" in sys.modules:
        launcher = sys.modules["fsdp_testing.launcher"]
        # A session that never finished failed to configure: pytest exits with 4 then.
        launcher.finish_job(config.stash.get(_exit_status_key, pytest.ExitCode.USAGE_ERROR))
        launcher.shutdown()
    if "fsdp_testing._integrations.rank_coverage" in sys.modules:
        sys.modules["fsdp_testing._integrations.rank_coverage"].combine_into_session()
    if _pdb_dir_key in config.stash:
        import shutil

        shutil.rmtree(config.stash[_pdb_dir_key], ignore_errors=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize(metafunc)
    try:
        spec = spec_of_item(metafunc.definition)
    except (TypeError, ValueError):
        return  # the test fails alone when it runs, naming the marker's error
    if spec is not None:
        refuse_at_setup(metafunc, spec)


_spec_of = spec_of


# [Note: a test sent at the end of its setup]
# A process-mode test whose warm ranks are ready is sent to them as soon as its fixtures are set
# up (the end of pytest's setup phase), and its result is read in the call phase: the ranks run
# it while pytest reports the setup and enters the call (on the development machine about 0.45
# ms of a 3.35 ms test, see docs/benchmarks.md). The body runs where it would have run, on the
# ranks, with the same fixture values and the same timeout (counted from the send); pytest's
# durations show part of it under setup. Nothing is sent ahead where the call may not follow or
# the ranks are not warm: ``--setup-only`` and ``--setup-plan``, fresh processes
# (``no_dist_pool``, ``--no-dist-pool``), no warm generation for the world (the call starts
# one), a job's ranks, faults, a test whose fixtures cannot travel (the call raises that error,
# as before). A task sent whose call never came is waited for in teardown, so that the ranks
# are free (and judged trustworthy or not) before the next test.
_sent_key = pytest.StashKey["Any"]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    spec = _spec_of(item)
    if spec is None:
        refuse_outside_distributed_tests(item)
        return (yield)
    fail_if_refused(item)
    from fsdp_testing.launcher import UnavailableBackend, resolve_backend

    try:
        resolve_backend(spec, item.config.stash[_settings_key].backend)
    except UnavailableBackend as exc:
        pytest.skip(str(exc))
    job = _job()
    if job is not None and spec.mode is Mode.PROCESS and spec.world_size > job.world_size:
        pytest.skip(
            f"{job.describe()} has world size {job.world_size}; the test needs "
            f"{spec.world_size} (start the job with at least {spec.world_size} processes)"
        )
    result = yield  # the fixtures; a failure or skip among them raises here
    _send_ahead(item, spec)
    return result


def _send_ahead(item: pytest.Item, spec: DistSpec) -> None:
    """See [Note: a test sent at the end of its setup]."""
    config = item.config
    if (
        spec.mode is not Mode.PROCESS
        or type(item) is not pytest.Function  # not unittest's, whose runtest is its own
        or config.getoption("setuponly", False)
        or config.getoption("setupplan", False)
        or item.get_closest_marker("no_dist_pool") is not None
    ):
        return
    bridge = config.stash.get(_timeouts_key, None)
    if bridge is not None and bridge.func_only_pending(item):
        return  # pytest-timeout times the call only: its limit is known there
    try:
        task = build_task(item, portable=True)
    except TypeError:
        return  # raised again by the call, where it belongs
    from fsdp_testing.launcher import send_ahead

    limit = _open_harness_window(item, spec)
    sent = send_ahead(task, spec, config.stash[_settings_key], limit=limit)
    if sent is not None:
        item.stash[_sent_key] = sent
    else:
        _close_harness_window(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    sent = item.stash.get(_sent_key, None)
    if sent is not None:  # its call never came: see [Note: a test sent at the end of its setup]
        del item.stash[_sent_key]
        try:
            sent.verdict()
        finally:
            _close_harness_window(item)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = _spec_of(pyfuncitem)
    from fsdp_testing._report.expectation import expectation_of

    expect = expectation_of(pyfuncitem.obj)
    if spec is None:
        if expect is not None:
            pytest.fail(
                f"{pyfuncitem.nodeid}: faults.expect(...) judges the report of a distributed "
                "test; add @pytest.mark.distributed(world_size=N) or remove it",
                pytrace=False,
            )
        return None
    from fsdp_testing.launcher import VerdictOutcome, get_launcher, run_distributed

    sent = pyfuncitem.stash.get(_sent_key, None)
    debugging = sys.modules.get("fsdp_testing._integrations.debugging")
    if debugging is not None:
        debugging.first_failure()  # forget an earlier test's
        if _pdb_dir_key in pyfuncitem.config.stash and sent is None:
            debugging.forget_sessions(pyfuncitem.config.stash[_pdb_dir_key])
    try:
        if sent is not None:  # see [Note: a test sent at the end of its setup]
            del pyfuncitem.stash[_sent_key]
            verdict = sent.verdict(expect)
        else:
            portable = get_launcher(spec.mode).crosses_processes
            fresh = pyfuncitem.get_closest_marker("no_dist_pool") is not None
            try:
                task = build_task(pyfuncitem, portable=portable)
            except NotPortable as exc:  # the message alone, as the test's error
                raise pytest.fail.Exception(str(exc), pytrace=False) from None
            with _rank_thread_breakpoints(pyfuncitem.config, portable):
                verdict = run_distributed(
                    task,
                    spec,
                    pyfuncitem.config.stash[_settings_key],
                    pool=False if fresh else None,
                    expect=expect,
                    limit=_open_harness_window(pyfuncitem, spec),
                )
    finally:
        _close_harness_window(pyfuncitem)
    if debugging is not None and verdict.outcome is VerdictOutcome.FAILED:
        error = debugging.first_failure()
        if error is not None:
            pyfuncitem.stash[_rank_error_key] = error
    note = pyfuncitem.stash.get(_limit_note_key, None)
    if note is not None and verdict.outcome is VerdictOutcome.FAILED:
        verdict.message += f"\n\n({note})"
    _add_rank_properties(pyfuncitem, verdict.outcome is VerdictOutcome.FAILED)
    for text in verdict.notes:  # e.g. the ranks were replaced: shown in pytest's warnings
        path, line, _ = pyfuncitem.location
        warnings.warn_explicit(f"fsdp_testing: {text}", RuntimeWarning, path, (line or 0) + 1)
    for title, content in verdict.sections:
        pyfuncitem.add_report_section("call", title, content)
    if verdict.outcome is VerdictOutcome.FAILED:
        pyfuncitem.stash[_headline_key] = verdict.message.split("\n", 1)[0]
        pytest.fail(verdict.message, pytrace=False)
    elif verdict.outcome is VerdictOutcome.SKIPPED:
        pytest.skip(verdict.message)
    elif verdict.outcome is VerdictOutcome.XFAILED:
        pytest.xfail(verdict.message)
    return True
