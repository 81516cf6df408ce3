"""Run a scenario file in a child pytest session and read back each test's outcome."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCENARIOS = Path(__file__).parent / "plugin" / "scenarios"


@dataclasses.dataclass
class Case:
    name: str
    outcome: str  # passed, failed, error, skipped, xfailed
    message: str
    text: str
    seconds: float


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    cases: dict[str, Case]
    tag: str


def run_scenario(
    workdir: Path,
    filename: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    scenarios: Path = SCENARIOS,
) -> Run:
    """Copy ``filename`` (and the scenarios' conftest) into ``workdir`` and run pytest on it."""
    for name in ("conftest.py", filename):
        if (scenarios / name).exists():
            shutil.copy(scenarios / name, workdir / name)
    xml_path = workdir / "report.xml"
    tag = f"fsdp-testing-scenario-{os.getpid()}-{workdir.name}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            f"--junitxml={xml_path}",
            "-rA",
            *args,
            filename,
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "SCENARIO_TAG": tag, **(env or {})},
    )
    cases: dict[str, Case] = {}
    for tc in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message, text = "passed", "", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
            else:
                continue
            message, text = child.get("message", ""), child.text or ""
            message = message.removeprefix("Failed: ").removeprefix("Skipped: ")
        cases[tc.get("name", "")] = Case(
            tc.get("name", ""), outcome, message, text, float(tc.get("time", 0))
        )
    return Run(proc.returncode, proc.stdout + proc.stderr, cases, tag)


def line_of(filename: str, function: str, code: str) -> int:
    """The line number of ``code`` inside ``function`` of a scenario file (for stack checks)."""
    lines = (SCENARIOS / filename).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    return next(i for i in range(start, len(lines)) if lines[i].strip() == code) + 1


def processes_tagged(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries ``tag`` (nothing may outlive a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if tag.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids
