"""Options, ini keys, marker validation and fixture misuse (no ranks are started here)."""

from __future__ import annotations

import pytest


def test_help_lists_options_without_importing_torch(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import sys
        def pytest_unconfigure(config):
            with open("torch_imported.txt", "w") as f:
                f.write(str("torch" in sys.modules))
        """
    )
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(
        ["*--dist-timeout=SECONDS*", "*--dist-backend=NAME*", "*--no-dist-pool*"]
    )
    assert (pytester.path / "torch_imported.txt").read_text() == "False"


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--markers")
    result.stdout.fnmatch_lines(
        [
            "*distributed(world_size=2, *, backend=None, mode='process', timeout=None, faults=(), rank=None)*"
        ]
    )


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        (
            "distributed(2, 4)",
            "*malformed marker distributed(2, 4)*Accepted arguments: distributed(world_size=2, *, backend=None, mode='process', timeout=None, faults=(), rank=None)*",
        ),
        (
            "distributed(worldsize=2)",
            "*malformed marker*unexpected keyword argument 'worldsize'*Accepted arguments*",
        ),
        (
            "distributed(world_size=0)",
            "*distributed marker: world_size must be at least 1, got 0*",
        ),
        (
            "distributed(world_size=2, mode='mpi')",
            "*distributed marker: unknown mode 'mpi'; use one of process, thread, fake*",
        ),
        (
            "distributed(world_size=2, backend='ucc')",
            "*distributed marker: unknown backend 'ucc'*",
        ),
        (
            "distributed(world_size=2, timeout=-1)",
            "*distributed marker: timeout must be a positive number*",
        ),
        (
            "distributed(world_size='2')",
            "*distributed marker: world_size must be an int or a list of ints, got '2'*",
        ),
    ],
)
def test_bad_marker_is_a_clear_error(pytester: pytest.Pytester, marker: str, expected: str) -> None:
    pytester.makepyfile(
        f"""
        import pytest
        @pytest.mark.{marker}
        def test_x(rank):
            pass
        """
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines([expected])
    assert result.ret != 0


def test_thread_mode_rejects_a_backend(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.distributed(world_size=2, mode="thread", backend="gloo")
        def test_x(rank):
            pass
        """
    )
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        ["*mode='thread' runs on torch's threaded process group; backend='gloo' does not apply*"]
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--dist-timeout", "soon"],
            "*--dist-timeout / dist_timeout must be a positive number of seconds, got 'soon'*",
        ),
        (
            ["--dist-timeout", "0"],
            "*--dist-timeout / dist_timeout must be a positive number of seconds, got '0'*",
        ),
        (
            ["--dist-backend", "mpi"],
            "*--dist-backend / dist_backend must be gloo or nccl, got 'mpi'*",
        ),
    ],
)
def test_bad_option_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], expected: str
) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    result.stderr.fnmatch_lines(["ERROR: " + expected.lstrip("*")])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ndist_timeout = never\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*dist_timeout must be a positive number of seconds, got 'never'*"]
    )


@pytest.mark.parametrize(
    "fixture", ["rank", "world_size", "process_group", "device", "dist_backend"]
)
def test_rank_fixture_outside_distributed_test_names_the_marker(
    pytester: pytest.Pytester, fixture: str
) -> None:
    pytester.makepyfile(f"def test_x({fixture}): pass")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            f"*fixture '{fixture}' is only available in distributed tests: mark the test with @pytest.mark.distributed(*"
        ]
    )


def test_ini_timeout_applies(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ndist_timeout = 1.5\n")
    pytester.makepyfile(
        """
        import time, pytest
        @pytest.mark.distributed(world_size=2, mode="thread")
        def test_slow(rank):
            time.sleep(0.05 if rank else 5)
        """
    )
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(["*timed out after 1.5 s: rank 0 still running*"])


def test_fsdp_engine_option_selects_the_engine_on_the_ranks(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        from fsdp_testing.engines import current_engine

        @pytest.mark.distributed(world_size=2)
        def test_process(rank):
            assert current_engine().name == "torch_fsdp1"

        @pytest.mark.distributed(world_size=2, mode="thread")
        def test_thread(rank):
            assert current_engine().name == "torch_fsdp1"

        def test_parent():
            assert current_engine().name == "torch_fsdp1"
        """
    )
    result = pytester.runpytest_subprocess("--fsdp-engine", "torch_fsdp1")
    result.assert_outcomes(passed=3)


def test_unknown_fsdp_engine_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--fsdp-engine", "megatron")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--fsdp-engine / fsdp_engine:*megatron*fsdp_core*"])
