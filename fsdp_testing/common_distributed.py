"""Drop-in for ``torch.testing._internal.common_distributed``: the names torch's distributed tests
import, running on fsdp_testing's launcher (see docs/migration.md)."""

from fsdp_testing._rank.skips import TEST_SKIPS, TestSkip
from fsdp_testing.testcase import (
    DistributedTestFailure,
    MultiProcessTestCase,
    MultiThreadedTestCase,
    run_subtests,
    skip_if_lt_x_gpu,
)

__all__ = [
    "TEST_SKIPS",
    "DistributedTestFailure",
    "MultiProcessTestCase",
    "MultiThreadedTestCase",
    "TestSkip",
    "run_subtests",
    "skip_if_lt_x_gpu",
]
