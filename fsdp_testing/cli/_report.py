"""Machine-readable reports of ``fsdp-testing check``: JSON and JUnit XML."""

from __future__ import annotations

import dataclasses
import json
import math
import xml.etree.ElementTree as ET
from typing import Any

from ._matrix import Config

__all__ = [
    "ERROR",
    "MISMATCH",
    "OK",
    "UNAVAILABLE",
    "RowResult",
    "comm_problems",
    "count_statuses",
    "group_problems",
    "write_json",
    "write_junit",
]

#: Row statuses. Only ``ok`` and ``unavailable`` let the check pass.
OK, MISMATCH, ERROR, UNAVAILABLE = "ok", "MISMATCH", "ERROR", "unavailable"


@dataclasses.dataclass
class RowResult:
    """What one configuration gave, merged over its ranks."""

    config: Config
    status: str
    """``ok``, ``MISMATCH`` (parity or communication), ``ERROR`` (a rank raised, died or hung)
    or ``unavailable`` (the engine does not implement this configuration yet)."""
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    """Deviations reported without failing the row (``--comm report``)."""
    causes: list[str] = dataclasses.field(default_factory=list)
    """The likely causes of a parity mismatch, one line each (the library's
    ``Lockstep.explain``); empty where the numbers make none clear."""
    loss_diff: float | None = None
    param_diff: float | None = None
    comm: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    theory: dict[str, tuple[int, int]] | None = None
    comm_groups: dict[str, dict[str, tuple[int, int]]] = dataclasses.field(default_factory=dict)
    """The first rank's collectives per family and group (``"0,2"``: the group's ranks)."""
    layout: str | None = None
    peak_rss: list[int] = dataclasses.field(default_factory=list)
    rss_start: list[int] = dataclasses.field(default_factory=list)
    step_s: float | None = None
    time_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in (MISMATCH, ERROR)

    def as_dict(self) -> dict[str, Any]:
        def number(x: float | None) -> float | str | None:
            if x is None or math.isfinite(x):
                return x
            return str(x)

        return {
            "label": self.config.label,
            "config": dataclasses.asdict(self.config),
            "status": self.status,
            "problems": self.problems,
            "likely_causes": self.causes,
            "notes": self.notes,
            "loss_max_abs_diff": number(self.loss_diff),
            "param_max_abs_diff": number(self.param_diff),
            "collectives_per_step": {
                k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.comm.items())
            },
            "theory_per_step": (
                None
                if self.theory is None
                else {k: {"count": c, "bytes": b} for k, (c, b) in sorted(self.theory.items())}
            ),
            "collectives_per_group_rank0": {
                kind: {g: {"count": c, "bytes": b} for g, (c, b) in sorted(groups.items())}
                for kind, groups in sorted(self.comm_groups.items())
            },
            "layout": self.layout,
            "peak_rss_bytes": self.peak_rss,
            "rss_at_start_bytes": self.rss_start,
            "step_time_s": self.step_s,
            "time_s": round(self.time_s, 4),
        }


def comm_problems(
    comm: dict[str, tuple[int, int]], theory: dict[str, tuple[int, int]] | None
) -> list[str]:
    """One line per kind of collective whose calls or bytes per step differ from the theory
    (none when there is no theory)."""
    if theory is None:
        return []
    problems = []
    for kind in sorted(set(comm) | set(theory)):
        got, want = comm.get(kind, (0, 0)), theory.get(kind, (0, 0))
        if got != want:
            problems.append(
                f"communication: {kind} {got[0]} calls / {got[1]:,} B per step, theory "
                f"{want[0]} calls / {want[1]:,} B"
            )
    return problems


def group_problems(
    comm: dict[str, dict[str, Any]], theory: dict[str, dict[str, Any]] | None
) -> list[str]:
    """One line per family and group whose calls or bytes per step differ from the theory's
    (``family -> {"r0,r1": [calls, bytes]}``, as the ranks write them; none without a theory)."""
    if theory is None:
        return []
    problems = []
    for kind in sorted(set(comm) | set(theory)):
        got, want = comm.get(kind, {}), theory.get(kind, {})
        for group in sorted(set(got) | set(want)):
            have, should = list(got.get(group, (0, 0))), list(want.get(group, (0, 0)))
            if have != should:
                problems.append(
                    f"communication: {kind} over ranks {{{group}}} {have[0]} calls / "
                    f"{have[1]:,} B per step, theory {should[0]} calls / {should[1]:,} B"
                )
    return problems


def count_statuses(rows: list[RowResult]) -> dict[str, int]:
    """Rows per status, every status present."""
    counts = {OK: 0, MISMATCH: 0, ERROR: 0, UNAVAILABLE: 0}
    for row in rows:
        counts[row.status] += 1
    return counts


def write_json(path: str, rows: list[RowResult], meta: dict[str, Any]) -> None:
    """Write every row and a summary to ``path``."""
    data = {
        "tool": "fsdp-testing check",
        **meta,
        "summary": count_statuses(rows),
        "passed": not any(r.failed for r in rows),
        "rows": [r.as_dict() for r in rows],
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_junit(path: str, rows: list[RowResult], total_time: float) -> None:
    """One ``testcase`` per row: ``failure`` for a mismatch, ``error`` for an error, ``skipped``
    for an unavailable configuration."""
    counts = count_statuses(rows)
    suite = ET.Element(
        "testsuite",
        name="fsdp-testing check",
        tests=str(len(rows)),
        failures=str(counts[MISMATCH]),
        errors=str(counts[ERROR]),
        skipped=str(counts[UNAVAILABLE]),
        time=f"{total_time:.3f}",
    )
    for row in rows:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"check.{row.config.engine_name}.{row.config.model}",
            name=row.config.label,
            time=f"{row.time_s:.3f}",
        )
        text = "\n".join([*row.problems, *(f"likely cause: {c}" for c in row.causes)])
        first = row.problems[0] if row.problems else row.status
        if row.status == MISMATCH:
            ET.SubElement(case, "failure", message=first).text = text
        elif row.status == ERROR:
            ET.SubElement(case, "error", message=first).text = text
        elif row.status == UNAVAILABLE:
            ET.SubElement(case, "skipped", message=first)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
