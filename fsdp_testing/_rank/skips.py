"""torch-compatible skip codes: ``sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)`` on a rank
skips the test, as in torch's harness. No torch import here (the ranks' outcome code uses it).

The keys and messages are the installed torch's: torch 2.15 renamed ``"multi-gpu-N"`` ("Need at
least N CUDA devices") to ``"multi-device-N"`` ("Need at least N accelerator devices"), with the
same exit codes; :func:`multi_device_message` gives the installed torch's wording for any N."""

from __future__ import annotations

import importlib.metadata
import re
from typing import NamedTuple

__all__ = [
    "TEST_SKIPS",
    "TestSkip",
    "multi_device_key",
    "multi_device_message",
    "skip_message_for_exit_code",
]


def _installed_torch_release() -> tuple[int, int]:
    # Read from the distribution's metadata: importing torch here would cost every process
    # that only judges outcomes a second or more. No metadata (a source tree): the newest.
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return (999, 0)
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (999, 0)


_DEVICE_SKIPS_RENAMED = _installed_torch_release() >= (2, 15)


def multi_device_key(n: int) -> str:
    """The installed torch's ``TEST_SKIPS`` key for "needs n devices" (1 to 8 exist)."""
    return f"multi-device-{n}" if _DEVICE_SKIPS_RENAMED else f"multi-gpu-{n}"


def multi_device_message(n: int) -> str:
    """The installed torch's skip message for a test that needs ``n`` devices."""
    kind = "accelerator" if _DEVICE_SKIPS_RENAMED else "CUDA"
    return f"Need at least {n} {kind} device{'s' if n > 1 else ''}"


class TestSkip(NamedTuple):
    exit_code: int
    message: str


TEST_SKIPS: dict[str, TestSkip] = {
    "backend_unavailable": TestSkip(72, "Skipped because distributed backend is not available."),
    "small_worldsize": TestSkip(73, "Skipped due to small world size."),
    "odd_worldsize": TestSkip(87, "Skipped due to odd world size."),
    "no_cuda": TestSkip(74, "CUDA is not available."),
    "nccl": TestSkip(76, "c10d not compiled with NCCL support"),
    "skipIfRocm": TestSkip(78, "Test skipped for ROCm"),
    "no_peer_access": TestSkip(79, "Test skipped because no GPU peer access"),
    "generic": TestSkip(
        86, "Test skipped at subprocess level, look at subprocess log for skip reason"
    ),
    "importerror": TestSkip(88, "Test skipped due to missing import"),
    "no_accelerator": TestSkip(89, "accelerator is not available."),
}
_GPU_CODES = {1: 75, 2: 77, 3: 80, 4: 81, 5: 82, 6: 83, 7: 84, 8: 85}
for _n, _code in _GPU_CODES.items():
    TEST_SKIPS[multi_device_key(_n)] = TestSkip(_code, multi_device_message(_n))


def skip_message_for_exit_code(code: object) -> str | None:
    """The skip message of a ``TEST_SKIPS`` exit code, or None for any other code."""
    for skip in TEST_SKIPS.values():
        if code == skip.exit_code:
            return skip.message
    return None
