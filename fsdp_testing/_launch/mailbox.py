"""Point-to-point messages between the ranks of an in-process world (thread and local mode), with
gloo's rules: a message meets on its channel (group, source, destination, tag), the k-th send
meets the k-th receive there, it is handed over only once both sides are posted (a blocking send
waits for its receive, as gloo's does), the receive gets the sender's bytes and must be exactly
their size (gloo aborts the receiving process otherwise; here the receive raises an error that
names both ranks, both sizes and both lines), and no rank sends to itself (gloo raises "Pair is
not connected"; here the error says what happened).

The mailbox only matches and copies; how a rank waits for its transfer to be done is its world's
(thread mode waits on a condition, local mode hands the baton on).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any

from fsdp_testing._rank.comm_observer import current_recorder, self_peer_error
from fsdp_testing._report.collective_log import call_name
from fsdp_testing._report.text import short_place

__all__ = ["Mailbox", "Transfer", "self_send_error"]


@dataclasses.dataclass(eq=False)
class Transfer:
    """One posted send or receive."""

    rank: int
    """The rank that posted it (global)."""
    peer: int | None
    """The other rank (global); None: a receive from any rank."""
    tag: int
    tensor: Any
    entry: dict[str, Any] | None
    """Its entry in the posting rank's collective log (names it in errors)."""
    done: bool = False
    error: str | None = None
    source: int | None = None
    """A receive's source once matched (global)."""


def _name(transfer: Transfer) -> str:
    entry = transfer.entry
    if entry is None:
        return "a send" if transfer.tensor is None else "an op"
    at = entry.get("at")
    return f"{call_name(entry)}" + (f" (at {short_place(at)})" if at else "")


def _bytes(tensor: Any) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{tensor.numel() * tensor.element_size()} bytes ({dtype}{list(tensor.shape)})"


def self_send_error(mode: str, rank: int, what: str) -> str:
    """The error of a rank that sends to or receives from itself (``what``: the op, where its
    log has no entry)."""
    entry = _entry()
    return self_peer_error(rank, call_name(entry) if entry else what, mode)


class Mailbox:
    """The messages of one in-process world, by channel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # channel -> posted sends, oldest first; channel -> posted receives
        self._sends: dict[tuple[str, int, int, int], deque[Transfer]] = {}
        self._recvs: dict[tuple[str, int, int, int], deque[Transfer]] = {}
        # (group, destination, tag) -> receives from any rank
        self._any: dict[tuple[str, int, int], deque[Transfer]] = {}

    def send(self, group: str, src: int, dst: int, tag: int, tensor: Any) -> Transfer:
        """Post a send; done at once if its receive was posted."""
        send = Transfer(src, dst, tag, tensor, _entry())
        with self.lock:
            waiting = self._recvs.get((group, src, dst, tag))
            if waiting:
                self._hand_over(send, waiting.popleft())
                return send
            anyone = self._any.get((group, dst, tag))
            if anyone:
                self._hand_over(send, anyone.popleft())
                return send
            self._sends.setdefault((group, src, dst, tag), deque()).append(send)
        return send

    def recv(self, group: str, src: int | None, dst: int, tag: int, tensor: Any) -> Transfer:
        """Post a receive (``src`` None: from any rank); done at once if its send was posted."""
        recv = Transfer(dst, src, tag, tensor, _entry())
        with self.lock:
            if src is not None:
                queued = self._sends.get((group, src, dst, tag))
                if queued:
                    self._hand_over(queued.popleft(), recv)
                    return recv
                self._recvs.setdefault((group, src, dst, tag), deque()).append(recv)
                return recv
            for (g, _src, d, t), queued in sorted(self._sends.items(), key=lambda kv: kv[0][1]):
                if (g, d, t) == (group, dst, tag) and queued:
                    self._hand_over(queued.popleft(), recv)
                    return recv
            self._any.setdefault((group, dst, tag), deque()).append(recv)
        return recv

    def pending(self) -> list[Transfer]:
        """Every send and receive posted and not matched."""
        with self.lock:
            queues = [*self._sends.values(), *self._recvs.values(), *self._any.values()]
            return [t for queue in queues for t in queue]

    def _hand_over(self, send: Transfer, recv: Transfer) -> None:
        """Copy ``send``'s bytes into ``recv``'s tensor (inside the lock)."""
        src, dst = send.tensor.detach(), recv.tensor.detach()
        sent, room = src.numel() * src.element_size(), dst.numel() * dst.element_size()
        recv.source = send.rank
        if sent != room:
            recv.error = (
                f"[rank {recv.rank}] a message's size differs from its receive: rank "
                f"{send.rank}'s {_name(send)} sends {_bytes(src)} but rank {recv.rank}'s "
                f"{_name(recv)} receives {_bytes(dst)} (gloo aborts the receiving process "
                "here: 'Received data size doesn't match expected size')"
            )
        else:
            import torch

            try:
                flat = src.contiguous().reshape(-1)
                dst.view(-1).view(torch.uint8).copy_(flat.view(torch.uint8))
            except RuntimeError as exc:
                recv.error = f"[rank {recv.rank}] {_name(recv)}: {exc}"
        send.done = recv.done = True


def _entry() -> dict[str, Any] | None:
    recorder = current_recorder()
    if recorder is None or not recorder.entries:
        return None
    entry = recorder.entries[-1]
    return entry if entry.get("state") == "entered" and entry.get("p2p") else None
