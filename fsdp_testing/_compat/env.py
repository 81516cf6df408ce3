"""torch's environment flags and device constants, computed the same way on any machine.

``TEST_*`` flags mirror ``common_utils``'s meaning (what the machine has, or what the CI job
asked for through the same environment variables). ``DEVICE_TYPE``/``DISTRIBUTED_BACKEND`` follow
``common_fsdp``. ``DEVICE_COUNT`` differs on purpose on a machine without accelerators: torch
says 1 (so every test sized by it is skipped); here it is the CPU world size (default 2, see
[Note: CPU world size] in ``world.py``), so a class sized by ``DEVICE_COUNT`` runs on CPU ranks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from fsdp_testing._unittest.assertions import SEED, set_rng_seed
from fsdp_testing._unittest.world import cpu_world_size

__all__ = [
    "DEFAULT_WORLD_SIZE",
    "DEVICE_COUNT",
    "DEVICE_TYPE",
    "DISTRIBUTED_BACKEND",
    "FILE_SCHEMA",
    "HAS_ACCELERATOR",
    "IS_SANDCASTLE",
    "PLATFORM_SUPPORTS_SYMM_MEM",
    "SEED",
    "TEST_CUDA",
    "TEST_HPU",
    "TEST_WITH_ASAN",
    "TEST_WITH_DEV_DBG_ASAN",
    "TEST_WITH_ROCM",
    "TEST_WITH_TSAN",
    "TEST_XPU",
    "LazyVal",
    "accelerator_count",
    "evaluate_platform_supports_symm_mem",
    "set_rng_seed",
]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")


TEST_CUDA: bool = torch.cuda.is_available()
"""CUDA is available."""
TEST_XPU: bool = bool(hasattr(torch, "xpu") and torch.xpu.is_available())
"""An Intel XPU is available."""
TEST_HPU: bool = bool(hasattr(torch, "hpu") and torch.hpu.is_available())
"""An Intel Gaudi HPU is available."""
TEST_WITH_ROCM: bool = _flag("PYTORCH_TEST_WITH_ROCM")
"""torch's CI asked for ROCm runs (never set outside that CI)."""
TEST_WITH_ASAN: bool = _flag("PYTORCH_TEST_WITH_ASAN")
TEST_WITH_DEV_DBG_ASAN: bool = _flag("PYTORCH_TEST_WITH_DEV_DBG_ASAN")
TEST_WITH_TSAN: bool = _flag("PYTORCH_TEST_WITH_TSAN")
IS_SANDCASTLE: bool = _flag("SANDCASTLE") or os.environ.get("TW_JOB_USER") == "sandcastle"
"""Meta's internal CI; False everywhere else (tests that check it then run normally)."""
HAS_ACCELERATOR: bool = TEST_CUDA or TEST_HPU or TEST_XPU
FILE_SCHEMA = "file://" if sys.platform != "win32" else "file:///"


def accelerator_count() -> int:
    """Accelerators of the available kind (CUDA, XPU, HPU), 0 on a CPU-only machine."""
    if TEST_CUDA:
        return torch.cuda.device_count()
    if TEST_XPU:
        return int(torch.xpu.device_count())
    if TEST_HPU:
        return int(torch.hpu.device_count())  # type: ignore[attr-defined]
    return 0


if TEST_CUDA:
    DEVICE_TYPE, DISTRIBUTED_BACKEND = "cuda", "nccl"
elif TEST_HPU:
    DEVICE_TYPE, DISTRIBUTED_BACKEND = "hpu:0", "hccl"
elif TEST_XPU:
    DEVICE_TYPE, DISTRIBUTED_BACKEND = "xpu", "xccl"
else:
    DEVICE_TYPE, DISTRIBUTED_BACKEND = "cpu", "gloo"

DEVICE_COUNT: int = accelerator_count() if HAS_ACCELERATOR else cpu_world_size()
"""Ranks an FSDP test class uses by default: the accelerators, else the CPU world size."""
DEFAULT_WORLD_SIZE = 4
"""``MultiProcessTestCase``'s default world size, as torch's."""


class LazyVal:
    """A value computed on first use (``bool()``, ``str()``, ``==``), as torch's ``LazyVal``.

    Args:
        compute: called once, with no arguments.
    """

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute = compute
        self._done = False
        self._value: Any = None

    def value(self) -> Any:
        if not self._done:
            self._value, self._done = self._compute(), True
        return self._value

    def __bool__(self) -> bool:
        return bool(self.value())

    def __eq__(self, other: object) -> bool:
        return bool(self.value() == other)

    def __hash__(self) -> int:
        return hash(self.value())

    def __str__(self) -> str:
        return str(self.value())

    def __repr__(self) -> str:
        return f"LazyVal({self.value()!r})"


def evaluate_platform_supports_symm_mem() -> bool:
    """Whether CUDA symmetric memory works here: any CUDA machine, on ROCm only gfx942/gfx950."""
    if not TEST_CUDA:
        return False
    if not TEST_WITH_ROCM:
        return True
    arch = torch.cuda.get_device_properties(0).gcnArchName
    return any(name in arch for name in ("gfx942", "gfx950"))


PLATFORM_SUPPORTS_SYMM_MEM: Any = LazyVal(evaluate_platform_supports_symm_mem)
