"""What thread mode changes in torch's threaded process group while its ranks run, and how it
wakes the group's waits without blocking: the barrier that ends making a group, collectives
told apart by their groups' members, each rank's call checked against its peers' before any
data moves, and the turns (``thread_turns.py``) handed on wherever a rank waits.

Everything here is installed by :func:`installed` for one thread-mode run and undone after it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fsdp_testing._launch import thread_p2p, thread_turns
from fsdp_testing._launch.collective_match import (
    describe_call,
    group_label,
    mismatch_message,
    reduce_op_name,
)
from fsdp_testing._launch.rank_threads import Aborted, acquire_briefly

if TYPE_CHECKING:
    from datetime import timedelta

    import torch.distributed as dist

__all__ = ["installed", "wake"]

_POLL_S = 0.25
"""How often a rank waiting for its peers' calls looks at a stop set without the lock."""


def _set_thread_isolation(enabled: bool) -> None:
    import torch

    # Private in torch: gives each thread its own view of the default process group.
    torch._C._distributed_c10d._set_thread_isolation_mode(enabled)  # type: ignore[attr-defined]


def _fresh_threaded_group_state() -> None:
    """Give torch's threaded group new locks, a new termination event and no collectives in
    flight, by assignment: ``ProcessLocalGroup.reset()`` would wait for locks that a rank
    stopped in the previous run may hold forever. See [Note: stopping rank threads]."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    group = mtpg.ProcessLocalGroup
    group._coll_lock = threading.Lock()
    group._cur_coll_on_pgs = _CollectivesByGroup()
    group._terminate = threading.Event()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """torch's threaded group, set up for one thread-mode run and put back after it."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    group = mtpg.ProcessLocalGroup
    _set_thread_isolation(True)
    _fresh_threaded_group_state()
    mtpg._install_threaded_pg()
    torch_barrier = mtpg._store_based_barrier  # see [Note: the threaded group's barrier]
    torch_methods = {name: group.__dict__[name] for name in ("_start_coll", "_end_coll", "barrier")}
    mtpg._store_based_barrier = _threaded_group_barrier
    group._start_coll = classmethod(_start_collective)  # type: ignore[assignment]
    group._end_coll = classmethod(_end_collective)  # type: ignore[assignment]
    group.barrier = _barrier  # type: ignore[method-assign]
    thread_p2p.install(group, stopped=_terminated)
    try:
        yield
    finally:
        # Never blocks: see [Note: stopping rank threads].
        thread_p2p.uninstall(group)
        for name, method in torch_methods.items():
            setattr(group, name, method)
        mtpg._store_based_barrier = torch_barrier
        _fresh_threaded_group_state()
        mtpg._uninstall_threaded_pg()
        _set_thread_isolation(False)


# [Note: the threaded group's barrier]
# torch's threaded backend ends the creation of every group with a store-based barrier
# (``_create_threaded_pg`` in ``multi_threaded_pg``). In thread mode each rank counts its
# groups on its own (thread isolation), so a group's name is the same on every rank that made
# as many groups before it, whatever its members: when each rank makes a group of its own
# (``new_group([rank])``, as torch's ``MixtureOfExperts`` does for its experts), the ranks'
# different groups share one name, and so one barrier key in the test's store. torch's barrier
# adds 1 to the key and then reads the count again in a second call; when another rank's add
# comes between the two, no rank reads exactly its group's size, no rank marks the barrier
# done, and every rank waits until the test's timeout (seen in CI: a hang in
# ``MixtureOfExperts.init`` once in some thousands of such groups). While thread mode runs,
# the threaded backend's barrier is this one, which decides on the count its own add returned:
# the rank whose arrival completes the count marks it done, and a group of one never waits.
#
# The same names met again in the group's collectives: torch's threaded group matches the
# ranks' calls of a collective by group name (``ProcessLocalGroup._cur_coll_on_pgs``), so the
# ranks' groups of one joined one collective and waited for each other forever. In thread mode
# that table is a :class:`_CollectivesByGroup`, which tells the groups apart by their members
# too, as process mode's separate processes do. The names themselves, which a test can read,
# stay torch's.


class _CollectivesByGroup(dict):
    """torch's threaded group's collectives in flight, keyed by group name as torch asks, but
    stored by name and members: see [Note: the threaded group's barrier]. A name is read in
    the calling rank's own world (thread isolation), as the group's name was."""

    def __init__(self) -> None:
        super().__init__()
        # By rank thread and name: the group and its members (a name is unique in a rank's
        # world until ``destroy_process_group()`` starts the count again, hence the check).
        self._groups: dict[tuple[int, str], tuple[Any, tuple[int, ...] | None]] = {}
        # By name and members: how many collectives the group has started.
        self.started: dict[tuple[str, tuple[int, ...] | None], int] = {}

    def key(self, name: str) -> tuple[str, tuple[int, ...] | None]:
        """``name``'s group in the calling rank's world, as (name, its ranks in the world)."""
        import torch.distributed as dist

        world = dist.distributed_c10d._world
        me = (threading.get_ident(), name)
        known = self._groups.get(me)
        if known is None or world.pg_names.get(known[0]) != name:
            group = next((pg for pg, n in world.pg_names.items() if n == name), None)
            ranks = world.pg_group_ranks.get(group) if group is not None else None
            known = self._groups[me] = (group, tuple(sorted(ranks)) if ranks else None)
        return name, known[1]

    def __contains__(self, name: object) -> bool:
        return super().__contains__(self.key(str(name)))

    def __getitem__(self, name: str) -> Any:
        return super().__getitem__(self.key(name))

    def __setitem__(self, name: str, collective: Any) -> None:
        super().__setitem__(self.key(name), collective)

    def pop(self, name: str, *default: Any) -> Any:
        return super().pop(self.key(name), *default)


def _threaded_group_barrier(
    rank: int,
    store: dist.Store,
    group_name: str,
    rendezvous_count: int,
    timeout: timedelta,
    logging_interval: timedelta | None = None,
) -> None:
    """The threaded backend's barrier after making a group of ``rendezvous_count`` ranks,
    deciding on the count ``store.add`` returns; see [Note: the threaded group's barrier]. The
    signature is torch's ``_store_based_barrier``'s (it logs who is missing every
    ``logging_interval``; here a rank that never comes is the test's timeout to report)."""
    key = f"fsdp_testing_group_barrier:{group_name}"
    if store.add(key, 1) == rendezvous_count:
        store.set(f"{key}:done", "1")
        return
    with thread_turns.waiting():
        store.wait([f"{key}:done"], timeout)


# [Note: thread mode's call check]
# torch's threaded group runs a collective with the operation of the rank that arrived first
# and the data of every rank, in group rank 0's thread: when the ranks' calls differ (another
# shape, another operation, another source), group rank 0 fails on a size error and its peers
# are stopped, so the report blamed rank 0 for rank 1's bug, or the data moved wrong silently.
# In thread mode each rank's call is described (``collective_match.py``, as local mode does)
# and the ranks of a collective wait until all have arrived; the last to arrive compares the
# calls, and when they differ every rank raises one error naming what each rank issued, before
# any data moves. Then torch's own collective runs as before (its data movement differs between
# torch versions), with the rank's turn handed on while it waits (``thread_turns.py``).


class _Calls:
    """What each rank of one collective issued, while they arrive."""

    def __init__(self, size: int, nth: int, label: str) -> None:
        self.cond = threading.Condition()
        self.size = size
        self.nth = nth
        self.label = label
        self.calls: dict[int, str] = {}  # rank in the world -> its call
        self.checked = False
        self.error: str | None = None

    def arrive(self, me: int, call: str, *, will_raise: bool = False) -> None:
        """Wait until every rank of the group issued its call; raise if the calls differ.
        ``will_raise``: this rank raises an error of its own next, so it does not take the turn
        back (a peer that raised first may have stopped the turns: the rank would be reported
        aborted instead of its error, depending on which rank was faster)."""
        with self.cond:
            self.calls[me] = call
            if len(self.calls) == self.size:
                if len(set(self.calls.values())) > 1:
                    self.error = mismatch_message(self.calls, self.nth, self.label)
                self.checked = True
                self.cond.notify_all()
        if not self.checked:
            turns = thread_turns.current()
            if turns is not None:
                turns.give()
            with self.cond:
                while not self.checked:
                    if _terminated():
                        raise Aborted()
                    self.cond.wait(_POLL_S)
            # A rank whose call raises reports at once, not after its peers' turns: the
            # launcher gives the peers of a failed rank one second (FAILURE_GRACE_S).
            if turns is not None and self.error is None and not will_raise:
                turns.take()
        if self.error is not None:
            raise RuntimeError(f"[rank {me}] mode='thread': {self.error}")


class _Arrival:
    """One rank's call of one collective: what torch's threaded group's collective methods get
    from ``_start_coll``, join and hand back to ``_end_coll``."""

    def __init__(self, collective: Any, calls: _Calls, me: int, op: Any) -> None:
        self.collective = collective
        self._calls = calls
        self._me = me
        self._op = op

    def join(self, group_rank: int, data: Any) -> Any:
        call = _describe(self._op, data)
        # Checked before the arrival, so that the error is the rank's whatever its peers do.
        gathered = type(self._op).__name__ == "AllGather"
        wrong = gathered and bool(_gather_outputs_that_differ(data))
        splits = _split_problem(self._op, data, self._calls.size)
        self._calls.arrive(self._me, call, will_raise=wrong or splits is not None)
        if gathered:
            _validate_gathered(data, self._me, call)
        if splits is not None:
            raise RuntimeError(f"[rank {self._me}] mode='thread': {call}: {splits}")
        with thread_turns.waiting():
            try:
                return self.collective.join(group_rank, data)
            except SystemExit:
                # torch's collectives exit a rank woken by the harness with
                # sys.exit("Test termination event occurs."): the test never called it.
                if getattr(self.collective, "_done", False):
                    # Group rank 0 had moved the data before a peer failed and the harness woke
                    # the waits: the collective completed, and the rank goes on to its own
                    # outcome (reported aborted, it would hide its own error whenever it was
                    # slower to leave the wait than its peer was to fail).
                    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

                    return mtpg.ret_work(data)
                if _terminated():
                    raise Aborted() from None
                raise


def _start_collective(cls: Any, op: Any, pg: Any) -> _Arrival:
    """Thread mode's ``ProcessLocalGroup._start_coll``: torch's collective for the group, one
    per call, and this rank's call, to be checked (see [Note: thread mode's call check])."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    table = cls._cur_coll_on_pgs
    name = pg.pg_name
    with cls._coll_lock:
        key = table.key(name)
        collective: Any = dict.get(table, key)
        if collective is None:
            nth = table.started[key] = table.started.get(key, 0) + 1
            collective = mtpg.Collective(pg.size(), op, cls)
            members = key[1] or tuple(range(pg.size()))
            label = group_label(name, members, _is_default(pg))
            collective.fsdp_testing_calls = _Calls(pg.size(), nth, label)
            dict.__setitem__(table, key, collective)
    members = key[1] or tuple(range(pg.size()))
    return _Arrival(collective, collective.fsdp_testing_calls, members[pg.rank()], op)


class _Barrier:
    """A barrier's operation: nothing to move once every rank arrived."""

    def work(self, data: Any) -> None:
        pass


def _barrier(pg: Any, opts: Any = None) -> Any:
    """Thread mode's ``ProcessLocalGroup.barrier``: a collective of its own, described as
    ``barrier()``. (torch's all-reduces ``torch.ones(1)`` in the default dtype, which differs
    between ranks once each rank has its own, and matches any rank's all-reduce of one
    element.)"""
    arrival = pg._start_coll(_Barrier(), pg)
    work = arrival.join(pg.rank(), [])
    pg._end_coll(arrival, pg)
    return work


def _end_collective(cls: Any, arrival: Any, pg: Any) -> None:
    """Thread mode's ``ProcessLocalGroup._end_coll``: the first rank out forgets the
    collective, so the group's next call starts a new one."""
    collective = getattr(arrival, "collective", arrival)
    table = cls._cur_coll_on_pgs
    with cls._coll_lock:
        key = table.key(pg.pg_name)
        if dict.get(table, key) is collective:
            dict.pop(table, key)


def _is_default(pg: Any) -> bool:
    import torch.distributed as dist

    return pg is dist.distributed_c10d._world.default_pg


def _terminated() -> bool:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    return bool(mtpg.ProcessLocalGroup._terminate.is_set())


def _describe(op: Any, data: Any) -> str:
    """One rank's call of torch's threaded collective ``op`` on ``data``, as local mode
    describes its own (``collective_match.describe_call``)."""
    kind = type(op).__name__
    if isinstance(op, _Barrier):
        return "barrier()"
    if kind == "AllReduce":
        return describe_call("all_reduce", data, reduce_op_name(op.op))
    if kind == "Broadcast":
        return describe_call("broadcast", data, f"src {op.src}")
    if kind == "AllGather":
        wrong = _gather_outputs_that_differ(data)
        return describe_call("all_gather", data[1], f"into {wrong}" if wrong else "")
    if kind == "ReduceScatter":
        return describe_call("reduce_scatter", [*data[0], *data[1][0]], reduce_op_name(op.op))
    if kind == "Scatter":
        return describe_call("scatter", data[0], f"src {op.src}")
    if kind == "Gather":
        return describe_call("gather", data[1], f"dst {op.dst}")
    if kind == "AllToAll":
        return describe_call("all_to_all", data[1])
    if kind == "AllToAllBase":
        return "all_to_all_single"  # uneven splits give the ranks tensors of other shapes
    from torch.utils import _pytree as pytree

    return describe_call(kind, [t for t in pytree.tree_leaves(data) if hasattr(t, "dtype")])


def _gather_outputs_that_differ(data: Any) -> str:
    """An all-gather's outputs where they are not one tensor of the input's size per rank
    (``float32[2], float32[2]``: torch's threaded group cuts ``all_gather_single``'s output in
    world-size pieces and copies each input into its piece, broadcasting a smaller one where a
    real backend raises); empty when they are."""
    outputs, inputs = data[0][0], data[1]
    if all(o.numel() == inputs[0].numel() and o.dtype == inputs[0].dtype for o in outputs):
        return ""
    return describe_call("", outputs)[1:-1]


def _split_problem(op: Any, data: Any, size: int) -> str | None:
    """What is wrong with one rank's ``all_to_all_single`` splits, as gloo checks them on every
    rank (each split list has one size per rank and sums to its tensor's first dim; without
    one, that dim divides by the group's size); None when nothing is. torch's threaded group
    checks nothing and fails in group rank 0's thread on a copy of mismatched sizes, blaming
    rank 0 and aborting its peers."""
    if type(op).__name__ != "AllToAllBase":
        return None
    output, input_, out_splits, in_splits = data
    for what, tensor, splits in (("input", input_, in_splits), ("output", output, out_splits)):
        rows = tensor.size(0) if tensor.dim() else 1
        if splits is None or len(splits) == 0:
            if rows % size:
                return (
                    f"the {what}'s first dim ({rows}) does not divide by the group's {size} "
                    f"ranks; pass {what}_split_sizes (gloo: Tensor's dim 0 does not divide "
                    "equally across group size)"
                )
            continue
        sizes = [int(x) for x in splits]
        if len(sizes) != size or sum(sizes) != rows:
            return (
                f"{what}_split_sizes {sizes} must give one size per rank of the group's {size} "
                f"and sum to the {what}'s first dim ({rows}) (gloo: Split sizes doesn't match "
                "total dim 0 size)"
            )
    return None


def _validate_gathered(data: Any, me: int, call: str) -> None:
    """Every rank issued the same all-gather with outputs that cannot hold the inputs: each
    raises, as each gloo rank does."""
    if _gather_outputs_that_differ(data):
        raise RuntimeError(
            f"[rank {me}] mode='thread': {call}: an all-gather's output must hold one tensor of "
            "the input's size and dtype per rank (all_gather_single and "
            "all_gather_into_tensor: an output of world_size times the input's elements)"
        )


def wake() -> None:
    """Make every rank waiting in a threaded-group collective leave it (as
    :class:`Aborted`), without blocking; the ranks stop taking turns."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    turns = thread_turns.current()
    if turns is not None:
        turns.stop()
    group = mtpg.ProcessLocalGroup
    # A set event in place of the old one: Event.set() would take the old event's lock, which
    # a rank stopped inside it may hold forever. The waits read it through the class.
    terminate = threading.Event()
    terminate.set()
    group._terminate = terminate
    for coll in list(group._cur_coll_on_pgs.values()):
        calls = getattr(coll, "fsdp_testing_calls", None)
        conds = (coll._start_cond, coll._done_cond, *([calls.cond] if calls else []))
        for cond in conds:
            if acquire_briefly(cond):
                try:
                    cond.notify_all()
                finally:
                    cond.release()
