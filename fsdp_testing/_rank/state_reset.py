"""Where per-test state is reset on a warm rank: what a test may change in its process (RNG,
default dtype and device, grad mode, torch's global switches, ``torch.distributed`` attributes,
extra process groups, the environment, the working directory, ``sys.path``, signal handlers) is
captured once and restored after every test; what cannot be undone (threads the test started and
left running) is detected and the rank is replaced. See [Note: warm pool isolation] in
``fsdp_testing/_launch/pool.py``; thread mode restores the same state after each test.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["RankState"]

_MISSING = object()
_MONOTONIC = frozenset({"_group_count"})
"""Counters that must only grow: c10d names each new group (and its store keys) from
``_group_count``, so winding it back makes the next ``new_group`` on a warm rank reuse a name
whose rendezvous keys are already in the store, and hang."""


class RankState:
    """Process-wide state a test may change, captured once and restored after every test so that
    a warm rank serves the next test as a fresh process would (see [Note: warm pool isolation]
    in ``fsdp_testing/_launch/pool.py``)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._rng = torch.get_rng_state()
        self._py_rng = random.getstate()
        self._dtype = torch.get_default_dtype()
        self._modules = [dist, c10d]
        self._attrs = [dict(vars(m)) for m in self._modules]
        self._snapshots = [_snapshot(attrs) for attrs in self._attrs]
        self._groups = set(c10d._world.pg_map)
        self._store: object = None  # the default group's own store, once a reset has seen it
        self._resets = 0
        self._environ = dict(os.environ)
        self._cwd = os.getcwd()
        self._sys_path = list(sys.path)
        self._switches = _torch_switches()
        self._signals: dict[signal.Signals, Any] = _signal_handlers()
        self._threads: set[int] = set()

    def restore(self) -> None:
        """Restore the captured state."""
        for _, step in self.steps():
            step()

    def steps(self) -> list[tuple[str, Callable[[], None]]]:
        """What :meth:`restore` runs, in order, each with its name
        (``benchmarks/rank_resets.py`` times them one by one)."""
        return [
            ("environment, working directory, sys.path", self._restore_process),
            ("signal handlers", self._restore_signals),
            ("torch's global switches", self._restore_switches),
            ("torch.distributed attributes", self._restore_attributes),
            ("process groups the test made", self._destroy_new_groups),
            ("the store new groups meet in", self._fresh_group_store),
            ("DTensor sharding caches and RNG tracker", _forget_dtensor_meshes),
            ("torch and Python RNG", self._restore_rng),
            ("default dtype, grad mode and device", self._restore_defaults),
        ]

    def test_begins(self) -> None:
        """Note the threads alive before a test (see :meth:`left_running`)."""
        self._threads = {t.ident for t in threading.enumerate() if t.ident is not None}

    def left_running(self) -> list[str]:
        """The threads the last test started that are still alive: state no reset can undo (the
        rank is replaced); an empty list when there are none."""
        return [
            t.name
            for t in threading.enumerate()
            if t.ident not in self._threads and t.is_alive() and t is not threading.current_thread()
        ]

    def _restore_process(self) -> None:
        if os.environ != self._environ:
            os.environ.clear()
            os.environ.update(self._environ)
        if os.getcwd() != self._cwd:
            os.chdir(self._cwd)
        if sys.path != self._sys_path:
            sys.path[:] = self._sys_path

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # thread mode: the ranks are threads, only the main thread sets handlers
        for sig, handler in self._signals.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)

    def _restore_switches(self) -> None:
        _set_torch_switches(self._switches)

    def _restore_attributes(self) -> None:
        saved = zip(self._modules, self._attrs, self._snapshots, strict=True)
        for module, attrs, snapshot in saved:
            current = vars(module)
            # The common case, nothing added, removed or rebound, checked in C before the
            # Python loop over some 400 attributes below: same names in the same order, each
            # bound to the same object.
            if _snapshot(current) == snapshot:
                continue
            for key in [k for k in current if k not in attrs]:
                if isinstance(current[key], types.ModuleType):
                    attrs[key] = current[key]  # a submodule imported during the test stays
                    continue
                delattr(module, key)
            for key, value in attrs.items():
                if key in _MONOTONIC:
                    continue
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)
            snapshot[:] = _snapshot(current)  # e.g. a submodule imported during the test

    def _destroy_new_groups(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for pg in [pg for pg in list(c10d._world.pg_map) if pg not in self._groups]:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # a group the test already broke: drop it all the same
                c10d._world.pg_map.pop(pg, None)

    def _fresh_group_store(self) -> None:
        """Give the next test's new groups a store namespace of their own.

        [Note: a store namespace per test] c10d names most groups from ``_group_count`` (kept
        growing above), but a group made with ``use_local_synchronization=True``, and those of
        ``split_group`` and ``new_subgroups_by_enumeration``'s helpers, are named by a hash of
        their ranks: the same ranks give the same name in every test. Their rendezvous keys live
        under that name in the default group's store, so on a warm rank the second test to make
        such a group found the first test's keys and hung in ``new_group``. A fresh process has a
        fresh store; here every test gets ``test<N>/`` of the same store, N counted alike on
        every rank of a generation (each rank resets after each task).
        """
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if not dist.is_initialized():
            return
        default = c10d._get_default_group()
        backend, store = c10d._world.pg_map[default]
        if self._store is None:
            self._store = store
        self._resets += 1
        fresh = dist.PrefixStore(f"test{self._resets}/", self._store)  # type: ignore[arg-type]
        c10d._world.pg_map[default] = (backend, fresh)

    def _restore_rng(self) -> None:
        import torch

        torch.set_rng_state(self._rng)
        random.setstate(self._py_rng)

    def _restore_defaults(self) -> None:
        import torch

        torch.set_default_dtype(self._dtype)
        torch.set_grad_enabled(True)
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(None)


def _signal_handlers() -> dict[signal.Signals, Any]:
    found: dict[signal.Signals, Any] = {}
    for sig in signal.valid_signals():
        try:
            found[signal.Signals(sig)] = signal.getsignal(sig)
        except (ValueError, OSError):  # not a settable signal here
            continue
    return found


def _torch_switches() -> dict[str, object]:
    """torch's process-wide switches a test may flip, beyond the defaults restored elsewhere."""
    import torch

    return {
        "num_threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn": torch.is_deterministic_algorithms_warn_only_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def _set_torch_switches(switches: dict[str, object]) -> None:
    import torch

    now = _torch_switches()
    if now == switches:
        return
    if now["num_threads"] != switches["num_threads"]:
        torch.set_num_threads(int(switches["num_threads"]))  # type: ignore[call-overload]
    torch.set_float32_matmul_precision(str(switches["matmul_precision"]))
    torch.use_deterministic_algorithms(
        bool(switches["deterministic"]), warn_only=bool(switches["deterministic_warn"])
    )
    torch.autograd.set_detect_anomaly(bool(switches["anomaly"]))
    torch.backends.cudnn.deterministic = bool(switches["cudnn_deterministic"])
    torch.backends.cudnn.benchmark = bool(switches["cudnn_benchmark"])
    torch.backends.cuda.matmul.allow_tf32 = bool(switches["cuda_matmul_tf32"])


def _snapshot(attrs: dict[str, object]) -> list[object]:
    """``attrs``'s names and the ids of their values, in order (compared in C)."""
    return [*attrs, *map(id, attrs.values())]


def _forget_dtensor_meshes() -> None:
    """Drop DTensor's RNG tracker and its sharding propagation caches (the Python one and the
    C++ fast path's).

    Their keys compare device meshes by ranks only: after a test's group is destroyed (a
    subgroup on a warm rank, every group of a thread-mode world), the next test's DTensor ops
    on a new group over the same ranks would hit the cached entry and run on the old mesh,
    whose group no longer resolves ("Could not resolve the process group registered under the
    name ..."). A fresh process has empty caches; so must a warm rank. (Clearing costs about a
    microsecond.)

    The two caches are cleared here as ``torch.distributed.tensor.debug`` clears them, without
    importing that module: it imports torch's memory and runtime estimators, about 1.7 s of
    CPU that every new rank paid at its first reset.
    """
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor op ran in this process: nothing cached
    # The RNG tracker that DTensor's random ops (and torch.distributed.tensor._random's
    # manual_seed) make once per process holds the mesh of the test that made it; a fresh
    # process has none, and the next test's first random op makes its own.
    random_ops = sys.modules.get("torch.distributed.tensor._random")
    if random_ops is not None:
        random_ops._rng_tracker = None  # type: ignore[attr-defined]
    import torch
    from torch.distributed.tensor import DTensor

    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    # torch 2.9's cache (a thread-local lru_cache) has no cache_clear of its own, and 2.9 has
    # no C++ fast path cache.
    clear_python = getattr(cached, "cache_clear", None) or getattr(
        getattr(cached, "cache", None), "cache_clear", None
    )
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_python is None:  # torch moved it: its own (slower to import) way
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        return
    clear_python()
    if clear_fast_path is not None:
        clear_fast_path()
