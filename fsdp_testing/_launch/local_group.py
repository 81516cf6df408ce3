"""Local mode's process group: every rank's group object is a Python ``ProcessGroup`` whose
collectives meet in this process.

A collective completes when the last rank of its group arrives: that rank computes every
rank's output, with gloo's arithmetic (``local_reduce.py``), writes it into each rank's
tensors and lets them run again; the others wait on the baton meanwhile (see [Note: local
mode] in ``baton.py``). So a collective returns completed, async or not, and a rank never waits
outside the baton (torch's C++ code, which waits on futures without releasing a baton, only
ever sees completed work). The k-th collective of a rank on a group meets the k-th of every
other rank of that group; if they are not the same operation on tensors of the same shapes, all
of them raise an error naming what each rank issued, where a real backend would hang, fail or
mix data silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch.futures import Future

from fsdp_testing._launch import local_reduce
from fsdp_testing._launch.baton import Baton
from fsdp_testing._launch.collective_match import describe_call as _describe
from fsdp_testing._launch.collective_match import group_label, mismatch_message
from fsdp_testing._launch.collective_match import ordinal as _ordinal
from fsdp_testing._launch.collective_match import reduce_op_name as _op_name
from fsdp_testing._launch.mailbox import Mailbox, Transfer, self_send_error
from fsdp_testing._launch.rank_threads import Aborted
from fsdp_testing._rank.comm_observer import current_recorder
from fsdp_testing._report.collective_log import call_name
from fsdp_testing._report.text import short_place
from fsdp_testing.collectives import family_of

__all__ = ["LocalGroup", "LocalWorld", "create_local_group", "register_backend"]

BACKEND = "local"


@dataclasses.dataclass
class _Meeting:
    """One collective of one group, while its ranks arrive."""

    payloads: dict[int, Any] = dataclasses.field(default_factory=dict)  # group rank -> data
    signatures: dict[int, str] = dataclasses.field(default_factory=dict)
    shown: dict[int, str] = dataclasses.field(default_factory=dict)  # as each rank called it
    done: bool = False
    error: str | None = None


class LocalWorld:
    """What the ranks of one local world share: the baton and the collectives in flight.

    Args:
        baton: the world's scheduler.
    """

    def __init__(self, baton: Baton) -> None:
        self.baton = baton
        self.meetings: dict[tuple[str, int], _Meeting] = {}
        self.mailbox = Mailbox()


_current: LocalWorld | None = None


def set_current_world(world: LocalWorld | None) -> None:
    """The world that ``init_process_group("local", ...)`` and ``new_group`` join."""
    global _current
    _current = world


def _reduce_op(opts: Any) -> Any:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    return getattr(op, "op", op)


def _as_called(signature: str) -> str:
    """``signature`` (named after the group method torch reached, e.g.
    ``all_gather_into_tensor(...)``) with the collective named as the rank's code called it:
    the rank's collective log holds the ``torch.distributed`` function it entered
    (``all_gather_single``, ``_all_gather_base``), when that is a spelling of the same
    collective. Ranks are matched on ``signature``, so two spellings of one collective meet."""
    op = signature.split("(", 1)[0]
    recorder = current_recorder()
    called = recorder.entries[-1] if recorder is not None and recorder.entries else None
    if called is None or called.get("state") != "entered" or called["op"] == op:
        return signature
    family = family_of(op)
    if family is None or family_of(called["op"]) != family:
        return signature
    return called["op"] + signature[len(op) :]


def _completed(result: Any) -> dist.Work:
    future: Future[Any] = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _flat(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().reshape(-1) for t in tensors]


class LocalGroup(dist.ProcessGroup):
    """One rank's view of one group of a local world (see the module's docstring).

    Args:
        world: the local world.
        name: the group's name (the same on every rank).
        group_rank: this rank's index in the group.
        global_ranks: the group's ranks in the world, by group rank.
        default: whether this is the default group (the world).
    """

    def __init__(
        self,
        world: LocalWorld,
        name: str,
        group_rank: int,
        global_ranks: list[int],
        default: bool = False,
    ) -> None:
        super().__init__(group_rank, len(global_ranks))  # type: ignore[call-arg]
        self._world = world
        self._name = name
        self._rank = group_rank
        self._size = len(global_ranks)
        self._global_ranks = global_ranks
        self._default = default
        self._seq = 0

    def size(self) -> int:
        return self._size

    @property
    def group_name(self) -> str:  # type: ignore[override]
        # torch keeps a group's name on its backends; this group is its own backend.
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"LocalGroup(name={self._name!r}, rank={self._rank}, size={self._size})"

    # --- the meeting -------------------------------------------------------------------------

    def _meet(
        self,
        signature: str,
        payload: Any,
        finish: Callable[[list[Any]], None],
        result: Any = None,
    ) -> dist.Work:
        world, me = self._world, self._global_ranks[self._rank]
        if world.baton.broken:
            raise Aborted()
        self._seq += 1
        meeting = world.meetings.setdefault((self._name, self._seq), _Meeting())
        meeting.payloads[self._rank] = payload
        meeting.signatures[self._rank] = signature
        shown = meeting.shown[self._rank] = _as_called(signature)
        if len(meeting.payloads) == self._size:
            del world.meetings[(self._name, self._seq)]
            if len(set(meeting.signatures.values())) > 1:
                meeting.error = self._mismatch(meeting)
            else:
                try:
                    finish([meeting.payloads[r] for r in range(self._size)])
                except Exception as exc:
                    meeting.error = f"{shown} failed: {type(exc).__name__}: {exc}"
            meeting.done = True
            world.baton.wake(self._global_ranks)
        else:
            what = f"{shown}, the {_ordinal(self._seq)} collective of {self._label()}"
            world.baton.block(me, what, lambda: meeting.done)
        if meeting.error is not None:
            raise RuntimeError(f"[rank {me}] mode='local': {meeting.error}")
        return _completed(result)

    def _label(self) -> str:
        return group_label(self._name, self._global_ranks, self._default)

    def _mismatch(self, meeting: _Meeting) -> str:
        calls = {self._global_ranks[r]: shown for r, shown in meeting.shown.items()}
        return mismatch_message(calls, self._seq, self._label())

    # --- reductions ----------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = _reduce_op(opts)

        def finish(payloads: list[list[torch.Tensor]]) -> None:
            for i in range(len(payloads[0])):
                out = local_reduce.all_reduce(_flat([p[i] for p in payloads]), op)
                for p in payloads:
                    p[i].detach().copy_(out.view(p[i].shape))

        sig = _describe("all_reduce", tensors, _op_name(opts))
        return self._meet(sig, tensors, finish, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _reduce_op(opts)

        def finish(payloads: list[list[torch.Tensor]]) -> None:
            # gloo all-reduces the concatenation of the tensors.
            out = local_reduce.all_reduce([torch.cat(_flat(p)) for p in payloads], op)
            for p in payloads:
                for t, piece in zip(p, out.split([t.numel() for t in p]), strict=True):
                    t.detach().copy_(piece.view(t.shape))

        sig = _describe("all_reduce_coalesced", tensors, _op_name(opts))
        return self._meet(sig, tensors, finish, tensors)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        op = _reduce_op(opts)

        def finish(payloads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            # gloo all-reduces the whole input, then each rank keeps its chunk.
            out = local_reduce.all_reduce(_flat([p[1] for p in payloads]), op)
            for r, (o, _) in enumerate(payloads):
                o.detach().copy_(out.view(payloads[r][1].shape).chunk(self._size)[r].view(o.shape))

        sig = _describe("reduce_scatter_tensor", (output, input), _op_name(opts))
        return self._meet(sig, (output, input), finish, [output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        op = _reduce_op(opts)

        def finish(payloads: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            # gloo all-reduces each rank's piece on its own (measured: not the concatenation).
            for i in range(len(payloads[0][0])):
                for r, p in enumerate(payloads):
                    piece = local_reduce.all_reduce(_flat([q[1][i][r] for q in payloads]), op)
                    p[0][i].detach().copy_(piece.view(p[0][i].shape))

        sig = _describe("reduce_scatter", [*outputs, *inputs[0]], _op_name(opts))
        return self._meet(sig, (outputs, inputs), finish, outputs)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        work = None
        for output, input in zip(outputs, inputs, strict=True):
            work = self.reduce_scatter_single(output, input, opts)
        assert work is not None
        return work

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = _reduce_op(opts)
        root = opts.rootRank if opts is not None else 0

        def finish(payloads: list[list[torch.Tensor]]) -> None:
            out = local_reduce.all_reduce(_flat([p[0] for p in payloads]), op)
            payloads[root][0].detach().copy_(out.view(payloads[root][0].shape))

        sig = _describe("reduce", tensors, f"{_op_name(opts)}, dst {root}")
        return self._meet(sig, tensors, finish, tensors)

    # --- copies ----------------------------------------------------------------------------------

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        def finish(payloads: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for i in range(len(payloads[0][1])):
                for outs, _ in payloads:
                    for src, (_, ins) in enumerate(payloads):
                        outs[i][src].detach().copy_(ins[i])

        sig = _describe("all_gather", inputs)
        return self._meet(sig, (outputs, inputs), finish, outputs)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        def finish(payloads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for out, _ in payloads:
                for src, chunk in enumerate(out.detach().chunk(self._size)):
                    chunk.copy_(payloads[src][1].view(chunk.shape))

        sig = _describe("all_gather_into_tensor", (output, input))
        return self._meet(sig, (output, input), finish, [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        work = None
        for output, input in zip(outputs, inputs, strict=True):
            work = self.all_gather_single(output, input, opts)
        assert work is not None
        return work

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self.allgather([list(o) for o in zip(*outputs, strict=True)], inputs, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0

        def finish(payloads: list[list[torch.Tensor]]) -> None:
            for p in payloads:
                for t, src in zip(p, payloads[root], strict=True):
                    if t is not src:
                        t.detach().copy_(src)

        return self._meet(_describe("broadcast", tensors, f"src {root}"), tensors, finish, tensors)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        root = opts.rootRank if opts is not None else 0

        def finish(payloads: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            sources = payloads[root][1][0]
            for r, (outs, _) in enumerate(payloads):
                outs[0].detach().copy_(sources[r])

        sig = _describe("scatter", outputs, f"src {root}")
        return self._meet(sig, (outputs, inputs), finish, outputs)

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        root = opts.rootRank if opts is not None else 0

        def finish(payloads: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            targets = payloads[root][0][0]
            for r, (_, ins) in enumerate(payloads):
                targets[r].detach().copy_(ins[0])

        sig = _describe("gather", inputs, f"dst {root}")
        return self._meet(sig, (outputs, inputs), finish, outputs)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        def finish(payloads: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            for dst, (outs, _) in enumerate(payloads):
                for src, (_, ins) in enumerate(payloads):
                    outs[src].detach().copy_(ins[dst])

        return self._meet(_describe("all_to_all", inputs), (outputs, inputs), finish, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> dist.Work:
        def splits(t: torch.Tensor, sizes: list[int] | None) -> list[torch.Tensor]:
            return list(t.detach().split(sizes) if sizes else t.detach().chunk(self._size))

        def finish(payloads: list[tuple[torch.Tensor, torch.Tensor, Any, Any]]) -> None:
            ins = [splits(p[1], p[3]) for p in payloads]
            for dst, p in enumerate(payloads):
                for src, piece in enumerate(splits(p[0], p[2])):
                    piece.copy_(ins[src][dst])

        sig = "all_to_all_single"
        payload = (output, input, output_split_sizes, input_split_sizes)
        return self._meet(sig, payload, finish, [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch 2.11 calls this name

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._meet("barrier()", None, lambda payloads: None)

    # --- point to point (gloo's rules: see ``mailbox.py``) ---------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        me, peer = self._global_ranks[self._rank], self._global_ranks[dst]
        if peer == me:
            raise ValueError(self_send_error("local", me, "a send"))
        transfer = self._world.mailbox.send(self._name, me, peer, tag, tensors[0])
        return self._transfer_work(transfer)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        me, peer = self._global_ranks[self._rank], self._global_ranks[src]
        if peer == me:
            raise ValueError(self_send_error("local", me, "a receive"))
        transfer = self._world.mailbox.recv(self._name, peer, me, tag, tensors[0])
        return self._transfer_work(transfer)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        me = self._global_ranks[self._rank]
        transfer = self._world.mailbox.recv(self._name, None, me, tag, tensors[0])
        return self._transfer_work(transfer)

    def _transfer_work(self, transfer: Transfer) -> dist.Work:
        if transfer.done:
            # This rank's op met one its peer posted earlier: the peer may wait on it.
            partner = transfer.source if transfer.peer is None else transfer.peer
            if partner is not None:
                self._world.baton.wake([partner])
            if transfer.error is not None:
                raise RuntimeError(transfer.error)
        return _local_work_class()(self, transfer)

    def _wait_transfer(self, transfer: Transfer) -> None:
        world, me = self._world, self._global_ranks[self._rank]
        if not transfer.done:
            entry = transfer.entry
            what = call_name(entry) if entry else "a point-to-point op"
            if entry and entry.get("at"):
                what += f" (at {short_place(entry['at'])})"
            world.baton.block(me, what, lambda: transfer.done)
        if transfer.error is not None:
            raise RuntimeError(transfer.error)


_local_work: type | None = None


def _local_work_class() -> type:
    """The work of a local-mode message: ``wait`` hands the baton on until its peer's op met
    it (see [Note: local mode] in ``baton.py``)."""
    global _local_work
    if _local_work is not None:
        return _local_work

    class TransferWork(dist.Work):
        def __init__(self, group: LocalGroup, transfer: Transfer) -> None:
            super().__init__()
            self._group = group
            self._transfer = transfer

        def wait(self, timeout: Any = None) -> bool:
            self._group._wait_transfer(self._transfer)
            return True

        def is_completed(self) -> bool:
            return self._transfer.done

        def is_success(self) -> bool:
            return self._transfer.done and self._transfer.error is None

        def exception(self) -> Any:
            error = self._transfer.error
            return RuntimeError(error) if error is not None else None

        def _source_rank(self) -> int:
            ranks = self._group._global_ranks
            source = self._transfer.source
            return ranks.index(source) if source in ranks else -1

        def source_rank(self) -> int:
            return self._source_rank()

        def result(self) -> list[torch.Tensor]:
            return [self._transfer.tensor]

        def synchronize(self) -> None:
            self.wait()

    _local_work = TransferWork
    return TransferWork


def create_local_group(options: Any, backend_options: Any) -> LocalGroup:
    """The backend's creator (``Backend.register_backend(..., extended_api=True)``)."""
    if _current is None:
        raise RuntimeError(
            "backend 'local' exists only inside a test marked "
            "@pytest.mark.distributed(..., mode='local')"
        )
    ranks = list(options.global_ranks_in_group)
    default = not ranks
    if default:
        ranks = list(range(_current.baton.world_size))
    return LocalGroup(_current, str(options.group_id), options.group_rank, ranks, default)


def register_backend() -> None:
    """Make ``init_process_group("local", ...)`` create :class:`LocalGroup` objects (once)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND, create_local_group, extended_api=True, devices=["cpu"]
        )
