"""``fsdp-testing trace`` on the recorder: every engine's unit transitions, offload copies, and
the timeline drawn from the merged trace."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from fsdp_testing.cli import main
from fsdp_testing.cli._plot import COLORS, draw_timeline
from fsdp_testing.cli.trace import merge_traces

from ._images import assert_drawn_png

REASONS = {"forward", "forward_prefetch", "backward", "backward_prefetch", "explicit"}


def _trace(tmp_path: Any, capsys: Any, *options: str) -> tuple[list[dict[str, Any]], str]:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    code = main(["trace", "--steps", "2", "--json", str(trace), "--png", str(png), *options])
    out = capsys.readouterr().out
    assert code == 0, out
    assert_drawn_png(png, width=1400, height=450)  # the default width; two lanes
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


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_timeline_puts_each_event_in_its_rank_lane_and_row():
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

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
    figure = draw_timeline(trace, width=620)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())
    height = pixels.shape[0]
    (lane,) = figure.axes
    assert lane.get_ylabel() == "rank 1"

    def color_at(ms: float, y: float) -> tuple[int, ...]:
        # Lane rows, bottom to top: offload 0-1, unshard 1.5-1.9 over reshard 1.1-1.5,
        # collectives 2.1-2.9, step phases 3.1-3.9; x in milliseconds.
        x_px, y_px = lane.transData.transform((ms, y))
        return tuple(int(v) for v in pixels[height - round(float(y_px)), round(float(x_px))][:3])

    assert color_at(0.5, 3.5) == _rgb(COLORS["forward"])
    assert color_at(1.5, 2.5) == _rgb(COLORS["all_gather"])
    assert color_at(3.5, 2.5) == _rgb(COLORS["reduce_scatter"])
    assert color_at(1.5, 1.7) == _rgb(COLORS["unshard"])
    assert color_at(3.5, 1.3) == _rgb(COLORS["reshard"])
    assert color_at(3.5, 0.5) == _rgb(COLORS["offload"])
    gap = color_at(2.5, 2.5)  # no collective at 2.5 ms: the forward phase's light shading
    assert gap not in {_rgb(COLORS[k]) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    assert min(gap) > 200
    assert lane.get_xlim()[0] == 0 and lane.get_xlim()[1] >= 5.0  # milliseconds
    assert figure.axes[-1].get_xlabel() == "time since the first event (ms)"
    labels = {t.get_text() for t in figure.legends[0].get_texts()}
    assert {"forward", "all-gather", "reduce-scatter", "unshard", "reshard"} <= labels
    assert "offload to host" in labels


def test_draw_timeline_rejects_a_narrow_picture():
    trace = merge_traces({0: {"events": [], "phases": [[0, "forward", 0, 10]]}})
    with pytest.raises(ValueError, match="draw_timeline: width=300 is too narrow"):
        draw_timeline(trace, width=300)


def test_trace_rejects_a_narrow_width_before_running(capsys):
    assert main(["trace", "--model", "nested", "--width", "300"]) == 2
    assert "fsdp-testing trace: --width 300: give at least 400 pixels" in capsys.readouterr().err


def test_trace_without_matplotlib_names_the_extra_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    png = tmp_path / "t.png"
    code = main(["trace", "--model", "nested", "--json", str(tmp_path / "t.json"),
                 "--png", str(png)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert f"fsdp-testing trace --png {png} draws with matplotlib, which is not installed" in err
    assert "Install the 'plot' extra: pip install 'fsdp-testing[plot]'" in err
    assert "--no-png" in err
    assert not png.exists() and not (tmp_path / "t.json").exists()


def test_trace_no_png_writes_the_json_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = tmp_path / "t.json"
    code = main(["trace", "--model", "nested", "--steps", "1", "--json", str(trace), "--no-png"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"wrote {trace} (" in out and ".png" not in out
    assert any(e.get("cat") == "collective" for e in json.loads(trace.read_text())["traceEvents"])


def test_merge_traces_starts_at_zero_and_adds_a_phase_track():
    recorded = [{"name": "all_reduce", "cat": "collective", "ph": "X", "pid": 0, "tid": 2,
                 "ts": 5_000.0, "dur": 10.0, "args": {"op": "all_reduce"}}]  # fmt: skip
    trace = merge_traces({0: {"events": recorded, "phases": [[0, "backward", 4_000.0, 6_000.0]]}})
    timed = {e["name"]: e for e in trace["traceEvents"] if e["ph"] != "M"}
    assert timed["backward"]["ts"] == 0 and timed["backward"]["dur"] == 2_000
    assert timed["all_reduce"]["ts"] == 1_000
    assert {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0,
            "args": {"name": "step phases"}} in trace["traceEvents"]  # fmt: skip
