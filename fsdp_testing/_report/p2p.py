"""Point-to-point ops in the ranks' collective logs: which messages met, which are pending, which
never can meet, and sends and receives whose sizes or dtypes differ.

A message meets on its channel, (group, source, destination, tag): the k-th send of a source on a
channel meets the k-th receive of its destination there (gloo's and nccl's rule, and the
in-process worlds'). Each log entry carries its place on its channel (``seq``) and every log
counts the messages of each of its channels since the test began (``Observation.channels``), so
two ranks' logs say whether an op has its partner even after the ring lost older entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_testing._report.collective_log import call_name, channel_key
from fsdp_testing._report.text import rank_label, short_place

__all__ = [
    "PENDING",
    "channel_count",
    "channel_of",
    "describe_p2p",
    "dtype_mismatches",
    "is_p2p",
    "never_reached",
    "partner",
    "pending_p2p",
    "unmatched",
]

#: The most findings :func:`describe_p2p` lists (the rest are counted).
LINES_SHOWN = 10
#: States of an op that has not completed.
PENDING = ("entered", "issued", "waiting")

Records = Mapping[int, list[dict[str, Any]]]
Channels = Mapping[int, Mapping[str, int] | None]


def is_p2p(entry: dict[str, Any]) -> bool:
    return bool(entry.get("p2p")) and "fault" not in entry


def channel_of(entry: dict[str, Any], rank: int) -> str | None:
    """The channel of a logged op of ``rank`` (None: a receive from any rank)."""
    peer = entry.get("peer")
    if peer is None:
        return None
    src, dst = (rank, peer) if entry["family"] == "send" else (peer, rank)
    return channel_key(entry["group"], src, dst, int(entry.get("tag", 0)))


def channel_count(
    records: Records, channels: Channels, rank: int, key: str, family: str
) -> int | None:
    """How many ops of ``family`` (send or recv) ``rank`` issued on channel ``key`` since the
    test began; None where its log cannot tell (counts unknown and the ring may have lost
    entries)."""
    counts = channels.get(rank)
    if counts is not None:
        return int(counts.get(key, 0))
    entries = records.get(rank)
    if entries is None:
        return None
    seqs = [
        int(e["seq"])
        for e in entries
        if is_p2p(e) and e["family"] == family and channel_of(e, rank) == key and "seq" in e
    ]
    if seqs:
        return max(seqs)
    return 0 if len(entries) < 32 else None


def pending_p2p(records: Records) -> dict[int, list[dict[str, Any]]]:
    """Per rank, its point-to-point ops not completed (oldest first)."""
    found = {
        rank: [e for e in entries if is_p2p(e) and e["state"] in PENDING]
        for rank, entries in records.items()
    }
    return {rank: ops for rank, ops in found.items() if ops}


def partner(
    records: Records, rank: int, entry: dict[str, Any]
) -> tuple[int, dict[str, Any] | None] | None:
    """The op that ``entry`` (an op of ``rank``) meets: (the peer, the peer's entry, None when
    its log lost it); None for a receive from any rank."""
    key = channel_of(entry, rank)
    if key is None or "seq" not in entry:
        return None
    peer = int(entry["peer"])
    want = "recv" if entry["family"] == "send" else "send"
    for e in records.get(peer, []):
        if is_p2p(e) and e["family"] == want and e.get("seq") == entry["seq"]:
            if channel_of(e, peer) == key:
                return peer, e
    return peer, None


def unmatched(records: Records, channels: Channels, rank: int, entry: dict[str, Any]) -> bool:
    """Whether the peer of ``entry`` (a pending op of ``rank``) has issued no op that meets it."""
    key = channel_of(entry, rank)
    if key is None or "seq" not in entry:
        return False
    want = "recv" if entry["family"] == "send" else "send"
    count = channel_count(records, channels, int(entry["peer"]), key, want)
    return count is not None and count < int(entry["seq"])


def never_reached(
    records: Records, channels: Channels, busy: set[int] | frozenset[int]
) -> dict[int, list[tuple[int, dict[str, Any]]]]:
    """The ranks that hold the others' messages up: for each rank of ``busy`` (running, but in no
    recorded call) whose peers wait in an op it has not issued the partner of, those peers and
    their ops (``{1: [(0, rank 0's recv #1 from rank 1)]}``)."""
    found: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for rank, ops in sorted(pending_p2p(records).items()):
        for e in ops:
            peer = e.get("peer")
            if peer is not None and peer in busy and unmatched(records, channels, rank, e):
                found.setdefault(int(peer), []).append((rank, e))
    return found


def _op(rank: int, entry: dict[str, Any], where: Mapping[int, str] | None) -> str:
    at = entry.get("at")
    line = f" at {short_place(at)}" if at else ""
    return f"{rank_label(rank, where)}'s {call_name(entry)}{line}"


def _size(entry: dict[str, Any]) -> str:
    shapes = entry.get("shapes") or [[]]
    return f"{entry.get('bytes', '?')} bytes ({entry.get('dtype')}{shapes[0]})"


def describe_p2p(
    records: Records,
    channels: Channels,
    *,
    finished: Mapping[int, str] | None = None,
    where: Mapping[int, str] | None = None,
) -> list[str]:
    """One line per finding about the ranks' point-to-point ops: sizes that differ between a
    send and the receive it meets (both ranks, shapes and lines), sends nobody receives and
    receives nobody sends (naming the peer's op with another tag, or where the peer's messages
    went instead), and each rank's ops still pending. ``finished``: ranks that ended their
    test, with how (``"returned"``)."""
    finished = finished or {}
    lines: list[str] = []
    # Sizes: any op whose partner's size differs, pending or not (gloo aborts the receiver).
    seen: set[tuple[int, int]] = set()
    for rank, entries in sorted(records.items()):
        for e in entries:
            if not is_p2p(e) or e["family"] != "recv":
                continue
            met = partner(records, rank, e)
            if met is None or (rank, id(e)) in seen:
                continue
            peer, send = met
            if send is None:
                continue
            seen.add((rank, id(e)))
            if send.get("bytes") != e.get("bytes"):
                lines.append(
                    f"size mismatch: {_op(peer, send, where)} sends {_size(send)} but "
                    f"{_op(rank, e, where)} receives {_size(e)}"
                )
    pending = pending_p2p(records)
    for rank, ops in sorted(pending.items()):
        for e in ops:
            if not unmatched(records, channels, rank, e):
                continue
            peer = int(e["peer"])
            how = finished.get(peer)
            state = f", and it {how}" if how else ""
            other = _other_tag(records, rank, e, where)
            if e["family"] == "send":
                none = other or (
                    f"{rank_label(peer, where)} posted none from {rank_label(rank, where)}"
                    f"{_on_tag(e)}"
                )
                lines.append(
                    f"{_op(rank, e, where)} has no matching recv: {none}"
                    f"{state}{_instead(records, peer, rank, 'recv', where)}"
                )
            else:
                none = other or (
                    f"{rank_label(peer, where)} sent nothing to {rank_label(rank, where)}"
                    f"{_on_tag(e)}"
                )
                lines.append(
                    f"{_op(rank, e, where)} has no matching send: {none}"
                    f"{state}{_instead(records, peer, rank, 'send', where)}"
                )
    if len(lines) > LINES_SHOWN:
        lines[LINES_SHOWN - 1 :] = [f"... and {len(lines) - LINES_SHOWN + 1} more like these"]
    return lines


def dtype_mismatches(records: Records, where: Mapping[int, str] | None = None) -> list[str]:
    """One line per pair of call sites whose messages met with the same size but another dtype
    (``float32[4]`` received into ``float64[2]``): gloo copies the bytes as they are, so the
    receiver reads them as its own dtype. Correct code may do so on purpose, so the harness
    warns (:func:`fsdp_testing._report.verdict.judge`) instead of failing. Only messages whose
    both ends are still in their ranks' logs are compared (the last 32 calls of each)."""
    found: dict[tuple[Any, ...], list[str]] = {}
    for rank, entries in sorted(records.items()):
        for e in entries:
            if not is_p2p(e) or e["family"] != "recv" or e.get("state") != "completed":
                continue
            met = partner(records, rank, e)
            if met is None:
                continue
            peer, send = met
            if (
                send is None
                or send.get("bytes") != e.get("bytes")
                or send.get("dtype") == e.get("dtype")
            ):
                continue
            key = (peer, send.get("at"), send.get("dtype"), rank, e.get("at"), e.get("dtype"))
            found.setdefault(key, []).append(
                f"dtype mismatch: {_op(peer, send, where)} sends {_shape(send)} but "
                f"{_op(rank, e, where)} receives {_shape(e)}: the same {e.get('bytes')} bytes, "
                "read as another dtype (gloo copies a message's bytes without converting them). "
                "Give both ends one dtype, or filter this warning if the reinterpretation is meant"
            )
    lines = []
    for messages in found.values():
        more = len(messages) - 1
        lines.append(messages[0] + (f" (and {more} more like it)" if more else ""))
    return lines


def _shape(entry: dict[str, Any]) -> str:
    shapes = entry.get("shapes") or [[]]
    return f"{entry.get('dtype')}{shapes[0]}"


def _on_tag(entry: dict[str, Any]) -> str:
    tag = int(entry.get("tag", 0))
    return f" with tag {tag}" if tag else ""


def tag_mismatch(records: Records, rank: int, entry: dict[str, Any]) -> bool:
    """Whether the peer of ``entry`` (a pending op of ``rank``) waits in the op that would meet
    it but for its tag."""
    return _other_tag_op(records, rank, entry) is not None


def _other_tag_op(records: Records, rank: int, entry: dict[str, Any]) -> dict[str, Any] | None:
    """The peer's pending op of the other kind between the same two ranks on the same group,
    with another tag (the ops would meet but for their tags); None when there is none."""
    peer, tag = int(entry["peer"]), int(entry.get("tag", 0))
    want = "recv" if entry["family"] == "send" else "send"
    for e in records.get(peer, []):
        if (
            is_p2p(e)
            and e["family"] == want
            and e["state"] in PENDING
            and e.get("peer") == rank
            and e["group"] == entry["group"]
            and int(e.get("tag", 0)) != tag
        ):
            return e
    return None


def _other_tag(
    records: Records, rank: int, entry: dict[str, Any], where: Mapping[int, str] | None
) -> str | None:
    """``rank 0's send #1 to rank 1 (at ...) has tag 1, this recv waits for tag 0``: the op of
    :func:`_other_tag_op` in words; None when there is none."""
    e = _other_tag_op(records, rank, entry)
    if e is None:
        return None
    peer, tag = int(entry["peer"]), int(entry.get("tag", 0))
    want = e["family"]
    at = f" (at {short_place(e['at'])})" if e.get("at") else ""
    way = "to" if want == "send" else "from"
    verb = "has" if want == "send" else "waits for"
    mine = "waits for" if want == "send" else "has"
    return (
        f"{rank_label(peer, where)}'s {e['op']} #{e['n']} {way} {rank_label(rank, where)}"
        f"{at} {verb} tag {int(e.get('tag', 0))}, this {entry['op']} {mine} tag {tag}"
    )


def _instead(
    records: Records, rank: int, expected_peer: int, family: str, where: Mapping[int, str] | None
) -> str:
    """``; its send #1 went to rank 2 instead (at ...)``: where ``rank``'s pending op of
    ``family`` went, when it went to another rank than ``expected_peer``."""
    others = [
        e
        for e in records.get(rank, [])
        if is_p2p(e)
        and e["family"] == family
        and e["state"] in PENDING
        and e.get("peer") not in (None, expected_peer)
    ]
    if not others:
        return ""
    e = others[0]
    at = f" (at {short_place(e['at'])})" if e.get("at") else ""
    went = "went to" if family == "send" else "waits for"
    return f"; its {e['op']} #{e['n']} {went} {rank_label(int(e['peer']), where)} instead{at}"
