"""The other plugins a CI commonly runs (issue 43): pytest-rerunfailures (a rerun gets a fresh
world), pytest-randomly (per-rank seeds, deterministic and printed), pytest-repeat's
``--count``, ``--lf``/``--ff``, ``-p no:fsdp_testing``, and ``--junitxml`` with one property
per rank. See fsdp_testing/_integrations/seeds.py and rank_properties.py."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest


def _properties(xml: Path) -> dict[str, dict[str, str]]:
    """Each testcase's properties, by ``module.test_name``."""
    return {
        f"{case.get('classname')}.{case.get('name')}": {
            p.get("name", ""): p.get("value", "") for p in case.iter("property")
        }
        for case in ET.parse(xml).getroot().iter("testcase")
    }


def test_a_rerun_gets_a_fresh_world(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        from pathlib import Path

        import pytest
        import torch.distributed as dist

        RUNS = Path(__file__).with_name("runs.txt")
        LEFT_BY_A_RUN = []  # per rank process: a warm rank would keep it


        @pytest.mark.distributed(world_size=2)
        def test_flaky(rank):
            first = not RUNS.exists() or len(RUNS.read_text().splitlines()) < 2
            dist.barrier()
            with RUNS.open("a") as f:
                f.write(f"{rank} {os.getpid()} {len(LEFT_BY_A_RUN)}\\n")
            LEFT_BY_A_RUN.append(rank)
            assert not first, "fails on its first run"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--reruns", "1")
    result.assert_outcomes(passed=1)
    assert result.parseoutcomes()["rerun"] == 1
    runs = [line.split() for line in (pytester.path / "runs.txt").read_text().splitlines()]
    first, rerun = runs[:2], runs[2:]
    assert len(rerun) == 2
    # New rank processes, which never saw the first run.
    assert {pid for _, pid, _ in first}.isdisjoint({pid for _, pid, _ in rerun})
    assert all(left == "0" for _, _, left in rerun)


SEEDED = """
import random

import pytest
import torch.distributed as dist


@pytest.mark.distributed(world_size=2{mode})
def test_draws(rank):
    print(f"rank {{rank}} draws {{random.random()!r}}")
    dist.barrier()
    assert False, "shows the output"
"""


def test_randomly_seeds_each_rank_deterministically_and_says_how(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_process=SEEDED.format(mode=""), test_thread=SEEDED.format(mode=', mode="thread"')
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "randomly", "--randomly-seed=5", "--junitxml=out.xml"
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "Using --randomly-seed=5",
            "fsdp_testing: pytest-randomly reseeds each rank before a distributed test: random "
            "and numpy with (5 + crc32('<test id>@rank<N>')) mod 2**32",
        ]
    )
    output = result.stdout.str()
    properties = _properties(pytester.path / "out.xml")
    for module in ("test_process", "test_thread"):
        test_id = f"{module}.py::test_draws"
        draws = set()
        for rank in (0, 1):
            seed = (5 + zlib.crc32(f"{test_id}@rank{rank}".encode())) % 2**32
            # What the rank drew is the first number of its own seed: reproducible from the
            # session's seed alone, and another number on each rank.
            draw = random.Random(seed).random()
            assert f"rank {rank} draws {draw!r}" in output, (module, rank, output)
            assert f"rank {rank} seed: {seed}" in output  # the failure's "per-rank seeds"
            assert properties[f"{module}.test_draws"][f"rank {rank} seed"] == str(seed)
            draws.add(draw)
        assert len(draws) == 2


def test_randomly_under_torchrun_seeds_the_ranks_with_the_given_seed(tmp_path: Path) -> None:
    # Every process of a launched job runs pytest-randomly: with --randomly-seed=N they agree,
    # and each rank (forked by its own process) reseeds from N.
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed")
    (tmp_path / "test_job.py").write_text(SEEDED.format(mode=""))
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    pytest_args = ["-p", "no:cacheprovider", "-p", "randomly", "--randomly-seed=5", "test_job.py"]
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pytest", *pytest_args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "1 failed" in proc.stdout, proc.stdout + proc.stderr
    for rank in (0, 1):
        seed = (5 + zlib.crc32(f"test_job.py::test_draws@rank{rank}".encode())) % 2**32
        assert f"rank {rank} draws {random.Random(seed).random()!r}" in proc.stdout, proc.stdout
        assert f"rank {rank} seed: {seed}" in proc.stdout


def test_randomly_off_leaves_the_ranks_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_process=SEEDED.format(mode=""))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "randomly", "-p", "no:randomly"
    )
    result.assert_outcomes(failed=1)
    assert "reseeds each rank" not in result.stdout.str()
    assert "per-rank seeds" not in result.stdout.str()


def test_repeat_count_runs_each_distributed_test_again(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch
        import torch.distributed as dist


        @pytest.mark.distributed(world_size=[2, 3])
        def test_sum(rank, world_size):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world_size


        @pytest.mark.distributed(world_size=2, mode="thread")
        def test_thread(rank):
            dist.barrier()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--count", "2", "-v")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines_random(
        [
            "*::test_sum[[]ws2-1-2[]] PASSED*",
            "*::test_sum[[]ws2-2-2[]] PASSED*",
            "*::test_sum[[]ws3-1-2[]] PASSED*",
            "*::test_sum[[]ws3-2-2[]] PASSED*",
            "*::test_thread[[]1-2[]] PASSED*",
            "*::test_thread[[]2-2[]] PASSED*",
        ]
    )


def test_last_failed_and_failed_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist


        @pytest.mark.distributed(world_size=2)
        def test_a_passes(rank):
            dist.barrier()


        @pytest.mark.distributed(world_size=2)
        def test_b_fails_on_rank_one(rank):
            dist.barrier()
            assert rank == 0


        @pytest.mark.distributed(world_size=[2, 3], mode="thread")
        def test_c_passes(rank):
            dist.barrier()
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=3, failed=1)
    last_failed = pytester.runpytest_subprocess("--lf", "-v")
    last_failed.assert_outcomes(failed=1)  # and nothing else ran
    failed_first = pytester.runpytest_subprocess("--ff", "-v")
    failed_first.assert_outcomes(passed=3, failed=1)
    ran = [line for line in failed_first.stdout.lines if re.search(r"(PASSED|FAILED) +\[", line)]
    assert "test_b_fails_on_rank_one FAILED" in ran[0], ran


def test_without_the_plugin_distributed_tests_error_and_the_rest_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import pytest


        @pytest.mark.distributed(world_size=2)
        def test_distributed(rank):
            pass


        def test_plain():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:fsdp_testing")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'rank' not found*"])
    assert "fsdp_testing" not in result.stdout.str().split("plugins:")[1].splitlines()[0]


def test_junitxml_has_one_property_per_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os

        import pytest
        import torch
        import torch.distributed as dist


        @pytest.mark.distributed(world_size=2)
        def test_passes(rank):
            dist.barrier()


        @pytest.mark.distributed(world_size=2)
        def test_fails_on_rank_one(rank):
            dist.barrier()
            assert rank == 0, "rank one is wrong"


        @pytest.mark.distributed(world_size=2)
        def test_rank_one_dies(rank):
            if rank == 1:
                os._exit(3)
            dist.all_reduce(torch.ones(1))


        @pytest.mark.distributed(world_size=2, mode="thread")
        def test_records_on_thread_ranks(rank, record_property):
            record_property(f"seen by rank {rank}", rank * 10)


        @pytest.mark.distributed(world_size=2)
        def test_records_on_process_ranks(rank, record_property):
            record_property("never", 1)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--junitxml=out.xml")
    result.assert_outcomes(passed=2, failed=3)
    properties = {
        name.split(".", 1)[1]: props
        for name, props in _properties(pytester.path / "out.xml").items()
    }
    assert re.fullmatch(r"passed in \d+\.\d{3} s", properties["test_passes"]["rank 0"])
    assert re.fullmatch(r"passed in \d+\.\d{3} s", properties["test_passes"]["rank 1"])
    failing = properties["test_fails_on_rank_one"]
    assert failing["rank 0"].startswith("passed in ")
    assert re.fullmatch(
        r"failed in \d+\.\d{3} s: AssertionError: rank one is wrong.*", failing["rank 1"]
    )
    dead = properties["test_rank_one_dies"]
    assert dead["rank 1"] == "died: exited with code 3", dead
    assert re.fullmatch(r"failed in \d+\.\d{3} s \(broken by a peer\): .*", dead["rank 0"]), dead
    recorded = properties["test_records_on_thread_ranks"]
    assert recorded["seen by rank 0"] == "0" and recorded["seen by rank 1"] == "10"
    result.stdout.fnmatch_lines(
        [
            # The test's error, the message alone (no harness frames, no "E   TypeError").
            "test_junitxml_has_one_property_per_rank.py::"
            "test_records_on_process_ranks: record_property records into the pytest process's "
            "report and cannot be called on a process-mode rank. Each rank's ending is recorded "
            "already (junitxml properties 'rank N'); call it from a fixture of the test, which "
            "runs in the pytest process, or use mode='thread'"
        ]
    )
