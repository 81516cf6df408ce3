"""Describing where the ranks' collective logs diverge, and reading stacks, in-process."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_testing._report.divergence import describe_divergence, format_records
from fsdp_testing._report.hang_report import readable_stack


def _e(
    seq: int,
    op: str,
    state: str,
    group: str = "default",
    shapes: Any = None,
    dtype: str = "float32",
) -> dict:
    return {
        "seq": seq,
        "op": op,
        "group": group,
        "shapes": shapes if shapes is not None else [[4]],
        "dtype": dtype,
        "state": state,
    }


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        pytest.param(
            {
                0: [_e(1, "all_reduce", "completed"), _e(2, "broadcast", "entered")],
                1: [_e(1, "all_reduce", "completed"), _e(2, "all_reduce", "entered")],
            },
            ["rank 0 waits in broadcast #2 while rank 1 waits in all_reduce #2"],
            id="different-ops-same-seq",
        ),
        pytest.param(
            {0: [_e(1, "all_gather_into_tensor", "entered")], 1: []},
            [
                "rank 0 waits in all_gather_into_tensor #1 but rank 1 never entered it "
                "(rank 1's last collective: no collective)"
            ],
            id="peer-never-entered",
        ),
        pytest.param(
            {0: [_e(3, "all_reduce", "entered")], 1: [_e(2, "all_reduce", "completed")]},
            [
                "rank 0 waits in all_reduce #3 but rank 1 never entered it "
                "(rank 1's last collective: all_reduce #2 (completed))"
            ],
            id="peer-behind",
        ),
        pytest.param(
            {
                0: [_e(1, "all_gather", "entered", shapes=[[4]])],
                1: [_e(1, "all_gather", "entered", shapes=[[8]])],
            },
            ["rank 0 and rank 1 are both in all_gather #1 with different shapes: [[4]] vs [[8]]"],
            id="different-shapes",
        ),
        pytest.param(
            # gloo let rank 0 through and aborted rank 1 (a crash report reads the logs too).
            {
                0: [_e(1, "broadcast", "completed", shapes=[[5]])],
                1: [_e(1, "broadcast", "entered", shapes=[[3]])],
            },
            ["rank 1 waits in broadcast #1 with shapes [[3]] but rank 0 issued it with [[5]]"],
            id="peer-left-with-other-shapes",
        ),
        pytest.param(
            {0: [_e(1, "all_reduce", "entered")], 1: [_e(1, "all_reduce", "raised", dtype="x")]},
            ["rank 0 waits in all_reduce #1 with dtype float32 but rank 1 issued it with x"],
            id="peer-left-with-another-dtype",
        ),
        pytest.param(
            {
                0: [_e(1, "all_gather_into_tensor", "entered")],
                1: [_e(1, "_all_gather_base", "entered")],
            },
            [
                "ranks 0, 1 wait inside a collective that every rank entered (a slow or stuck peer "
                "outside any recorded collective?)"
            ],
            id="two-spellings-of-one-collective-match",
        ),
        pytest.param(
            # What no collective explains is said by the report around it (``calls_section``).
            {0: [_e(1, "barrier", "completed")], 1: [_e(1, "barrier", "completed")]},
            [],
            id="hang-outside-collectives",
        ),
        pytest.param(
            {
                0: [_e(1, "all_reduce", "entered", group="g1(size 2)")],
                1: [
                    _e(1, "all_reduce", "completed", group="g1(size 2)"),
                    _e(1, "barrier", "entered"),
                ],
            },
            [
                "rank 1 waits in barrier #1 but rank 0 never entered it (rank 0's last "
                "collective: no collective)"
            ],
            id="sequence-numbers-count-per-group",
        ),
    ],
)
def test_divergence_table(records: dict, expected: list[str]) -> None:
    assert describe_divergence(records) == expected


def test_format_records_shows_the_last_collectives_of_each_rank() -> None:
    lines = format_records({0: [_e(i, "all_reduce", "completed") for i in range(1, 8)], 1: []})
    assert lines[0] == "  rank 0:"
    assert lines[1] == "    all_reduce #3 shapes=[[4]] dtype=float32 [completed]"
    assert len(lines) == 1 + 5 + 1
    assert lines[-1] == "  rank 1: no calls recorded"


STACK = """\
Thread 0x00007f (most recent call first):
  File "/site/fsdp_testing/_launch/rank_process.py", line 99 in serve
    result = run_task(task, ctx, router)
  File "/site/fsdp_testing/_rank/run_task.py", line 80 in run_task
    target(**kwargs)
  File "/home/me/tests/test_model.py", line 12 in test_step
    dist.all_reduce(t)
  File "<frozen runpy>", line 88 in _run_code
"""


def test_readable_stack_drops_the_harness_frames_and_keeps_the_test() -> None:
    assert readable_stack(STACK).splitlines() == [
        "Thread 0x00007f (most recent call last):",
        '  File "/home/me/tests/test_model.py", line 12 in test_step',
    ]


def test_readable_stack_orders_frames_adds_source_and_folds_torch(tmp_path) -> None:
    import os

    import torch

    test_file = tmp_path / "test_model.py"
    test_file.write_text("def test_step():\n    x = 1\n    dist.all_reduce(t)\n")
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    logger = os.path.join(os.path.dirname(torch.__file__), "distributed", "c10d_logger.py")
    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
        "\n"
        "Current thread 0x00007f00 (most recent call first):\n"
        f'  File "{c10d}", line 4000 in all_reduce\n'
        f'  File "{logger}", line 81 in wrapper\n'
        f'  File "{test_file}", line 3 in test_step\n'
        '  File "/site/fsdp_testing/_rank/run_task.py", line 80 in run_task\n'
    )
    lines = readable_stack(dump).splitlines()
    assert lines == [
        "Current thread 0x00007f00 (most recent call last):",
        f'  File "{test_file}", line 3 in test_step',
        "    dist.all_reduce(t)",
        "  ... 2 frames in torch: wrapper (c10d_logger.py:81) -> all_reduce "
        "(distributed_c10d.py:4000)",
    ]


def test_readable_stack_names_an_import_as_pythons_not_torchs(tmp_path: Any) -> None:
    test_file = tmp_path / "test_model.py"
    test_file.write_text("def test_step():\n    import big\n")
    dump = (
        "Current thread 0x00007f00 (most recent call first):\n"
        '  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed\n'
        '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
        f'  File "{test_file}", line 2 in test_step\n'
    )
    assert readable_stack(dump).splitlines()[-1] == (
        "  ... 2 frames in Python: _find_and_load (<frozen importlib._bootstrap>:1176) -> "
        "_call_with_frames_removed (<frozen importlib._bootstrap>:241)"
    )


def test_readable_stack_leaves_text_without_frames_alone() -> None:
    assert readable_stack("(no stack dump)") == "(no stack dump)"


def _call(op: str, family: str, tensors: list[Any], **fields: Any) -> Any:
    from fsdp_testing._rank.comm_observer import CommCall

    base: dict[str, Any] = {
        "op": op,
        "family": family,
        "method": op,
        "p2p": family in ("send", "recv"),
        "rank": 0,
        "group": None,
        "group_name": "default",
        "group_ranks": (0, 1),
        "outputs": tensors,
        "inputs": tensors,
        "nbytes": sum(t.numel() * t.element_size() for t in tensors),
        "dtype": "float32" if tensors else None,
        "blocking": True,
    }
    base.update(fields)
    return CommCall(**base)


def test_flight_record_file_reads_back_what_the_rank_recorded(tmp_path: Any) -> None:
    """The memory-mapped record another process reads: the newest ``capacity`` entries oldest
    first, each update visible, a reset empty, and an entry too big for its slot shortened
    rather than lost."""
    import torch

    from fsdp_testing._report.collective_log import FlightRecorder, read_record_file

    path = str(tmp_path / "rank0.flight")
    rec = FlightRecorder(capacity=4, path=path)
    assert read_record_file(path) == ([], {})
    for _ in range(6):
        entry = rec.enter(_call("all_reduce", "all_reduce", [torch.ones(4)]))
        rec.update(entry, "completed")
    read, counts = read_record_file(path)
    assert [e["seq"] for e in read] == [3, 4, 5, 6]
    assert [e["n"] for e in read] == [3, 4, 5, 6]
    assert read == rec.snapshot()
    assert counts == {}

    big = rec.enter(_call("all_gather", "all_gather", [torch.empty(8, 8)] * 1000))
    assert read_record_file(path)[0][-1]["state"] == "entered"
    rec.update(big, "raised")
    last = read_record_file(path)[0][-1]
    assert (last["op"], last["seq"], last["n"], last["state"]) == ("all_gather", 7, 1, "raised")
    assert last["shapes"] == [[8, 8]] * 8 + [["..."]]
    assert [e["seq"] for e in read_record_file(path)[0]] == [4, 5, 6, 7]

    rec.reset()
    assert read_record_file(path) == ([], {})
    rec.update(rec.enter(_call("barrier", "barrier", [])), "completed")
    assert [(e["op"], e["seq"]) for e in read_record_file(path)[0]] == [("barrier", 1)]


def test_flight_record_numbers_messages_apart_and_counts_their_channels(tmp_path: Any) -> None:
    """Point-to-point ops are numbered apart from collectives (``send #k``: the rank's k-th
    send), each knows its place on its channel, and the file keeps every channel's count (the
    ring may lose the entries)."""
    import torch

    from fsdp_testing._report.collective_log import FlightRecorder, read_record_file

    path = str(tmp_path / "rank0.flight")
    rec = FlightRecorder(capacity=2, path=path)
    t = [torch.ones(2)]
    rec.enter(_call("all_reduce", "all_reduce", t))
    first = rec.enter(_call("isend", "send", t, peer=1, tag=3, blocking=False))
    rec.enter(_call("isend", "send", t, peer=1, tag=3, blocking=False))
    rec.enter(_call("send", "send", t, peer=1))
    rec.enter(_call("recv", "recv", t, peer=1))
    entries, counts = read_record_file(path)
    assert [(e["op"], e["n"], e["seq"]) for e in entries] == [("send", 3, 1), ("recv", 1, 1)]
    assert counts == {
        "default|0>1|3": 2,
        "default|0>1|0": 1,
        "default|1>0|0": 1,
    }
    assert len(rec.open) == 4  # none completed
    rec.update(first, "completed")
    assert len(rec.open) == 3
