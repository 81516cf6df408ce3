"""The warm pool: ranks are reused between tests, and nothing one test does reaches the next
(see [Note: warm pool isolation] in fsdp_testing/_launch/pool.py)."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from fsdp_testing._launch.socket_root import socket_root

from .._scenario import Run, processes_tagged, run_scenario


def _pids(record: Path) -> dict[str, set[int]]:
    pids: dict[str, set[int]] = {}
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        pids.setdefault(entry["test"], set()).add(entry["pid"])
    return pids


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, set[int]]]:
    work = tmp_path_factory.mktemp("pooled")
    record = work / "record.jsonl"
    run = run_scenario(work, "test_isolation.py", env={"SCENARIO_RECORD": str(record)})
    return run, _pids(record)


def test_state_changes_do_not_reach_the_next_test(pooled: tuple[Run, dict]) -> None:
    run, _ = pooled
    case = run.cases["test_b_sees_fresh_state"]
    assert case.outcome == "passed", case.text


def test_ranks_are_reused_between_passing_tests(pooled: tuple[Run, dict]) -> None:
    _, pids = pooled
    assert pids["a"] == pids["b"] == pids["b2"] == pids["b3"] == pids["c"]


def test_a_new_group_after_a_reset_gets_a_fresh_name(pooled: tuple[Run, dict]) -> None:
    run, _ = pooled
    case = run.cases["test_b2_new_group_after_a_reset"]
    assert case.outcome == "passed", case.text


def test_a_group_named_by_its_ranks_is_made_again_in_the_next_test(
    pooled: tuple[Run, dict],
) -> None:
    run, _ = pooled
    case = run.cases["test_b4_group_named_by_its_ranks_again"]
    assert case.outcome == "passed", case.text


def test_dtensor_caches_forget_a_destroyed_group(pooled: tuple[Run, dict]) -> None:
    run, _ = pooled
    case = run.cases["test_b3_dtensor_on_a_new_group_over_the_same_ranks"]
    assert case.outcome == "passed", case.text


def test_pool_is_rebuilt_after_a_failure_with_a_stuck_peer(pooled: tuple[Run, dict]) -> None:
    run, pids = pooled
    assert run.cases["test_c_fails_with_stuck_peer"].outcome == "failed"
    assert run.cases["test_d_after_failure"].outcome == "passed"
    assert pids["d"].isdisjoint(pids["c"])


def test_a_test_that_fails_on_every_rank_leaves_the_next_one_new_ranks(
    pooled: tuple[Run, dict],
) -> None:
    """Rank 0's failed test left an all-reduce in flight: on the same ranks the next test's
    all-reduce would pair with it (rank 1 would sum the wrong values, rank 0 would hang)."""
    run, pids = pooled
    assert run.cases["test_o_fails_with_a_collective_in_flight"].outcome == "failed"
    case = run.cases["test_p_after_a_failure_on_every_rank"]
    assert case.outcome == "passed", case.text
    assert pids["p"].isdisjoint(pids["o"])


def test_pool_is_rebuilt_after_the_default_group_is_destroyed(pooled: tuple[Run, dict]) -> None:
    run, pids = pooled
    assert run.cases["test_f_after_destroy"].outcome == "passed", run.cases[
        "test_f_after_destroy"
    ].text
    assert pids["f"].isdisjoint(pids["e"])


def test_no_dist_pool_marker_gives_one_test_fresh_ranks(pooled: tuple[Run, dict]) -> None:
    run, pids = pooled
    assert run.cases["test_h_fresh"].outcome == "passed"
    assert pids["h"].isdisjoint(pids["g"]), "the marked test reused warm ranks"
    assert pids["i"] == pids["g"], "the warm pool should survive a fresh-process test"


def test_no_pool_option_starts_fresh_ranks_per_test(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    run = run_scenario(
        tmp_path,
        "test_isolation.py",
        "--no-dist-pool",
        "-k",
        "a_changes or b_sees",
        env={"SCENARIO_RECORD": str(record)},
    )
    assert run.cases["test_b_sees_fresh_state"].outcome == "passed"
    pids = _pids(record)
    assert pids["a"].isdisjoint(pids["b"])
    assert processes_tagged(run.tag) == []


def test_a_longer_timeout_gets_a_process_group_that_waits_as_long(
    pooled: tuple[Run, dict],
) -> None:
    run, pids = pooled
    case = run.cases["test_k_longer_timeout_on_the_same_world"]
    assert case.outcome == "passed", case.text
    assert pids["k"].isdisjoint(pids["j"]), "ranks with a 40 s group timeout were reused"
    assert pids["l"] == pids["k"], "a shorter timeout should reuse the longer-lived ranks"


def test_ranks_that_cannot_reset_are_replaced_with_a_warning(pooled: tuple[Run, dict]) -> None:
    """A rank resets itself after it has sent its result; one that cannot says why and exits,
    and the next test runs on new ranks and carries the rank's traceback as a warning."""
    run, pids = pooled
    assert run.cases["test_m_breaks_the_reset_after_it"].outcome == "passed"
    case = run.cases["test_n_after_a_broken_reset"]
    assert case.outcome == "passed", case.text
    assert pids["n"].isdisjoint(pids["m"])
    assert "could not reset their state after the last test" in run.stdout
    assert "RuntimeError: reset broken on purpose" in run.stdout


_CLEAR_DTENSOR_CACHES = """
import sys
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.device_mesh import DeviceMesh
from fsdp_testing._rank.state_reset import _forget_dtensor_meshes

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
x = DTensor.from_local(torch.ones(4), mesh, (Shard(0),))
propagator = DTensor._op_dispatcher.sharding_propagator
(x * 2).full_tensor()  # the C++ fast path caches this one; the Python cache backs other paths:
python_cache = type(propagator.propagate_op_sharding)(lambda schema: schema)  # torch's class
propagator.propagate_op_sharding = python_cache
python_cache("a schema")
assert python_cache.cache_info().currsize == 1
fast_path_stats = torch._C._get_DTensor_sharding_propagator_cache_stats  # (hits, misses)
hits, misses = fast_path_stats()
(x * 2).full_tensor()
assert fast_path_stats() == (hits + 1, misses), "not cached"
_forget_dtensor_meshes()
assert python_cache.cache_info().currsize == 0, "the Python cache kept its entries"
(x * 2).full_tensor()
assert fast_path_stats() != (hits + 2, misses), "the fast path's cache kept its entry"
assert "torch.distributed.tensor.debug" not in sys.modules, "the reset imported the debug module"
dist.destroy_process_group()
print("ok")
"""


def test_the_dtensor_cache_reset_clears_both_caches_without_importing_torchs_debug_module() -> None:
    """Importing ``torch.distributed.tensor.debug`` costs about 1.7 s of CPU (torch's memory
    and runtime estimators): every new rank paid it at its first reset after a DTensor test."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CLEAR_DTENSOR_CACHES],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_new_ranks_start_with_the_modules_earlier_ranks_imported(pooled: tuple[Run, dict]) -> None:
    """See [Note: preloading what ranks import] in fsdp_testing/_launch/rank_process.py."""
    run, pids = pooled
    assert run.cases["test_q_imports_a_module"].outcome == "passed"
    assert run.cases["test_r_fails_on_every_rank"].outcome == "failed"
    case = run.cases["test_s_new_ranks_start_with_what_earlier_ranks_imported"]
    assert case.outcome == "passed", case.text
    assert pids["s"].isdisjoint(pids["q"])


_REPORT = """
import json
from fsdp_testing._launch.rank_process import ImportWatch, preload

preload()
watch = ImportWatch()
import torch.distributed.tensor, torch.distributed.fsdp, torch._dynamo, fsdp_core, json.tool
import torch.testing._internal.common_utils
names = watch.new()
assert watch.new() == ()
print(json.dumps(names))
print("ok")
"""

_PRELOAD = """
import json, os, sys, time
from fsdp_testing._launch.rank_process import preload, preload_modules

def threads():
    return len(os.listdir("/proc/self/task"))

preload()
before = threads()
beats = []  # a job's slot beats while it preloads
extra = [
    "torch.testing._internal.common_utils",
    "json.tool",
    "torch.not_a_module",
    "torch.utils.cpp_extension",  # asks CUDA for devices on import: never before a fork
]
preload_modules([*json.loads(sys.argv[1]), *extra], beat=lambda: beats.append(threads()))
assert beats and min(beats) == before + 1, beats  # called from one thread of its own
preload_modules(["torch.not_a_module"])  # not tried again: it says so once
assert "torch.distributed.tensor" in sys.modules and "torch._dynamo" in sys.modules
assert "fsdp_core" in sys.modules
assert "torch.testing._internal.common_utils" not in sys.modules and "json.tool" not in sys.modules
assert "torch.utils.cpp_extension" not in sys.modules
import torch
assert not torch.cuda.is_initialized()  # a rank forked now can use CUDA
# join() returns once the beat's Python code is done; its OS thread exits a moment later
# (a fork copies only the calling thread either way), so give /proc a second to see it gone.
deadline = time.monotonic() + 1.0
while threads() != before and time.monotonic() < deadline:
    time.sleep(0.01)
assert threads() == before, f"{threads()} threads after preloading, {before} before"
print("ok")
"""


def test_ranks_report_what_they_imported_and_preloading_it_starts_no_thread() -> None:
    """What a rank reports: modules of torch and fsdp_core, not torch's test utilities (their
    import changes global state). A fork copies one thread: preloading must leave none (its
    beat, for a job's slot, runs in a thread that has ended when it returns). A module that
    does not import is said once and not tried again."""
    import subprocess
    import sys

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
            done.stdout + done.stderr
        )
        return done.stdout

    names = json.loads(run(_REPORT).splitlines()[-2])
    assert "torch.distributed.tensor" in names and "fsdp_core" in names, names
    assert all(n.partition(".")[0] in ("torch", "fsdp_core") for n in names), names
    assert not [n for n in names if n.startswith("torch.testing._internal")], names
    said = run(_PRELOAD, json.dumps(names))
    assert said.count("not preloaded: torch.not_a_module (ModuleNotFoundError") == 1, said


_ASKS_CUDA = """
import json, sys
import torch
from fsdp_testing._launch import rank_process

rank_process.PRELOADED_PACKAGES = (*rank_process.PRELOADED_PACKAGES, "asks_cuda", "binds_cuda")
is_available = torch.cuda.is_available
rank_process.preload()
rank_process.preload_modules(["asks_cuda", "binds_cuda", "torch.distributed.tensor"])
assert "asks_cuda" not in sys.modules and "asks_cuda.inner" not in sys.modules, sorted(sys.modules)
assert "binds_cuda" in sys.modules and "torch.distributed.tensor" in sys.modules
assert torch.cuda.is_available is is_available  # put back
import binds_cuda
assert binds_cuda.count() == torch.cuda.device_count()  # what it bound works after preloading
import asks_cuda  # a rank imports it after the fork, with CUDA as it is
assert asks_cuda.inner.HAS_CUDA == torch.cuda.is_available()
print("ok")
"""


def test_a_module_that_asks_cuda_on_import_is_not_preloaded(tmp_path: Path) -> None:
    """In a CUDA build, asking the driver anything (``torch.cuda.is_available()`` included)
    leaves every later fork unable to use CUDA, so the process that forks ranks must not import
    a module that asks at import time (torch 2.15's ``torch.utils.cpp_extension`` did, issue
    49). Such a module is left to the ranks, even when it catches ``Exception`` around the
    question (it must not cache a wrong answer); a module that only binds a CUDA function keeps
    one that works. In a CPU build nothing reaches a driver, but the same modules are refused,
    so this runs here."""
    import subprocess
    import sys

    (tmp_path / "asks_cuda").mkdir()
    (tmp_path / "asks_cuda" / "__init__.py").write_text("from asks_cuda import inner\n")
    (tmp_path / "asks_cuda" / "inner.py").write_text(
        "import torch\n"
        "try:\n"
        "    HAS_CUDA = torch.cuda.is_available()\n"
        "except Exception:\n"
        "    HAS_CUDA = None\n"
    )
    (tmp_path / "binds_cuda.py").write_text(
        "from torch.cuda import device_count\n\ndef count():\n    return device_count()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", _ASKS_CUDA],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    assert (
        "not preloaded: asks_cuda (it calls torch.cuda.is_available() when it is imported: a "
        "rank forked after it could not use CUDA" in done.stdout
    ), done.stdout


def test_a_temporary_directory_too_deep_for_a_socket_puts_the_launcher_in_a_short_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's scratch folder or a test's tmp_path can be too deep for an AF_UNIX address (108
    bytes on Linux): binding the pool's control socket there failed, so the launcher's folder
    goes to /tmp (or /dev/shm) instead, still private."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(OSError, match="AF_UNIX path too long"):
        socket.socket(socket.AF_UNIX).bind(str(deep / "fsdp-testing-abcdefgh" / "ctl.sock"))
    root, address = socket_root("fsdp-testing-")
    try:
        assert Path(address).parent == Path(root)
        assert Path(root).parent in (Path("/tmp"), Path("/dev/shm"))
        assert stat.S_IMODE(Path(root).stat().st_mode) == 0o700
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(address)
    finally:
        Path(address).unlink(missing_ok=True)
        Path(root).rmdir()
    shallow = tmp_path / "s"
    shallow.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shallow))
    root, _ = socket_root("fsdp-testing-")
    assert Path(root).parent == shallow
