"""Where a rank's communication is observed: every call that reaches a process group, collective
or point to point, described once (:class:`CommCall`) and handed to the calling rank's collective
log (its faults fire there) and to the recorders listening, without replacing any
``torch.distributed`` function.

[Note: observing without replacing]
torch compares its communication functions by identity (``dist.P2POp`` refuses an op that is not
``dist.isend`` or ``dist.irecv``, ``batch_isend_irecv`` and ``torch.distributed.pipelining`` test
``op is isend``), and user code captures them at import (``from torch.distributed import
isend``), so the harness never replaces one. Every one of them ends in a method of the process
group object (``group.allreduce``, ``group.send``, ...): that is where calls are observed. While
ranks run, the methods of ``ProcessGroup`` (C++'s, as reached from Python) and those the Python
process groups in use define (thread mode's, local mode's) are wrapped, and put back after. A
call is described from its arguments and named as the rank's code called it: by the outermost
``torch.distributed`` function on the stack (``all_gather_into_tensor``, not the
``all_gather_single`` it reaches; ``all_gather_object``, whose two inner all-gathers are one
call; ``send``, which calls ``isend``), found by reading the calling frames' code, never their
arguments. The work a call returns is wrapped in a ``Work`` subclass that forwards every method,
so that the log knows when the rank waits on it and when it completed. Calls that torch makes
from C++ (DDP's reducer, DTensor's functional collectives on gloo or nccl) never reach Python and
are not observed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from fsdp_testing._rank.observed_work import observed_work

__all__ = [
    "CommCall",
    "Listener",
    "add_listener",
    "current_recorder",
    "end",
    "install",
    "installed",
    "remove_listener",
    "self_peer_error",
    "uninstall",
]

#: Process group methods observed, by the family of what they do (``fsdp_testing.collectives``)
#: and where their (output, input) tensors are: ``(family, output index, input index)``; an
#: in-place method has its tensors at index 0 on both sides.
_METHODS: dict[str, tuple[str, int, int]] = {
    "allreduce": ("all_reduce", 0, 0),
    "allreduce_coalesced": ("all_reduce", 0, 0),
    "reduce": ("reduce", 0, 0),
    "broadcast": ("broadcast", 0, 0),
    "allgather": ("all_gather", 0, 1),
    "all_gather_single": ("all_gather", 0, 1),
    "_allgather_base": ("all_gather", 0, 1),
    "allgather_coalesced": ("all_gather", 0, 1),
    "allgather_into_tensor_coalesced": ("all_gather", 0, 1),
    "all_gather_single_coalesced": ("all_gather", 0, 1),
    "gather": ("gather", 0, 1),
    "scatter": ("scatter", 0, 1),
    "reduce_scatter": ("reduce_scatter", 0, 1),
    "reduce_scatter_single": ("reduce_scatter", 0, 1),
    "_reduce_scatter_base": ("reduce_scatter", 0, 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 0, 1),
    "alltoall": ("all_to_all", 0, 1),
    "alltoall_base": ("all_to_all", 0, 1),
    "all_to_all_single": ("all_to_all", 0, 1),
    "barrier": ("barrier", 0, 0),
    "monitored_barrier": ("barrier", 0, 0),
    "send": ("send", 0, 0),
    "recv": ("recv", 0, 0),
    "recv_anysource": ("recv", 0, 0),
}

#: The unsharded side of each family, whose bytes are a call's volume: "out" or "in".
_SIZED = {"all_gather": "out", "reduce_scatter": "in", "all_to_all": "in", "gather": "in"}

#: ``torch.distributed`` functions that are one call made of several process group calls: the
#: inner calls of one such call are one entry of the log.
_COMPOSITE = frozenset(
    {
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
        "all_gather_coalesced",
    }
)
#: Functions whose calls are each an entry of their own, the batch noted on each.
_BATCHES = frozenset({"batch_isend_irecv"})

#: Public functions that do not block (they return a work to wait on).
_NONBLOCKING = frozenset({"isend", "irecv", "batch_isend_irecv"})


@dataclasses.dataclass(eq=False)
class CommCall:
    """One call that reached a process group, as the reports and records describe it."""

    op: str
    """The ``torch.distributed`` function as the rank called it (``all_gather_into_tensor``,
    ``isend``, ``recv``); the family's name when the group was called directly."""
    family: str
    """Its family (``all_gather``, ``send``, ``recv``, ...; see ``fsdp_testing.collectives``)."""
    method: str
    """The process group method reached (``all_gather_single``, ``send``)."""
    p2p: bool
    """A point-to-point op (send or recv) rather than a collective."""
    rank: int
    """The calling rank (global)."""
    group: Any
    """The process group object."""
    group_name: str
    """``"default"`` for the world, else the group's name and size (``"3(size 2)"``)."""
    group_ranks: tuple[int, ...]
    """The group's global ranks, in group rank order."""
    outputs: list[Any]
    """The tensors written (all-gather output; in place: the tensors themselves)."""
    inputs: list[Any]
    """The tensors read (in place: the tensors themselves)."""
    nbytes: int
    """The call's volume: the unsharded side's bytes (see ``_SIZED``), a message's bytes."""
    dtype: str | None
    blocking: bool
    """The rank's call waits for it to complete (``send``, a collective without
    ``async_op=True``): set once the call returns (True until the work is handed out)."""
    peer: int | None = None
    """Point to point: the other rank (global); None for a receive from any rank."""
    tag: int = 0
    batch: str | None = None
    """The batching function (``batch_isend_irecv``) the op is part of, if any."""
    reduce_op: str | None = None
    root: int | None = None
    """broadcast/reduce/gather/scatter: the root's global rank."""
    where: str = ""
    """``path:line`` of the call in the code that made it (the first frame outside torch and
    the harness)."""
    entry: dict[str, Any] | None = None
    """Its entry in the rank's collective log (set by the log)."""
    start_ns: int = 0
    end_ns: int | None = None
    """When it completed (``time.perf_counter_ns``); None while it runs."""

    @property
    def shapes(self) -> list[list[int]]:
        """Every tensor's shape, outputs first."""
        seen = self.outputs if self.outputs is self.inputs else [*self.outputs, *self.inputs]
        return [list(t.shape) for t in seen]


class Listener:
    """What a recorder implements to see every rank's calls (each call once per event)."""

    def started(self, call: CommCall) -> None:
        """``call`` is about to start."""

    def ended(self, call: CommCall, state: str) -> None:
        """``call`` left its process group method (``"issued"``: it runs on), completed
        (``"completed"``) or raised (``"raised"``)."""


# --- the rank's log and the listeners ----------------------------------------------------------

_lookup: Callable[[], Any] = lambda: None  # noqa: E731
_listeners: tuple[Listener, ...] = ()
_lock = threading.Lock()
_local = threading.local()


def current_recorder() -> Any:
    """The calling rank's collective log (a ``FlightRecorder``), or None outside a distributed
    test."""
    return _lookup()


def add_listener(listener: Listener) -> None:
    """Let ``listener`` see every observed call of every rank of this process."""
    global _listeners
    with _lock:
        _listeners = (*_listeners, listener)


def remove_listener(listener: Listener) -> None:
    """Stop showing calls to ``listener``."""
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)


# --- installing -------------------------------------------------------------------------------

_wrapped: dict[tuple[type, str], Any] = {}
"""(class, method) -> the attribute as the class held it before."""


def install(lookup: Callable[[], Any] | None) -> None:
    """Observe every process group call of this process from now on; ``lookup()`` gives the
    calling rank's collective log (None: the call is not logged; ``lookup=None`` keeps the
    current one). See [Note: observing without replacing]. Calling it again refreshes the
    classes observed (a process group class defined since)."""
    global _lookup
    import torch.distributed as dist

    with _lock:
        if lookup is not None:
            _lookup = lookup
        for cls in _group_classes(dist.ProcessGroup):
            for name in _METHODS:
                if name in cls.__dict__ and (cls, name) not in _wrapped:
                    original = cls.__dict__[name]
                    _wrapped[(cls, name)] = original
                    setattr(cls, name, _observed_method(name, original))


def installed() -> bool:
    """Whether calls are observed in this process (the harness's ranks, or a recorder)."""
    return bool(_wrapped)


def uninstall() -> None:
    """Put every wrapped method back and stop logging."""
    global _lookup
    with _lock:
        for (cls, name), original in _wrapped.items():
            setattr(cls, name, original)
        _wrapped.clear()
        _lookup = lambda: None  # noqa: E731


def _group_classes(root: type) -> Iterator[type]:
    """``root`` and every subclass of it defined so far."""
    seen: set[type] = set()
    pending = [root]
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        yield cls
        pending.extend(cls.__subclasses__())


def _observed_method(name: str, original: Any) -> Callable[..., Any]:
    family, out_at, in_at = _METHODS[name]

    @functools.wraps(original)
    def observed(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "inside", False):
            return original(self, *args, **kwargs)  # a method calling another: one call
        recorder = _lookup()
        listeners = _listeners
        if recorder is None and not listeners:
            return original(self, *args, **kwargs)
        call = _describe(self, name, family, out_at, in_at, args, kwargs)
        if call is None:  # part of a composite call already logged
            return original(self, *args, **kwargs)
        if recorder is not None:
            recorder.enter(call)  # faults fire here, before the call starts
        for listener in listeners:
            listener.started(call)
        _local.inside = True
        try:
            work = original(self, *args, **kwargs)
        except BaseException as exc:
            end(call, "raised")
            if call.p2p and call.peer == call.rank and "Pair is not connected" in str(exc):
                from fsdp_testing._report.collective_log import call_name

                named = call_name(call.entry) if call.entry else call.op
                raise ValueError(self_peer_error(call.rank, named)) from None
            raise
        finally:
            _local.inside = False
        if work is None:
            end(call, "completed")
            return work
        end(call, "issued")
        import torch.distributed as dist

        if not isinstance(work, dist.Work):
            return work
        return observed_work(work, functools.partial(end, call))

    observed.__fsdp_testing_observed__ = original  # type: ignore[attr-defined]
    return observed


def self_peer_error(rank: int, named: str, mode: str | None = None) -> str:
    """The error of a rank whose send or receive (``named`` as reports name it) names the rank
    itself: gloo's own is "Pair is not connected"."""
    in_mode = f" mode={mode!r}:" if mode else ""
    return (
        f"[rank {rank}]{in_mode} {named} names the rank itself as its peer; gloo cannot "
        "send a message to the rank that sends it (it raises 'Pair is not connected'): check "
        "the peer's arithmetic (e.g. (rank + 1) % world_size)"
    )


def end(call: CommCall, state: str) -> None:
    """``call`` moved to ``state`` (``issued``, ``waiting``, ``completed``, ``raised``): its log
    entry is updated and, unless it only waits, the listeners told."""
    recorder = _lookup()
    if recorder is not None and call.entry is not None:
        recorder.update(call.entry, state)
    if state == "waiting":
        return
    if state != "issued":
        call.end_ns = time.perf_counter_ns()
    for listener in _listeners:
        listener.ended(call, state)


# --- describing a call ---------------------------------------------------------------------------


def _describe(
    group: Any,
    method: str,
    family: str,
    out_at: int,
    in_at: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> CommCall | None:
    import torch
    import torch.distributed as dist

    caller = sys._getframe(2)
    op, outer, where = _called_as(caller)
    if op in _COMPOSITE and outer is not None:
        if getattr(_local, "composite", None) is outer:
            return None
        _local.composite = outer
    else:
        _local.composite = None
    outputs = _tensors(args[out_at] if len(args) > out_at else None)
    inputs = outputs if out_at == in_at else _tensors(args[in_at] if len(args) > in_at else None)
    sized = inputs if _SIZED.get(family) == "in" else outputs
    nbytes = sum(t.numel() * t.element_size() for t in sized)
    dtype = str(sized[0].dtype).removeprefix("torch.") if sized else None
    ranks = _ranks_of(group)
    default = group is dist.distributed_c10d._world.default_pg
    name = "default" if default else f"{_group_name(group)}(size {len(ranks)})"
    p2p = family in ("send", "recv")
    call = CommCall(
        op=op or family,
        family=family,
        method=method,
        p2p=p2p,
        rank=dist.get_rank(),
        group=group,
        group_name=name,
        group_ranks=ranks,
        outputs=outputs,
        inputs=inputs,
        nbytes=nbytes,
        dtype=dtype,
        blocking=op not in _NONBLOCKING,
        where=where,
        start_ns=time.perf_counter_ns(),
    )
    if outer is not None and outer.f_code.co_name in _BATCHES:
        call.batch = outer.f_code.co_name
    elif outer is not None and not p2p:
        call.blocking = not outer.f_locals.get("async_op", False)
    opts = args[-1] if args else kwargs.get("opts")
    if p2p:
        if method == "recv_anysource":
            call.tag = int(_arg(args, kwargs, 1, "tag", 0))
        else:
            peer = int(_arg(args, kwargs, 1, "dstRank" if family == "send" else "srcRank", 0))
            call.peer = ranks[peer] if 0 <= peer < len(ranks) else peer
            call.tag = int(_arg(args, kwargs, 2, "tag", 0))
    else:
        op_obj = getattr(opts, "reduceOp", None)
        if op_obj is not None:
            call.reduce_op = str(getattr(op_obj, "op", op_obj)).rsplit(".", 1)[-1]
        root = getattr(opts, "rootRank", None)
        if isinstance(root, int) and 0 <= root < len(ranks):
            call.root = ranks[root]
    del torch
    return call


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: Any) -> Any:
    if len(args) > at:
        return args[at]
    return kwargs.get(name, default)


def _tensors(value: Any) -> list[Any]:
    """The tensors of a method argument: a tensor, a list of them, or a list of lists."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        found: list[Any] = []
        for item in value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (list, tuple)):
                found.extend(t for t in item if isinstance(t, torch.Tensor))
        return found
    return []


_ranks_cache: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _ranks_of(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` in group rank order (cached per group object)."""
    import torch.distributed as dist

    cached = _ranks_cache.get(id(group))
    if cached is not None and cached[0] is group:
        return cached[1]
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError, TypeError):
        ranks = tuple(range(group.size()))
    if len(_ranks_cache) > 4096:
        _ranks_cache.clear()
    _ranks_cache[id(group)] = (group, ranks)
    return ranks


def _group_name(group: Any) -> str:
    try:
        return str(group.group_name) or hex(id(group))
    except (AttributeError, RuntimeError):
        return hex(id(group))


@functools.cache
def _c10d_globals() -> tuple[int, ...]:
    """The module dicts whose frames are torch.distributed's own calling path."""
    import torch.distributed.c10d_logger as logger
    import torch.distributed.distributed_c10d as c10d

    return (id(vars(c10d)), id(vars(logger)))


@functools.cache
def _public_names() -> frozenset[str]:
    from fsdp_testing.collectives import COLLECTIVE_NAMES

    return frozenset({*COLLECTIVE_NAMES, *_COMPOSITE, *_BATCHES, "all_reduce_coalesced"})


@functools.cache
def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep


_HARNESS = os.sep + "fsdp_testing" + os.sep + "_"


def _called_as(frame: FrameType | None) -> tuple[str | None, FrameType | None, str]:
    """From the frame that called a process group method: the outermost ``torch.distributed``
    function of the call (its name and frame; None when the group was called directly) and
    ``path:line`` of the first frame outside torch and the harness."""
    c10d, logger = _c10d_globals()
    names = _public_names()
    op: str | None = None
    outer: FrameType | None = None
    while frame is not None:
        scope = id(frame.f_globals)
        if scope == c10d:
            name = frame.f_code.co_name
            if name in _BATCHES and op is not None:
                outer = frame  # each op of a batch keeps its own name (isend, irecv)
            elif name in names:
                op, outer = name, frame
        elif scope != logger:
            break
        frame = frame.f_back
    torch_dir = _torch_dir()
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(torch_dir) and _HARNESS not in path:
            return op, outer, f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return op, outer, ""
