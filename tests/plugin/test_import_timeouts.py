"""Time spent importing is not a hang (issue 49): a rank whose stack is in an import when the
deadline comes gets more time while the import moves on; the modules ranks imported (killed
ones too) are preloaded for the next ranks; a rank still importing is reported as such."""

from __future__ import annotations

import pytest

SLOW_IMPORT = """
import pytest


@pytest.mark.distributed(world_size=2, timeout=2)
def test_first_import_takes_longer_than_the_timeout(rank):
    import slow_dependency  # 4 s to import, on every rank

    assert slow_dependency.READY
"""

SLOW_MODULE = """
import time

time.sleep(4)  # a heavy first import (torch._dynamo and sympy take seconds on a busy machine)
READY = True
"""


def test_an_import_past_the_deadline_is_waited_for(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_slow=SLOW_IMPORT, slow_dependency=SLOW_MODULE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=1)


def test_a_rank_still_importing_is_reported_as_importing() -> None:
    from fsdp_testing._protocol import Outcome, RankResult
    from fsdp_testing._report.hang_report import importing_in, timeout_report
    from fsdp_testing._report.observation import Observation

    stack = (
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/site/sympy/core/basic.py", line 3 in <module>\n'
        '  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed\n'
        '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
        '  File "/site/torch/_dynamo/__init__.py", line 1 in <module>\n'
        '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
        '  File "/site/torch/nn/parallel/distributed.py", line 40 in _lazy\n'
        '  File "/home/me/tests/test_ddp.py", line 12 in test_step\n'
    )
    found = importing_in(stack)
    assert found is not None and found.at.endswith("distributed.py:40")
    obs = Observation(world_size=2, timeout=10)
    obs.stragglers = {0}
    obs.timed_out = True
    obs.import_wait = 15
    obs.stacks = {0: stack}
    obs.results = {1: RankResult(rank=1, outcome=Outcome.PASSED)}
    obs.records = {0: [], 1: []}
    report = timeout_report(obs)
    assert "rank 0 is still importing" in report and "not a hang" in report
    assert "raise --dist-timeout" in report
    assert "hang is in user code" not in report and "never entered" not in report
