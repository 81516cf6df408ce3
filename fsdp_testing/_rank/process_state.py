"""The process-wide state each rank of a local world owns as if it were its own process: RNGs
(torch's CPU generator, Python's ``random``, NumPy's legacy global generator), torch's default
dtype and its deterministic-algorithms switch. Local mode swaps it whenever another rank thread
takes the baton (see [Note: local mode] in ``fsdp_testing/_launch/baton.py``); state that is
per thread already (grad mode, autocast, the default device, torch function modes) needs no
swapping.
"""

from __future__ import annotations

import random
import sys
from typing import Any, NamedTuple

__all__ = ["ProcessState", "apply", "capture"]


class ProcessState(NamedTuple):
    """A snapshot of the process-wide state one rank may change."""

    torch_rng: Any  # torch.ByteTensor of the CPU generator
    py_rng: Any
    numpy_rng: Any  # None when NumPy is not imported
    default_dtype: Any
    deterministic: tuple[bool, bool]  # (enabled, warn only)


def capture() -> ProcessState:
    """The current process state."""
    import torch

    numpy = sys.modules.get("numpy")
    return ProcessState(
        torch_rng=torch.get_rng_state(),
        py_rng=random.getstate(),
        numpy_rng=numpy.random.get_state() if numpy is not None else None,
        default_dtype=torch.get_default_dtype(),
        deterministic=(
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
    )


def apply(state: ProcessState) -> None:
    """Make ``state`` the process state."""
    import torch

    torch.set_rng_state(state.torch_rng)
    random.setstate(state.py_rng)
    numpy = sys.modules.get("numpy")
    if numpy is not None and state.numpy_rng is not None:
        numpy.random.set_state(state.numpy_rng)
    if torch.get_default_dtype() != state.default_dtype:
        torch.set_default_dtype(state.default_dtype)
    enabled, warn_only = state.deterministic
    if (enabled, warn_only) != (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ):
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
