"""``fsdp-testing trace`` on the recorder: every engine's unit transitions, offload copies, and
the timeline drawn from the merged trace."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import pytest

from fsdp_testing.cli import main
from fsdp_testing.cli.trace import draw_timeline, merge_traces

REASONS = {"forward", "forward_prefetch", "backward", "backward_prefetch", "explicit"}


def _trace(tmp_path: Any, capsys: Any, *options: str) -> tuple[list[dict[str, Any]], str]:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["trace", "--steps", "2", "--json", str(trace), "--png", str(png), *options])
    out = capsys.readouterr().out
    assert code == 0, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(trace.read_text())["traceEvents"], out


@pytest.mark.parametrize("engine", ["torch_fsdp1", "torch_fsdp2"])
def test_trace_records_unit_transitions_for_torch_engines(engine, tmp_path, capsys):
    events, out = _trace(tmp_path, capsys, "--model", "nested", "--engine", engine)
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    for rank in (0, 1):
        assert {(rank, "step phases"), (rank, "unit transitions"), (rank, "collectives")} <= tracks
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] != "M"]
        unshards = [e for e in mine if e["cat"] == "unshard"]
        reshards = [e for e in mine if e["cat"] == "reshard"]
        assert unshards and reshards, engine
        assert {e["args"]["reason"] for e in unshards} <= REASONS
        assert {e["args"]["step"] for e in unshards} == {0, 1}  # the recorder's step counter
        gathers = [e for e in mine if e["cat"] == "collective" and "all_gather" in e["args"]["op"]]
        assert gathers and all(e["ph"] == "X" and e["args"]["bytes"] > 0 for e in gathers)
        assert [e["name"] for e in mine if e["cat"] == "step"] == ["forward", "backward",
                                                                   "optimizer"] * 2  # fmt: skip
    assert all(e["ts"] >= 0 for e in events if e["ph"] != "M")
    assert "rank 1:" in out and " unshard" in out and " reshard" in out


def test_trace_shows_fsdp_core_offload_copies(tmp_path, capsys):
    events, _ = _trace(tmp_path, capsys, "--model", "nested", "--offload", "on")
    copies = [e for e in events if e.get("cat") == "offload"]
    assert {e["args"]["direction"] for e in copies} >= {"to_device"}
    assert {e["pid"] for e in copies} == {0, 1}


def _pixels(png: bytes) -> list[bytes]:
    width, height = struct.unpack(">II", png[16:24])
    idat = png.index(b"IDAT")
    length = struct.unpack(">I", png[idat - 4 : idat])[0]
    raw = zlib.decompress(png[idat + 4 : idat + 4 + length])
    stride = 1 + 3 * width
    return [raw[y * stride + 1 : (y + 1) * stride] for y in range(height)]


def _color_at(rows: list[bytes], x: int, y: int) -> tuple[int, ...]:
    return tuple(rows[y][3 * x : 3 * x + 3])


def test_timeline_puts_each_event_in_its_rank_lane_and_row():
    # Recorder-style events of rank 1 (microseconds), plus its step phases.
    def span(cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        return {"name": cat, "cat": cat, "ph": "X", "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                "args": args}  # fmt: skip

    recorded = [
        span("collective", 1000, 1000, op="all_gather_into_tensor"),
        span("collective", 3000, 1000, op="reduce_scatter_single"),
        span("unshard", 1000, 1000, reason="forward"),
        span("reshard", 3000, 1000, reason="backward"),
        {"name": "offload", "cat": "offload", "ph": "i", "s": "t", "pid": 1, "tid": 3,
         "ts": 3500, "args": {"direction": "to_host"}},
    ]  # fmt: skip
    trace = merge_traces({1: {"events": recorded, "phases": [[0, "forward", 0, 5000]]}})
    rows = _pixels(draw_timeline(trace, width=620).png())
    # Lane of the only rank from y=64; rows of 16 pixels; the plot spans x 120..600 for 5 ms.
    assert _color_at(rows, 130, 64 + 8) == (205, 215, 230)  # forward phase
    assert _color_at(rows, 120 + 144, 64 + 16 + 8) == (31, 119, 180)  # all-gather at 1.5 ms
    assert _color_at(rows, 120 + 336, 64 + 16 + 8) == (255, 127, 14)  # reduce-scatter at 3.5 ms
    assert _color_at(rows, 120 + 144, 64 + 32 + 3) == (44, 160, 44)  # unshard, upper half
    assert _color_at(rows, 120 + 336, 64 + 32 + 12) == (214, 39, 40)  # reshard, lower half
    assert _color_at(rows, 120 + 337, 64 + 48 + 8) == (23, 190, 207)  # offload copy
    assert _color_at(rows, 120 + 240, 64 + 16 + 8) == (246, 246, 246)  # nothing at 2.5 ms


def test_merge_traces_starts_at_zero_and_adds_a_phase_track():
    recorded = [{"name": "all_reduce", "cat": "collective", "ph": "X", "pid": 0, "tid": 2,
                 "ts": 5_000.0, "dur": 10.0, "args": {"op": "all_reduce"}}]  # fmt: skip
    trace = merge_traces({0: {"events": recorded, "phases": [[0, "backward", 4_000.0, 6_000.0]]}})
    timed = {e["name"]: e for e in trace["traceEvents"] if e["ph"] != "M"}
    assert timed["backward"]["ts"] == 0 and timed["backward"]["dur"] == 2_000
    assert timed["all_reduce"]["ts"] == 1_000
    assert {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "step phases"}} in trace["traceEvents"]  # fmt: skip
