"""The main loop of one rank process in process mode.

A rank is forked from the fork server (``fork_server.py``) with torch already imported. It joins
the process group once, then serves tasks from the parent until told to stop: see
[Note: warm pool isolation] in ``pool.py`` for what is reset between tasks, and
[Note: pool protocol] in ``fsdp_testing/_protocol.py`` for the messages.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import functools
import importlib
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.connection import Connection

from fsdp_testing._integrations import debugging, rank_coverage
from fsdp_testing._protocol import (
    ENGINE_ENV,
    GenerationSpec,
    RankHello,
    RankInitFailed,
    RankMessage,
    RankReady,
    RankReset,
    RankResult,
    Stop,
)
from fsdp_testing._rank import comm_observer, fixtures
from fsdp_testing._rank.capture import install_router
from fsdp_testing._rank.context import RankContext
from fsdp_testing._rank.run_task import run_task
from fsdp_testing._rank.state_reset import RankState
from fsdp_testing._report import collective_log, failure

__all__ = [
    "IMPORTS_SIGNAL",
    "STACK_SIGNAL",
    "ImportWatch",
    "connect",
    "die_with_parent",
    "imports_file",
    "parent_modules",
    "preload",
    "preload_modules",
    "preloadable",
    "serve",
]

STACK_SIGNAL = signal.SIGUSR1
IMPORTS_SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGUSR2) + (
    1 if hasattr(signal, "SIGRTMIN") else 0
)
"""Asks a rank about to be stopped to write the modules it imported (see [Note: importing is not
hanging] in ``fsdp_testing/_report/imports.py``)."""


def imports_file(gen_dir: str, rank: int) -> str:
    """Where a rank writes the preloadable modules it imported, one per line."""
    return os.path.join(gen_dir, f"imports{rank}.txt")


"""The parent sends this to a rank to have it dump every thread's stack into its log."""


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits, so no rank outlives a test
    session that was killed (best effort elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        except OSError:  # pragma: no cover - no libc: rely on the parent's shutdown
            pass


def preload() -> None:
    """Import what every rank needs, in the process that forks ranks (the fork server, a job's
    slot), so that the ranks start warm. A rank forked without it imports pytest (every test
    module does) and its assertion rewriting while it runs its first test, inside that test's
    timeout: about 0.2 s of CPU, seconds on a loaded machine."""
    import _pytest._code
    import _pytest.assertion.rewrite  # noqa: F401
    import pytest  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401


# [Note: preloading what ranks import]
# Beyond ``preload()``, what a rank needs depends on the tests: DTensor, torch's FSDP, dynamo
# (which DTensor and FSDP reach for lazily) and fsdp_core cost about 5 s of CPU to import, and
# every generation of ranks paid it again, each rank inside its first test's timeout. So each
# rank reports the modules of ``PRELOADED_PACKAGES`` it imported (``ImportWatch``, with each
# ``RankResult``), the parent passes all it has heard of to the next generation
# (``GenerationSpec.preload``), and the process that forks that generation (the fork server, a
# job's slot) imports them first (``preload_modules``): they are imported once per forking
# process, not once per rank per generation. torch's test utilities are left out: importing
# ``torch.testing._internal`` changes global state (it disables torch's backend flags), which
# would then hold in every later rank, also for tests that never import them. Importing starts
# no thread (a process is safe to fork only while it runs one), checked by the tests.

PRELOADED_PACKAGES = ("torch", "fsdp_core")
# torch.utils.cpp_extension asks CUDA for its devices when it is imported (torch 2.15's CUDA
# build, with a CUDA toolkit installed): imported by the fork server, it made every rank forked
# after it fail with "Cannot re-initialize CUDA in forked subprocess" (issue 49). It is never
# preloaded, and no other module is either if importing it asks CUDA anything: see
# [Note: no CUDA before a fork].
NOT_PRELOADED = ("torch.testing._internal", "torch.utils.cpp_extension")

# [Note: no CUDA before a fork]
# Once a process has asked the CUDA driver anything (``torch.cuda.is_available()`` and
# ``device_count()`` included, in a CUDA build, on a machine with or without a GPU), torch marks
# every process forked from it as unable to use CUDA. A module that asks at import time must not
# be imported by a process that forks ranks. Which modules do depends on the torch version and
# build, so instead of a list, ``preload_modules`` imports under ``_no_cuda_questions``: the
# functions of ``torch.cuda`` and ``torch.accelerator`` that reach the driver raise
# ``_CudaAsked`` meanwhile (a BaseException, so that a module's ``except Exception`` cannot
# swallow it and go on with a wrong answer cached). The import fails, Python drops the
# half-imported modules, and the module is left to the ranks, which import it after the fork.
_CUDA_QUESTIONS = {
    "torch.cuda": (
        "is_available",
        "device_count",
        "init",
        "_lazy_init",
        "is_bf16_supported",
        "get_device_capability",
        "get_device_properties",
        "get_device_name",
        "current_device",
        "set_device",
    ),
    "torch.accelerator": ("is_available", "device_count", "current_device_index"),
    "torch._C": ("_cuda_getDeviceCount", "_cuda_init", "_accelerator_getDeviceCount"),
}


class _CudaAsked(BaseException):
    """Raised by a CUDA question while the forking process preloads modules."""


def _no_cuda_questions() -> contextlib.ExitStack:
    import torch  # preload() has imported it

    refusing = [True]  # a module that bound a refusing function keeps one that works after

    def refusing_copy(original: Callable[..., object], name: str) -> Callable[..., object]:
        @functools.wraps(original)
        def refuse(*args: object, **kwargs: object) -> object:
            if refusing[0]:
                raise _CudaAsked(f"it calls {name}() when it is imported")
            return original(*args, **kwargs)

        return refuse

    stack = contextlib.ExitStack()
    stack.callback(refusing.__setitem__, 0, False)
    for owner_name, names in _CUDA_QUESTIONS.items():
        owner = sys.modules.get(owner_name) or getattr(torch, owner_name.split(".")[1], None)
        for name in names:
            original = getattr(owner, name, None)
            if original is None:  # not in this torch, or not in this build
                continue
            setattr(owner, name, refusing_copy(original, f"{owner_name}.{name}"))
            stack.callback(setattr, owner, name, original)
    return stack


def preloadable(name: str) -> bool:
    """Whether the forking process imports module ``name`` once a rank has imported it."""
    package = name.partition(".")[0]
    if package not in PRELOADED_PACKAGES:
        return False
    return not any(name == skip or name.startswith(skip + ".") for skip in NOT_PRELOADED)


class ImportWatch:
    """The preloadable modules this process imported since the last call to ``new()``."""

    def __init__(self) -> None:
        self._seen = len(sys.modules)

    def new(self) -> tuple[str, ...]:
        if len(sys.modules) == self._seen:  # the common case, in O(1)
            return ()
        names = list(sys.modules)[self._seen :]  # dicts keep insertion order
        self._seen = len(sys.modules)
        return tuple(name for name in names if preloadable(name))


# Modules whose first use imports ``torch._dynamo`` (and sympy, torch.fx, ...: some 180 modules,
# 0.7 s of CPU on an idle machine, seconds per rank on a busy one), measured on torch 2.13: a
# DDP forward, ``fully_shard``, a DTensor op, ``parallelize_module``. A parent that imported one
# of them will have ranks that import dynamo in their first test.
_FIRST_USE_IMPORTS_DYNAMO = (
    "torch.nn.parallel.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "fsdp_core",
)


def parent_modules() -> tuple[str, ...]:
    """What ranks will import, as this process (the pytest session, after collecting) knows it:
    its own preloadable modules, in the order it imported them (a rank imports the test modules,
    so their imports too), and ``torch._dynamo`` where one of them imports it on first use."""
    names = [name for name in list(sys.modules) if preloadable(name)]
    if "torch._dynamo" not in sys.modules and any(
        m in sys.modules for m in _FIRST_USE_IMPORTS_DYNAMO
    ):
        names.append("torch._dynamo")
    return tuple(names)


def preload_modules(names: Iterable[str], *, beat: Callable[[], None] | None = None) -> None:
    """Import each of ``names`` not yet imported, in order (a rank's import order: a package
    before its submodules). One that fails is left to the ranks, which will say why.

    ``beat``: called every 0.1 s from a thread meanwhile (a job's slot stays alive for the
    coordinator); the thread has ended when this returns, so the caller may fork.
    """
    names = [n for n in names if n not in sys.modules and n not in _FAILED and preloadable(n)]
    if not names:
        return
    done = threading.Event()
    beater = None
    if beat is not None:
        beater = threading.Thread(target=_beat_until, args=(done, beat), daemon=True)
        beater.start()
    try:
        with _no_cuda_questions():
            for name in names:
                if name in sys.modules:  # imported with an earlier one
                    continue
                try:
                    importlib.import_module(name)
                except _CudaAsked as exc:
                    _FAILED.add(name)
                    print(
                        f"fsdp_testing: not preloaded: {name} ({exc}: a rank forked after it "
                        "could not use CUDA; the ranks import it themselves)"
                    )
                except Exception as exc:  # e.g. a module made at run time, with no file
                    _FAILED.add(name)  # not tried again
                    print(f"fsdp_testing: not preloaded: {name} ({type(exc).__name__}: {exc})")
    finally:
        done.set()
        if beater is not None:
            beater.join()


_FAILED: set[str] = set()
"""Modules ``preload_modules`` could not import in this process."""


def _beat_until(done: threading.Event, beat: Callable[[], None]) -> None:
    while not done.wait(0.1):
        beat()


def connect(address: str) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return Connection(sock.detach())


def serve(
    *,
    rank: int,
    spec: GenerationSpec,
    join: Callable[[int, GenerationSpec], RankContext] | None = None,
) -> None:
    """Join the process group as ``rank`` and run tasks from the parent; never returns.
    ``join`` makes the group (default: a ``FileStore`` in the generation's folder; a job across
    nodes joins through its ``TCPStore``, see ``job_slot.py``)."""
    die_with_parent()
    # See [Note: coverage on rank processes] in ``_integrations/rank_coverage.py``.
    rank_coverage.start_in_rank(rank)
    debugging.serve_rank(spec.gen_dir, rank)  # see [Note: debugging a rank]
    log_path = os.path.join(spec.gen_dir, f"rank{rank}.log")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    log = open(1, "w", buffering=1, closefd=False)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=log, all_threads=True, chain=False)

    conn = connect(spec.address)
    conn.send(RankHello(rank, os.getpid()))
    try:
        ctx = (join or _join)(rank, spec)
    except BaseException:
        conn.send(RankInitFailed(rank, traceback.format_exc()))
        os._exit(1)
    if os.environ.get(ENGINE_ENV):
        from fsdp_testing.engines import set_default_engine

        set_default_engine(os.environ[ENGINE_ENV])
    recorder = collective_log.FlightRecorder(path=os.path.join(spec.gen_dir, f"rank{rank}.flight"))

    def flight_log() -> collective_log.FlightRecorder:
        return recorder

    comm_observer.install(flight_log)
    router = install_router(tee=log)
    failure.format_in_parent()  # kept as Pending: formatted after the result is sent, below
    import torch.distributed as dist

    imports = ImportWatch()

    def write_imports(signum: int, frame: object) -> None:
        # Python code between two bytecodes of whatever the rank runs (an import, most likely):
        # small, and no locks shared with it.
        with open(imports_file(spec.gen_dir, rank), "a") as f:
            f.write("".join(name + "\n" for name in imports.new()))

    signal.signal(IMPORTS_SIGNAL, write_imports)
    state = RankState()  # after every handler the harness sets: a reset keeps them

    conn.send(RankReady(rank, os.getpid()))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        recorder.reset()
        try:
            task = pickle.loads(payload)
            comm_observer.install(flight_log)  # process group classes the test defines
            state.test_begins()
        except BaseException:
            result = RankResult.harness_failure(
                rank,
                "the task could not be unpickled on the rank: an argument of the test (fixture, "
                "parameter or test class instance) does not import in a fresh process; build it "
                "inside the test body or use mode='thread'",
            )
        else:
            if isinstance(task, Stop):
                fixtures.tear_down_scoped()  # see [Note: fixtures on the ranks]
                os._exit(0)
            result = run_task(task, ctx, router)
        if not dist.is_initialized():
            result.needs_restart = True
        left = state.left_running()
        if left:  # nothing undoes a running thread: this rank is replaced
            result.needs_restart = True
            result.notes = (
                f"the test left {len(left)} thread(s) running ({', '.join(left[:3])}"
                f"{', ...' if len(left) > 3 else ''}); its ranks were replaced, so the next test "
                "runs on fresh ones",
            )
        result.imported = imports.new()
        rank_coverage.save_in_rank()  # before the parent, told of a failure, may kill this rank
        pending, result.pending = result.pending, None
        result.message_follows = pending is not None
        try:
            conn.send(result)
            if pending is not None:  # see [Note: a rank's report is written off the clock]
                conn.send(RankMessage(rank, _formatted(pending)))
        except (OSError, pickle.PicklingError):
            os._exit(0)
        if result.needs_restart:
            os._exit(0)
        # The reset runs while the parent reports this test and sets up the next one, off
        # the test's own time (see [Note: warm pool isolation] in ``pool.py``). The parent,
        # just woken by the result, gets this processor first: on a machine with fewer cores
        # than ranks + 1 it otherwise waits for the reset (per test, about 15% of the round
        # trip on two cores, measured with benchmarks/harness_overhead.py's test).
        os.sched_yield()
        try:
            state.restore()
        except BaseException:
            conn.send(RankReset(rank, traceback.format_exc()))
            os._exit(1)
        try:
            conn.send(RankReset(rank))
        except OSError:
            pass  # the parent ended this generation: its Stop waits to be read, below


def _formatted(pending: failure.Pending) -> str:
    """The traceback of a failure kept for after the result (never raises: a rank must answer)."""
    try:
        return pending.format()
    except BaseException as exc:  # any error here is reported, not raised
        error = f"{type(pending.exc).__name__}: {pending.exc}"
        return f"{error}\n(formatting its traceback failed: {exc!r})"


def _join(rank: int, spec: GenerationSpec) -> RankContext:
    import torch
    import torch.distributed as dist

    world_size, backend = spec.world_size, spec.backend
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the machine's cores; oversubscribing them makes every test slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    store = dist.FileStore(os.path.join(spec.gen_dir, "store"), world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=spec.pg_timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return RankContext(
        rank=rank,
        world_size=world_size,
        process_group=dist.group.WORLD,
        device=device,
        dist_backend=backend,
    )
