"""torch-compatible skip codes: ``sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)`` on a rank
skips the test, as in torch's harness. No torch import here (the ranks' outcome code uses it)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["TEST_SKIPS", "TestSkip", "skip_message_for_exit_code"]


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
    "generic": TestSkip(86, "Test skipped at subprocess level, look at subprocess log"),
    "importerror": TestSkip(88, "Test skipped due to missing import"),
    "no_accelerator": TestSkip(89, "accelerator is not available."),
}
_GPU_CODES = {1: 75, 2: 77, 3: 80, 4: 81, 5: 82, 6: 83, 7: 84, 8: 85}
for _n, _code in _GPU_CODES.items():
    TEST_SKIPS[f"multi-gpu-{_n}"] = TestSkip(
        _code, f"Need at least {_n} CUDA device{'s' if _n > 1 else ''}"
    )


def skip_message_for_exit_code(code: object) -> str | None:
    """The skip message of a ``TEST_SKIPS`` exit code, or None for any other code."""
    for skip in TEST_SKIPS.values():
        if code == skip.exit_code:
            return skip.message
    return None
