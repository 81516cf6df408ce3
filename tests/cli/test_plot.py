"""The matplotlib pictures: the missing-extra error, and bar charts that are drawn."""

from __future__ import annotations

import sys

import pytest

from fsdp_testing.cli._plot import BarPanel, draw_bars, require_matplotlib, save_png

from ._images import assert_drawn_png


def test_missing_matplotlib_names_the_extra_and_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    with pytest.raises(ImportError) as info:
        require_matplotlib("fsdp-testing trace --png t.png")
    assert str(info.value) == (
        "fsdp-testing trace --png t.png draws with matplotlib, which is not installed. Install "
        "the 'plot' extra: pip install 'fsdp-testing[plot]' (bash scripts/setup.sh installs it)."
    )
    with pytest.raises(ImportError, match=r"Install the 'plot' extra"):
        draw_bars([BarPanel(title="t", unit="ms", groups=["a"], series={"s": [1.0]})], title="x")


def test_bar_charts_are_drawn(tmp_path):
    panels = [
        BarPanel(title="step time", unit="ms", groups=["fsdp_core", "torch_fsdp2", "ddp"],
                 series={"interleaved": [26.0, 44.5, 13.7], "isolated": [35.2, 76.9, None]}),
        BarPanel(title="overhead", unit="ms", groups=["a", "b"], series={"per test": [2, 3318]},
                 log=True),
    ]  # fmt: skip
    figure = draw_bars(panels, title="benchmark", width=800)
    step, overhead = figure.axes
    assert [t.get_text() for t in step.get_xticklabels()] == ["fsdp_core", "torch_fsdp2", "ddp"]
    assert len(step.patches) == 5  # no bar where a value is missing
    assert sorted(round(p.get_height(), 1) for p in step.patches) == [13.7, 26.0, 35.2, 44.5, 76.9]
    assert overhead.get_yscale() == "log"
    path = tmp_path / "bars.png"
    save_png(figure, str(path))
    assert_drawn_png(path, width=800, height=360)


def test_bar_panel_needs_one_value_per_group():
    with pytest.raises(
        ValueError, match=r"BarPanel 'step': series b must have one value per group \(2: x, y\)"
    ):
        BarPanel(title="step", unit="ms", groups=["x", "y"], series={"a": [1, 2], "b": [1]})
