"""Thread mode's point-to-point ops: ``send``, ``recv`` and ``recv_anysource`` on torch's threaded
process group, which has none (torch's raised "No backend type associated with device type cpu"
at the first ``dist.send``), with gloo's rules (``mailbox.py``). ``dist.isend``/``dist.irecv``,
``dist.P2POp`` with ``batch_isend_irecv`` and ``torch.distributed.pipelining`` run on them as in
process mode. A rank waiting for its message hands its turn on (``thread_turns.py``) and leaves
the wait, as :class:`Aborted`, when the harness stops the world.

Installed by ``thread_group.installed()`` for one thread-mode run and removed after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fsdp_testing._launch import thread_turns
from fsdp_testing._launch.mailbox import Mailbox, Transfer, self_send_error
from fsdp_testing._launch.rank_threads import Aborted

__all__ = ["install", "pending", "uninstall"]

_POLL_S = 0.1
_METHODS = ("send", "recv", "recv_anysource")

_mailbox: Mailbox | None = None
_stopped: Callable[[], bool] = lambda: False  # noqa: E731
_cond = threading.Condition()


def install(group_class: type, stopped: Callable[[], bool]) -> None:
    """Give torch's threaded group (``group_class``) point-to-point methods and a fresh mailbox;
    a rank waiting for a message leaves the wait (as :class:`Aborted`) once ``stopped()``."""
    global _mailbox, _stopped
    _mailbox = Mailbox()
    _stopped = stopped
    group_class.send = _send  # type: ignore[attr-defined]
    group_class.recv = _recv  # type: ignore[attr-defined]
    group_class.recv_anysource = _recv_anysource  # type: ignore[attr-defined]


def uninstall(group_class: type) -> None:
    """Take the methods off again (what a test left posted is in :func:`pending` until the next
    :func:`install`)."""
    for name in _METHODS:
        if name in group_class.__dict__:
            delattr(group_class, name)


def pending() -> list[Transfer]:
    """Sends and receives posted in the last run that never met their peer's."""
    return _mailbox.pending() if _mailbox is not None else []


def _box() -> Mailbox:
    if _mailbox is None:  # pragma: no cover - installed around every thread-mode run
        raise AssertionError("thread mode's mailbox is not installed")
    return _mailbox


def _where(pg: Any) -> tuple[str, list[int]]:
    """The group's key in the mailbox (its name and members: thread mode's groups of one name
    are told apart by their members) and its global ranks."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(pg)
    return f"{pg.pg_name}{tuple(ranks)}", ranks


def _send(pg: Any, tensors: list[Any], dst: int, tag: int = 0) -> Any:
    key, ranks = _where(pg)
    me = ranks[pg.rank()]
    if ranks[dst] == me:
        raise ValueError(self_send_error("thread", me, "a send"))
    transfer = _box().send(key, me, ranks[dst], tag, tensors[0])
    return _work(transfer, ranks)


def _recv(pg: Any, tensors: list[Any], src: int, tag: int = 0) -> Any:
    key, ranks = _where(pg)
    me = ranks[pg.rank()]
    if ranks[src] == me:
        raise ValueError(self_send_error("thread", me, "a receive"))
    transfer = _box().recv(key, ranks[src], me, tag, tensors[0])
    return _work(transfer, ranks)


def _recv_anysource(pg: Any, tensors: list[Any], tag: int = 0) -> Any:
    key, ranks = _where(pg)
    transfer = _box().recv(key, None, ranks[pg.rank()], tag, tensors[0])
    return _work(transfer, ranks)


def _work(transfer: Transfer, ranks: list[int]) -> Any:
    with _cond:
        _cond.notify_all()  # a peer waiting for this message looks again
    return _work_class()(transfer, ranks)


_work_type: type | None = None


def _work_class() -> type:
    global _work_type
    if _work_type is not None:
        return _work_type
    import torch.distributed as dist

    class TransferWork(dist.Work):
        """A thread-mode message's work: ``wait`` until its peer's op met it."""

        def __init__(self, transfer: Transfer, ranks: list[int]) -> None:
            super().__init__()
            self._transfer = transfer
            self._ranks = ranks

        def wait(self, timeout: Any = None) -> bool:
            transfer = self._transfer
            if not transfer.done:
                with thread_turns.waiting(), _cond:
                    while not transfer.done:
                        if _stopped():
                            raise Aborted()
                        _cond.wait(_POLL_S)
            if transfer.error is not None:
                raise RuntimeError(transfer.error)
            return True

        def is_completed(self) -> bool:
            return self._transfer.done

        def is_success(self) -> bool:
            return self._transfer.done and self._transfer.error is None

        def exception(self) -> Any:
            error = self._transfer.error
            return RuntimeError(error) if error is not None else None

        def _source_rank(self) -> int:
            source = self._transfer.source
            return self._ranks.index(source) if source in self._ranks else -1

        def source_rank(self) -> int:
            return self._source_rank()

        def result(self) -> list[Any]:
            return [self._transfer.tensor]

        def synchronize(self) -> None:
            self.wait()

    _work_type = TransferWork
    return TransferWork
