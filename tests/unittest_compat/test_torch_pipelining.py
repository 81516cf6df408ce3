"""torch's pipelining tests need from the mirrors what their imports name (``TEST_MULTIACCELERATOR``,
``check_leaked_tensors``) and, from ``MultiProcessTestCase``, torch's parent-side
``self.file_name``: a scenario written as torch's test/distributed/pipelining files are, changed
only in its imports, runs torch's schedules on gloo ranks, skips what torch skips with torch's
reason, and its tearDown removes the file the ranks rendezvoused on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from .._scenario import Run, run_scenario

SCENARIOS = Path(__file__).parent / "scenarios"


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipelining-log") / "files.log"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, log: Path) -> Run:
    return run_scenario(
        tmp_path_factory.mktemp("pipelining"),
        "test_torch_pipelining.py",
        "-v",
        scenarios=SCENARIOS,
        env={"PARENT_FILE_LOG": str(log)},
    )


@pytest.mark.parametrize("schedule", ["ScheduleClass0", "ScheduleClass1"])
def test_torchs_schedules_train_on_gloo_ranks_without_leaks(run: Run, schedule: str) -> None:
    case = run.cases[f"test_grads_match_one_process_{schedule}"]
    assert case.outcome == "passed", case.text


@pytest.mark.skipif(torch.accelerator.device_count() > 1, reason="two accelerators run it")
def test_multi_accelerator_gate_skips_with_torchs_reason(run: Run) -> None:
    case = run.cases["test_gated_on_two_accelerators"]
    assert case.outcome == "skipped", case.text
    assert "gloo test requires 2+ GPUs" in case.message


def test_parent_file_name_is_the_ranks_and_teardown_removes_it(run: Run, log: Path) -> None:
    case = run.cases["test_ranks_rendezvous_on_the_parents_file"]
    assert case.outcome == "passed", case.text
    parent, *ranks = log.read_text().splitlines()
    assert sorted(ranks) == [f"rank 0: {parent}", f"rank 1: {parent}"]
    assert not os.path.exists(parent)
