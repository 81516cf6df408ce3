"""``common_utils.check_leaked_tensors`` (torch's pipelining tests wrap their schedule steps in
it) and the accelerator flags those tests gate on: a tensor left in a reference cycle is found,
a clean block finds nothing, the collector is left as it was, and the flags mean what torch's
mean on this machine."""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import pytest
import torch

from fsdp_testing.common_utils import TEST_ACCELERATOR, TEST_MULTIACCELERATOR, check_leaked_tensors


def _leak(tensor: torch.Tensor) -> None:
    cycle: list[Any] = [tensor]
    cycle.append(cycle)  # the list holds itself: only the cyclic collector frees it


def test_a_tensor_in_a_reference_cycle_is_found_and_named() -> None:
    with pytest.warns(UserWarning, match=r"left 1 Tensor object\(s\).*Tensor\[3, 2\] torch\.int64"):
        with check_leaked_tensors() as leaked:
            _leak(torch.zeros(3, 2, dtype=torch.int64))
    assert len(leaked) == 1 and leaked[0].shape == (3, 2)


def test_a_block_without_cycles_finds_nothing() -> None:
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with check_leaked_tensors() as leaked:
            kept.append(torch.ones(4))  # alive, but not garbage
            cycle: list[Any] = [1]
            cycle.append(cycle)  # a cycle that holds no tensor is ignored
            del cycle
    assert leaked == []


def test_garbage_left_before_the_block_is_not_the_blocks() -> None:
    # Freeing one cycle (its finalizer) drops the last reference to another that holds a tensor:
    # only a second collection finds that one, and it was made before the block.
    holder: list[Any] = []
    _leak_into(holder, torch.ones(2))

    class Dropper:
        def __del__(self) -> None:
            holder.clear()

    dropper = Dropper()
    dropper.me = dropper  # type: ignore[attr-defined]
    del dropper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with check_leaked_tensors() as leaked:
            pass
    assert leaked == []


def _leak_into(holder: list[Any], tensor: torch.Tensor) -> None:
    cycle: list[Any] = [tensor]
    cycle.append(cycle)
    holder.append(cycle)


def test_matched_type_and_limit() -> None:
    class Marker:
        pass

    with pytest.warns(
        UserWarning, match=r"left 2 Marker object\(s\) in reference cycles \(first 1"
    ):
        with check_leaked_tensors(limit=1, matched_type=Marker) as leaked:
            for _ in range(2):
                marker = Marker()
                marker.me = marker  # type: ignore[attr-defined]
            _leak(torch.ones(1))  # not a Marker: not counted
            del marker
    assert [type(obj) for obj in leaked] == [Marker, Marker]
    with pytest.raises(ValueError, match=r"check_leaked_tensors\(limit=...\).*got -1"):
        with check_leaked_tensors(limit=-1):
            pass
    with pytest.raises(TypeError, match=r"check_leaked_tensors\(matched_type=...\).*got 'x'"):
        with check_leaked_tensors(matched_type="x"):  # type: ignore[arg-type]
            pass


def test_the_collector_is_left_as_it_was() -> None:
    before_debug = gc.get_debug()
    uncollectable = object()
    gc.garbage.append(uncollectable)  # something else's entry stays where it was
    before = list(gc.garbage)
    try:
        with pytest.warns(UserWarning):
            with check_leaked_tensors():
                _leak(torch.ones(1))
        assert gc.get_debug() == before_debug
        assert gc.garbage == before
        with pytest.raises(RuntimeError, match="body failed"):
            with check_leaked_tensors():
                _leak(torch.ones(1))
                gc.collect()  # saved under DEBUG_SAVEALL before the body fails
                raise RuntimeError("body failed")
        assert gc.get_debug() == before_debug
        assert gc.garbage == before
    finally:
        gc.garbage.remove(uncollectable)


def test_thread_ranks_share_one_collector_and_restore_it_once() -> None:
    # Thread and local mode run ranks as threads of one process: the debug flags are set by the
    # first block that opens and restored by the last that closes, whatever the order.
    before_debug, before = gc.get_debug(), list(gc.garbage)
    inside = threading.Barrier(2)
    found: list[int] = []

    def rank(leaks: bool) -> None:
        with check_leaked_tensors() as leaked:
            inside.wait()
            assert gc.get_debug() & gc.DEBUG_SAVEALL
            if leaks:
                _leak(torch.ones(2))
            inside.wait()
        found.append(len(leaked))

    threads = [threading.Thread(target=rank, args=(leaks,)) for leaks in (True, False)]
    with warnings.catch_warnings():  # here, not in the threads: the filters are process-wide
        warnings.simplefilter("ignore")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(found) == [0, 1]  # one rank's block found it, none twice
    assert gc.get_debug() == before_debug and gc.garbage == before


def test_accelerator_flags_mean_torchs() -> None:
    assert bool(TEST_ACCELERATOR) == torch.accelerator.is_available()
    assert bool(TEST_MULTIACCELERATOR) == (torch.accelerator.device_count() > 1)
