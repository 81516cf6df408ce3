"""The parts of ``torch.testing._internal.common_utils`` that distributed and FSDP tests import,
without torch's dev-only dependencies (``expecttest``): the tensor-aware ``TestCase``,
``parametrize``/``subtest``/``instantiate_parametrized_tests`` (torch's test names), the
environment flags, the skip decorators (torch 2.15's hardware and CI gates too) and small helpers
(``check_leaked_tensors`` among them; see docs/compatibility.md)."""

from __future__ import annotations

import sys

import torch

from fsdp_testing._compat.env import (
    FILE_SCHEMA,
    IS_SANDCASTLE,
    SEED,
    TEST_ACCELERATOR,
    TEST_CUDA,
    TEST_HPU,
    TEST_MULTIACCELERATOR,
    TEST_WITH_ASAN,
    TEST_WITH_DEV_DBG_ASAN,
    TEST_WITH_PERIODIC,
    TEST_WITH_ROCM,
    TEST_WITH_TSAN,
    TEST_XPU,
    LazyVal,
    set_rng_seed,
)
from fsdp_testing._compat.gates import (
    HardwareClassification,
    periodic,
    requires_accelerator,
    requires_multigpu,
)
from fsdp_testing._compat.leaks import check_leaked_tensors
from fsdp_testing._compat.parametrize import (
    ADDRESS_IN_USE,
    CONNECT_TIMEOUT,
    find_free_port,
    get_cycles_per_ms,
    instantiate_parametrized_tests,
    parametrize,
    retry_on_connect_failures,
    run_tests,
    skip_but_pass_in_sandcastle,
    skip_but_pass_in_sandcastle_if,
    skipIfRocm,
    skipIfTorchDynamo,
    subtest,
    xfailIf,
)
from fsdp_testing._unittest.assertions import TestCase

__all__ = [
    "ADDRESS_IN_USE",
    "CONNECT_TIMEOUT",
    "FILE_SCHEMA",
    "IS_FBCODE",
    "IS_LINUX",
    "IS_MACOS",
    "IS_SANDCASTLE",
    "IS_WINDOWS",
    "SEED",
    "TEST_ACCELERATOR",
    "TEST_CUDA",
    "TEST_HPU",
    "TEST_MULTIACCELERATOR",
    "TEST_MULTIGPU",
    "TEST_WITH_ASAN",
    "TEST_WITH_DEV_DBG_ASAN",
    "TEST_WITH_PERIODIC",
    "TEST_WITH_ROCM",
    "TEST_WITH_TSAN",
    "TEST_XPU",
    "HardwareClassification",
    "LazyVal",
    "TestCase",
    "check_leaked_tensors",
    "find_free_port",
    "get_cycles_per_ms",
    "instantiate_parametrized_tests",
    "parametrize",
    "periodic",
    "requires_accelerator",
    "requires_multigpu",
    "retry_on_connect_failures",
    "run_tests",
    "set_rng_seed",
    "skipIfRocm",
    "skipIfTorchDynamo",
    "skip_but_pass_in_sandcastle",
    "skip_but_pass_in_sandcastle_if",
    "subtest",
    "xfailIf",
]

IS_WINDOWS = sys.platform == "win32"
IS_MACOS = sys.platform == "darwin"
IS_LINUX = sys.platform == "linux"
IS_FBCODE = False
"""Meta's internal build; False everywhere else."""
TEST_MULTIGPU: bool = TEST_CUDA and torch.cuda.device_count() >= 2
