"""Failure reports of real runs (issue 41): ranks failing alike are one entry; writing the
report never counts against the test's timeout; collectives are named as the user called them;
errors inside the package's user-facing helpers keep the helper's frames."""

from __future__ import annotations

import pytest

SAME_ASSERT = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=4, mode="local")
def test_same(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 0, "the sum is not zero\\non every rank"
"""


def test_ranks_failing_alike_are_one_entry(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SAME_ASSERT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "ranks 0-3 (4 of 4) failed: AssertionError: the sum is not zero on every rank",
            "[[]ranks 0-3 (4 of 4)[]] the same error; the traceback of rank *, the first to fail:",
        ]
    )
    text = result.stdout.str()
    assert text.count("dist.all_reduce(t)") == 1  # one traceback
    assert "[rank 1]" not in text


SLOW_REPORT = """
import pytest
from big import boom

@pytest.mark.distributed(world_size=4, mode="local", timeout=2)
def test_slow_report(rank):
    boom()
"""


def test_writing_the_report_does_not_count_against_the_timeout(pytester: pytest.Pytester) -> None:
    # pytest parses the whole source file of every frame it shows: a frame in a module of
    # 20,000 lines costs each rank's traceback about a second to write here, past the 2 s
    # timeout for four ranks one after another. The parent writes it after the test, once.
    lines = "\n".join(f"x_{i} = {i}" for i in range(20_000))
    pytester.makepyfile(big=lines + '\n\n\ndef boom():\n    raise ValueError("broken")\n')
    pytester.makepyfile(SLOW_REPORT)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "test_writing_the_report_does_not_count_against_the_timeout.py"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["ranks 0-3 (4 of 4) failed: ValueError: broken"])
    text = result.stdout.str()
    assert "aborted" not in text
    assert "timed out" not in text
    assert text.count('raise ValueError("broken")') == 1


NAMES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, mode="local")
def test_names(rank):
    out = torch.empty(2 if rank == 0 else 4)
    dist.all_gather_single(out, torch.ones(1))
"""


def test_local_mode_names_collectives_as_called(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(NAMES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank 0 issued all_gather_single(float32[[]2], float32[[]1]); rank 1 issued "
            "all_gather_single(float32[[]4], float32[[]1])*"
        ]
    )
    assert "all_gather_into_tensor(" not in result.stdout.str()


HELPER = """
import pytest, torch
from torch import nn
from fsdp_testing.parity import check_resume_parity

@pytest.mark.distributed(world_size=2, mode="thread")
def test_helper(rank, process_group, tmp_path):
    check_resume_parity(
        lambda: nn.Linear(4, 4),
        lambda model, group: model,
        lambda step: (torch.randn(4, 4), torch.randn(4)),
        process_group=process_group,
        checkpoint_dir=tmp_path,
        from_world=2,
        to_world=2,
    )
"""


def test_errors_inside_helpers_keep_the_helpers_frames(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(HELPER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*AttributeError: 'tuple' object has no attribute 'shape'*", "*fsdp_testing/parity/*"]
    )
    text = result.stdout.str()
    assert "fsdp_testing/_launch" not in text  # the harness's machinery stays hidden
    assert "fsdp_testing/_rank" not in text
