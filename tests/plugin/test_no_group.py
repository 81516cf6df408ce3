"""A torch.distributed call in a test that is not distributed (issue 41): the error names the
marker and the fixture that give a test a process group, not only torch's bare "Default process
group has not been initialized"; a test that makes its own group, or expects torch's error, is
left alone. See fsdp_testing/_report/no_group.py."""

from __future__ import annotations

import pytest

NO_MARKER = """
import pytest, torch, torch.distributed as dist

def test_collective_without_the_marker():
    dist.all_reduce(torch.ones(2))

@pytest.fixture
def gathered():
    out = [torch.zeros(1)]
    dist.all_gather(out, torch.ones(1))
    return out

def test_collective_in_a_fixture(gathered):
    pass

def test_own_group(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()

def test_expects_torchs_error():
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.broadcast(torch.ones(1), 0)

def test_other_value_errors_are_untouched():
    raise ValueError("a value error of the test's own")
"""


def test_a_collective_outside_a_distributed_test_names_the_marker(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(NO_MARKER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", "-rfE")
    result.assert_outcomes(failed=2, passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            ">       dist.all_reduce(torch.ones(2))",  # the traceback still shows the call
            "E * ValueError: torch.distributed.all_reduce needs a process group, and "
            "test_a_collective_outside_a_distributed_test_names_the_marker.py::"
            "test_collective_without_the_marker has none: it is not a distributed test. Mark "
            "it @pytest.mark.distributed(world_size=2) *process_group fixture*torch says: "
            "Default process group has not been initialized*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*ValueError: torch.distributed.all_gather needs a process group, and *::test_collective_in_a_fixture has none*"
        ]
    )
    # Another ValueError keeps its own message.
    result.stdout.fnmatch_lines(['>       raise ValueError("a value error of the test\'s own")'])
    result.stdout.fnmatch_lines(["E       ValueError: a value error of the test's own"])
