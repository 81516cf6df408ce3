"""Failure reports of real runs (issue 41): ranks failing alike are one entry; writing the
report never counts against the test's timeout; collectives are named as the user called them;
errors inside the package's user-facing helpers keep the helper's frames."""

from __future__ import annotations

import pytest
import torch.distributed as dist

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


@pytest.mark.parametrize("ci", ["true", ""])
def test_the_summary_line_is_the_headline_on_ci_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    # On CI (CI or BUILD_NUMBER set) pytest does not cut the short summary to one line: it
    # printed the whole report a second time there.
    monkeypatch.setenv("CI", ci)
    pytester.makepyfile(SAME_ASSERT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", "--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    summary = result.stdout.str().split("short test summary info")[1].splitlines()[1:-1]
    assert len(summary) == 1, summary
    assert summary[0].startswith("FAILED test_the_summary_line_is_the_headline_on_ci_too.py::")
    assert result.stdout.str().count("dist.all_reduce(t)") == 1
    junit = (pytester.path / "out.xml").read_text()
    assert 'message="Failed: ranks 0-3 (4 of 4) failed: AssertionError: the sum is not' in junit


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


SLOW_RANK = """
import time

import pytest
from big import boom


@pytest.mark.distributed(world_size=2)
def test_slow_report_on_rank_1(rank):
    if rank == 0:
        raise ValueError("rank 0 broke")
    time.sleep(0.2)  # rank 0 fails first
    boom()
"""


def test_a_rank_process_writes_its_report_after_its_result(pytester: pytest.Pytester) -> None:
    # Process mode: peers get one second after the first failure before they count as aborted.
    # Rank 1 fails too, in a module of 60,000 lines: pytest parses the whole file of every
    # frame it shows, seconds here. Rank 1 must be reported as failed with its own traceback,
    # not as aborted while it wrote it.
    lines = "\n".join(f"x_{i} = {i}" for i in range(60_000))
    pytester.makepyfile(big=lines + '\n\n\ndef boom():\n    raise KeyError("rank 1 broke")\n')
    pytester.makepyfile(SLOW_RANK)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "aborted" not in text and "still running" not in text, text
    assert "ValueError: rank 0 broke" in text
    assert 'raise KeyError("rank 1 broke")' in text  # rank 1's own traceback


# The single-tensor all-gather as the installed torch spells it: torch 2.11 has
# all_gather_into_tensor only; all_gather_single came later.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

NAMES = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, mode="local")
def test_names(rank):
    out = torch.empty(2 if rank == 0 else 4)
    dist.all_gather_single(out, torch.ones(1))
"""


def test_local_mode_names_collectives_as_called(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(NAMES.replace("all_gather_single", ALL_GATHER))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*rank 0 issued {ALL_GATHER}(float32[[]2], float32[[]1]); rank 1 issued "
            f"{ALL_GATHER}(float32[[]4], float32[[]1])*"
        ]
    )
    # Never another spelling of the same collective than the one the test called.
    others = {"all_gather_single", "all_gather_into_tensor", "_all_gather_base"} - {ALL_GATHER}
    assert not [name for name in others if f"{name}(" in result.stdout.str()]


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
    # The tuple reaches the helper's default loss, which calls the model on it.
    result.stdout.fnmatch_lines(
        [
            "*/fsdp_testing/parity/_resume.py:*: in check_resume_parity",
            "*/fsdp_testing/parity/_resume.py:*: in _mean_square",
            "*TypeError: linear(): argument 'input' (position 1) must be Tensor, not tuple",
        ]
    )
    text = result.stdout.str()
    # ... in pytest's short form, as torch's: the call, not the helper's whole source.
    assert "def check_resume_parity(" not in text
    assert "fsdp_testing/_launch" not in text  # the harness's machinery stays hidden
    assert "fsdp_testing/_rank" not in text


CHAINED = """
import json
import pytest

def parse(text, *, cause):
    try:
        return json.loads(text)
    except ValueError as exc:
        if cause:
            raise RuntimeError("the config is broken") from exc
        raise RuntimeError("the config is broken")

@pytest.mark.parametrize("cause", [True, False], ids=["cause", "context"])
@pytest.mark.distributed(world_size=2, mode="MODE")
def test_chained(rank, cause):
    parse("{", cause=cause)
"""


@pytest.mark.parametrize("mode", ["process", "thread", "local"])
def test_every_exception_of_a_chain_shows_the_standard_librarys_frames_short(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makepyfile(CHAINED.replace("MODE", mode))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    # The cause (__cause__) and the context (__context__) as the last exception: json's frames
    # in pytest's short form (the call, not the function's source), the test's in full.
    for description in (
        "The above exception was the direct cause of the following exception:",
        "During handling of the above exception, another exception occurred:",
    ):
        result.stdout.fnmatch_lines(
            [
                "*/json/__init__.py:*: in loads",
                "*/json/decoder.py:*: in raw_decode",
                "E   json.decoder.JSONDecodeError: Expecting property name enclosed in double*",
                description,
                ">*raise RuntimeError(*",
                "E   *RuntimeError: the config is broken",
            ]
        )
    text = result.stdout.str()
    assert "def raw_decode(" not in text and "def loads(" not in text, text
    assert "fsdp_testing/_launch" not in text and "fsdp_testing/_rank" not in text


PEERS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=4, mode="local")
def test_peers(rank):
    dist.broadcast(torch.ones(2), src=0)
    if rank == 0:
        raise ValueError("rank zero is broken")
    dist.all_reduce(torch.ones(1))

@pytest.mark.distributed(world_size=4, mode="local")
def test_odd_one_out(rank):
    dist.all_reduce(torch.ones(2 if rank == 3 else 1))
"""


def test_aborted_peers_name_their_collective_and_the_failed_ranks(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(PEERS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 0 failed: ValueError: rank zero is broken (ranks 1-3 aborted)",
            "[[]ranks 1-3 (3 of 4)[]] aborted: their collective (all_reduce #1 [[]raised[]]) "
            "broke because rank 0 failed (last collective of rank 0: broadcast #1 [[]completed[]])",
            # The odd rank first, the others as ranges.
            "*the ranks issued different collectives as the 1st collective of the default group: "
            "rank 3 issued all_reduce(float32[[]2[]], SUM); ranks 0-2 issued "
            "all_reduce(float32[[]1[]], SUM)*",
        ]
    )
    text = result.stdout.str()
    assert "aborted by the harness" not in text
    # torch's debug record of each rank's failed collective repeats the error: not shown.
    assert "Captured log" not in text


GLOO_ABORT = """
import pytest, torch, torch.distributed as dist

@pytest.mark.distributed(world_size=2, backend="gloo")
def test_other_sizes(rank):
    dist.all_reduce(torch.ones(1))
    dist.broadcast(torch.ones(5 if rank == 0 else 3), src=0)
"""


def test_a_gloo_abort_on_a_mismatch_shows_the_collective_log(pytester: pytest.Pytester) -> None:
    # gloo's receiver aborts the process (gloo::EnforceNotMet, "Received data size doesn't
    # match expected size"); the sender may have left the broadcast already.
    pytester.makepyfile(GLOO_ABORT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "rank 1 killed by SIGABRT*",
            "*Is there a distributed collective mismatch in your code?",
            "collective divergence:",
            "  rank 1 waits in broadcast #1 with shapes [[][[]3[]][]] but rank 0 issued it with "
            "[[][[]5[]][]]",
            "last communication per rank:",
            "  rank 0:",
            "    broadcast #1 shapes=[[][[]5[]][]] dtype=float32 [[]completed[]]",
            "  rank 1:",
            "    broadcast #1 shapes=[[][[]3[]][]] dtype=float32 [[]*[]]",
        ]
    )
