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
    "IS_CI",
    "IS_SANDCASTLE",
    "PLATFORM_SUPPORTS_SYMM_MEM",
    "SEED",
    "TEST_ACCELERATOR",
    "TEST_CUDA",
    "TEST_HPU",
    "TEST_MULTIACCELERATOR",
    "TEST_WITH_ASAN",
    "TEST_WITH_DEV_DBG_ASAN",
    "TEST_WITH_PERIODIC",
    "TEST_WITH_ROCM",
    "TEST_WITH_TSAN",
    "TEST_XPU",
    "TORCH_RELEASE",
    "LazyVal",
    "accelerator_count",
    "evaluate_platform_supports_symm_mem",
    "fsdp_device_selection",
    "set_rng_seed",
]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_RELEASE: tuple[int, int] = _release(torch.__version__)
"""The installed torch's ``(major, minor)``: the mirrors follow its names and behaviour (see
docs/compatibility.md, "Supported torch releases")."""
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
IS_CI: bool = bool(os.environ.get("CI"))
"""A CI job (``$CI`` set to anything), as torch reads it."""
TEST_WITH_PERIODIC: bool = (
    _flag("PYTORCH_TEST_WITH_PERIODIC")
    if "PYTORCH_TEST_WITH_PERIODIC" in os.environ
    else os.environ.get("TEST_CONFIG") == "periodic"
)
"""Run the tests marked ``@periodic`` in CI (torch 2.15's flag): ``$PYTORCH_TEST_WITH_PERIODIC``,
else a ``$TEST_CONFIG`` of ``periodic``."""
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


def fsdp_device_selection(release: tuple[int, int]) -> tuple[str, str, int]:
    """``common_fsdp``'s ``(DEVICE_TYPE, DISTRIBUTED_BACKEND, DEVICE_COUNT)`` as torch
    ``release`` computes them on this machine, except the count without an accelerator (the CPU
    world size; see the module's docstring).

    Before 2.15: CUDA (nccl), else HPU (``"hpu:0"``, hccl), else XPU (xccl), else cpu and gloo.
    From 2.15: ``torch.accelerator``'s current accelerator, whatever its kind (a PrivateUse1
    device too), with the backend torch registers for it; an MPS device counts as none (gloo
    takes no MPS tensors).

    Args:
        release: torch's ``(major, minor)``; :data:`TORCH_RELEASE` for the installed one.
    """
    if release >= (2, 15):
        current = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        if current is not None and current.type != "mps":
            import torch.distributed as dist

            backend = dist.get_default_backend_for_device(current)
            return current.type, backend, torch.accelerator.device_count()
        return "cpu", "gloo", cpu_world_size()
    if torch.cuda.is_available():
        return "cuda", "nccl", torch.cuda.device_count()
    if hasattr(torch, "hpu") and torch.hpu.is_available():
        return "hpu:0", "hccl", int(torch.hpu.device_count())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu", "xccl", int(torch.xpu.device_count())
    return "cpu", "gloo", cpu_world_size()


DEVICE_TYPE, DISTRIBUTED_BACKEND, DEVICE_COUNT = fsdp_device_selection(TORCH_RELEASE)
"""``DEVICE_COUNT``: ranks an FSDP test class uses by default: the accelerators, else the CPU
world size."""
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

TEST_ACCELERATOR: Any = LazyVal(torch.accelerator.is_available)
"""``torch.accelerator`` finds a device (any kind: CUDA, XPU, HPU, MPS, ...); false on a
CPU-only machine. Computed on first use, as torch's."""
TEST_MULTIACCELERATOR: Any = LazyVal(lambda: torch.accelerator.device_count() > 1)
"""``torch.accelerator`` finds at least two devices. torch's meaning on every machine: tests
that skip on it (``skip_but_pass_in_sandcastle_if(not TEST_MULTIACCELERATOR, ...)``) address a
second device themselves, so CPU ranks do not stand in for it (see docs/compatibility.md)."""
