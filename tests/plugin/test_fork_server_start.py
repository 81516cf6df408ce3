"""Where ranks come from (issue 49, point 6): one fork server for every xdist worker of a
session, started by the controller; started early and told what the ranks will import. See
[Note: one fork server for the xdist workers] in fsdp_testing/_launch/shared_fork_server.py
and [Note: starting the fork server early] in fsdp_testing/_launch/fork_link.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

_WORKER_CONFTEST = """
import os


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # what each worker sets for its own ranks
        os.environ["MY_WORKER"] = workerinput["workerid"]
        os.environ["MY_WORKER_PID"] = str(os.getpid())
"""


def test_xdist_workers_fork_their_ranks_from_one_server_in_their_own_environment(
    pytester: pytest.Pytester,
) -> None:
    """Before: each worker started a fork server (and imported torch and what its ranks
    needed) of its own. Now the controller starts one; each worker's ranks still run in that
    worker's environment (what its conftest, plugins and the harness set there)."""
    pytester.makeconftest(_WORKER_CONFTEST)
    pytester.makepyfile(
        """
        import json, os
        from pathlib import Path

        import pytest
        import torch
        import torch.distributed as dist


        @pytest.mark.parametrize("i", range(6))
        @pytest.mark.distributed(world_size=2)
        def test_where(rank, i):
            t = torch.ones(1)
            dist.all_reduce(t)
            server = os.getppid()
            with open(f"/proc/{server}/stat") as f:
                server_parent = int(f.read().rpartition(")")[2].split()[1])
            seen = {
                "worker": os.environ.get("MY_WORKER"),
                "xdist_worker": os.environ.get("PYTEST_XDIST_WORKER"),
                "worker_pid": os.environ.get("MY_WORKER_PID"),
                "server": server,
                "server_parent": server_parent,
            }
            out = Path(__file__).with_name(f"seen-{i}-{rank}.json")
            out.write_text(json.dumps(seen))
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    seen = [json.loads(p.read_text()) for p in sorted(pytester.path.glob("seen-*.json"))]
    assert len(seen) == 12
    assert {s["worker"] for s in seen} == {"gw0", "gw1"}, seen  # both workers ran tests
    for s in seen:
        assert s["worker"] == s["xdist_worker"], s  # the worker's own environment
        assert s["server_parent"] != int(s["worker_pid"]), s  # no worker started it
    assert len({s["server"] for s in seen}) == 1, seen  # one fork server for both


def test_first_ranks_start_with_what_the_test_module_and_its_first_use_import(
    pytester: pytest.Pytester,
) -> None:
    """The first generation's ranks are forked after the fork server imported what the
    session imported (the test module's imports) and torch._dynamo, which DDP, fully_shard and
    DTensor import on first use: before, each rank of each new generation imported them inside
    its first test (seconds of CPU per rank on a busy machine)."""
    pytester.makepyfile(
        """
        import sys

        import pytest
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel


        @pytest.mark.distributed(world_size=2)
        def test_first(rank):
            assert "torch._dynamo" in sys.modules  # forked with it
            assert "torch.nn.parallel.distributed" in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1)


def test_no_fork_server_when_the_tests_that_need_one_are_deselected(
    pytester: pytest.Pytester,
) -> None:
    """The fork server starts when collection meets a process-mode test; if every such test is
    deselected, it ends before the tests run (it would import torch for nothing)."""
    pytester.makeconftest(
        """
        import os


        def _children():
            pid = os.getpid()
            found = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    found += f.read().split()
            commands = []
            for child in found:
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        commands.append(f.read().replace(b"\\0", b" ").decode())
                except FileNotFoundError:
                    pass
            return commands


        def pytest_runtest_call(item):
            servers = [c for c in _children() if "fork_server" in c]
            assert not servers, servers
        """
    )
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.distributed(world_size=2)
        def test_ranks(rank):
            pass


        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-k", "plain")
    result.assert_outcomes(passed=1, deselected=1)


def test_the_fork_server_is_the_same_for_a_later_generation(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Started early, the session's own fork server (no xdist) still forks every generation:
    world sizes 2 and 4 come from one server."""
    pytester.makepyfile(
        f"""
        import os

        import pytest


        @pytest.mark.distributed(world_size=[2, 4])
        def test_server(rank, world_size):
            with open({str(tmp_path / "servers.txt")!r}, "a") as f:
                f.write(f"{{os.getppid()}}\\n")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=2)
    servers = (tmp_path / "servers.txt").read_text().split()
    assert len(servers) == 6 and len(set(servers)) == 1, servers


def test_n_auto_gives_one_worker_per_two_cores_and_none_below_four(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See [Note: how many xdist workers]: on two cores, -n 2 was slower than no -n."""
    from fsdp_testing._launch.shared_fork_server import auto_workers

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert [auto_workers(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [0, 0, 0, 2, 2, 4, 8]
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert auto_workers(16) is None  # xdist's own rule reads it


def test_n_auto_on_this_machine_and_the_header_for_more_workers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_testing._launch.shared_fork_server import auto_workers, usable_cores

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    pytester.makepyfile("def test_plain():\n    pass\n")
    expected = auto_workers()
    result = pytester.runpytest_subprocess("-n", "auto", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    if expected:
        result.stdout.fnmatch_lines([f"created: {expected}/{expected} workers"])
    else:
        result.stdout.no_fnmatch_line("created: *")
    more = (expected or 1) + 1
    result = pytester.runpytest_subprocess("-n", str(more), "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"fsdp_testing: {more} xdist workers on {usable_cores()} cores: *-n auto gives *"]
    )
