"""``common_utils``'s hardware and CI gates of torch 2.14 and 2.15: ``HardwareClassification``
(2.14), ``requires_accelerator``, ``requires_multigpu`` and ``periodic`` (2.15, with
``TEST_WITH_PERIODIC`` in ``env``). Each takes a test function or a test class, as torch's do;
the pytest markers they attach (``multigpu``, ``periodic``) are registered by the plugin, so
``--strict-markers`` and ``-m "not multigpu"`` work."""

from __future__ import annotations

import enum
import functools
import unittest
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from .env import IS_CI, IS_SANDCASTLE, TEST_WITH_PERIODIC

__all__ = ["HardwareClassification", "periodic", "requires_accelerator", "requires_multigpu"]

_T = TypeVar("_T")


class HardwareClassification(enum.Enum):
    """The kind of hardware a test class needs, as a ``hw_classification`` class attribute
    (torch 2.15). torch's own runner filters on it (``--hw-classification``); under pytest and
    this harness it is metadata only: select with ``-k`` or markers instead."""

    GENERIC = "generic"
    """Device-agnostic logic (dispatch, FX passes, ...)."""
    ACCELERATOR = "accelerator"
    """Behaviour that must hold on every accelerator."""
    CPU = "cpu"
    """CPU-specific behaviour."""
    CUDA = "cuda"
    """CUDA-specific behaviour."""
    MPS = "mps"
    """Apple MPS-specific behaviour."""
    XPU = "xpu"
    """Intel XPU-specific behaviour."""


def _skip_when(condition: Callable[[], bool], reason: str, target: _T) -> _T:
    # A class is decided once, here, since unittest reads a class's skip before making any
    # instance; a function is decided each time it runs (on the ranks, for distributed tests).
    if isinstance(target, type):
        if condition():
            target.__unittest_skip__ = True  # type: ignore[attr-defined]
            target.__unittest_skip_why__ = reason  # type: ignore[attr-defined]
        return target
    fn: Callable[..., Any] = target  # type: ignore[assignment]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if condition():
            raise unittest.SkipTest(reason)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def requires_accelerator(target: _T) -> _T:
    """Skip ``target`` (a test function or class) when ``torch.accelerator`` finds no device,
    with torch's reason "requires accelerator". Unlike ``skip_if_lt_x_gpu``, this never runs on
    CPU ranks instead: the test says it needs the device itself."""
    return _skip_when(lambda: not torch.accelerator.is_available(), "requires accelerator", target)


def _marked(marker: str, target: _T, skip: bool, reason: str) -> _T:
    mark = getattr(pytest.mark, marker)
    if isinstance(target, type):
        return unittest.skipIf(skip, reason)(mark(target))
    fn: Callable[..., Any] = target  # type: ignore[assignment]

    # A wrapper of its own: parametrized variants that share ``fn`` do not share its marks.
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return unittest.skipIf(skip, reason)(mark(wrapper))


def requires_multigpu(target: _T) -> _T:
    """Mark ``target`` (a test function or class) with the ``multigpu`` pytest marker and skip
    it where fewer than two CUDA devices are visible ("requires >= 2 GPUs"), as torch 2.15
    does. The test addresses a second GPU itself, so CPU ranks cannot stand in for it."""
    return _marked("multigpu", target, torch.cuda.device_count() < 2, "requires >= 2 GPUs")


def periodic(target: _T) -> _T:
    """Mark ``target`` with the ``periodic`` pytest marker; in a CI job (``$CI`` set, or
    sandcastle) skip it unless ``TEST_WITH_PERIODIC`` (``PYTORCH_TEST_WITH_PERIODIC=1``, or
    ``TEST_CONFIG=periodic``). Elsewhere it runs, as torch 2.15's does."""
    skip = (IS_CI or IS_SANDCASTLE) and not TEST_WITH_PERIODIC
    reason = "test is periodic; run with PYTORCH_TEST_WITH_PERIODIC to enable test"
    return _marked("periodic", target, skip, reason)
