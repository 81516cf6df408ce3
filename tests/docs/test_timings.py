"""The durations README and docs/cli.md quote for the main job come from one measured table:
docs/benchmarks.md's "Timings", printed by benchmarks/timings.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _table() -> dict[str, int]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("\n## Timings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| (\d+) s \| [\d.]+ \|$", section, re.M)
    return {label: int(seconds) for label, seconds in rows}


def test_the_table_has_the_rows_the_docs_quote() -> None:
    table = _table()
    assert any("the 180 default rows" in label for label in table), table
    assert any("120 hybrid rows" in label for label in table), table


def test_the_docs_quote_the_table() -> None:
    table = _table()
    check = next(s for label, s in table.items() if "the 180 default rows" in label)
    hybrid = next(s for label, s in table.items() if "120 hybrid rows" in label)
    readme = (ROOT / "README.md").read_text()
    cli = (ROOT / "docs" / "cli.md").read_text()
    assert f"about {check} s on two cores, see\n[Timings](docs/benchmarks.md#timings)" in readme
    assert f"take {check} s on two CPU cores ([Timings](benchmarks.md#timings))" in cli
    assert f"{hybrid} s on two CPU cores against {check} s for the 180 default rows" in cli
    # No other figure for the main job's time anywhere in the pages.
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = page.read_text()
        assert "under a minute on two cores" not in text, page
        for quoted in re.findall(r"(\d+) s for the 180 default rows", text):
            assert int(quoted) == check, page
