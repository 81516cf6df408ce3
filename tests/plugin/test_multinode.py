"""Jobs across nodes on one host: two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d
rendezvous on localhost), and four pytest processes with the variables srun sets. Each job
runs once per module; the tests read its output, exit codes and JUnit XML."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .._scenario import SCENARIOS, line_of, processes_tagged

TORCHRUN = Path(sys.executable).with_name("torchrun")
HANG_TIMEOUT_S = 8  # the marker's timeout in scenarios/test_multinode.py
JOB_LIMIT_S = 240.0
"""Whole-job bound: a job of a few seconds, with room for a loaded two-core CI machine."""
# The end of pytest's last line; past a minute it adds the time as h:mm:ss: "in 74.96s (0:01:14)".
SESSION_END = r" in [\d.]+s( \(\d+:\d\d:\d\d\))? =+$"
_TORCH_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")
"""A line of torch's own logging (torchrun's banner, its agent's teardown)."""
_C10_LOG = re.compile(r"^\[[WEI]\d{4} \d\d:\d\d:\d\d\.\d+ \S+\.cpp:\d+\] \[c10d\] ")
"""A c10d warning of torch's C++ logging (no process id in it). Rank processes log to their own
files and a released slot keeps its stderr silenced, so on a node's terminal these come from
torchrun's agent: its rendezvous store, hosted by node 0's agent, can go away before it ends (a
network error with a C++ stack trace; seen twice on a loaded machine)."""
_C10_TRACE = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>$)")


@dataclasses.dataclass
class Job:
    outputs: list[str]
    """What each launched command printed (stdout and stderr together)."""
    returncodes: list[int]
    cases: dict[str, ET.Element]
    seconds: float
    tag: str
    workdir: Path

    def case(self, name: str) -> tuple[str, str]:
        """(outcome, text) of one test in the JUnit XML."""
        tc = self.cases[name]
        for child in tc:
            if child.tag in ("failure", "error"):
                return "failed", f"{child.get('message', '')}\n{child.text or ''}"
            if child.tag == "skipped":
                return "skipped", child.get("message", "")
        return "passed", ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_job(
    workdir: Path, scenario: str, commands: list[list[str]], envs: list[dict[str, str]]
) -> Job:
    shutil.copy(SCENARIOS / scenario, workdir / scenario)
    tag = f"fsdp-testing-multinode-{os.getpid()}-{workdir.name}"
    start = time.monotonic()
    procs = []
    logs = [workdir / f"out{i}.txt" for i in range(len(commands))]
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "wb") as f:
                procs.append(
                    subprocess.Popen(
                        command,
                        cwd=workdir,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        # Temporary files in the test's folder: a slot killed on purpose
                        # cannot remove its own.
                        env={**env, "SCENARIO_TAG": tag, "TMPDIR": str(workdir)},
                        start_new_session=True,
                    )
                )
        deadline = start + JOB_LIMIT_S
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    root = ET.parse(workdir / "report.xml").getroot()
    cases = {tc.get("name", ""): tc for tc in root.iter("testcase")}
    outputs = [log.read_text() for log in logs]
    return Job(outputs, [p.returncode for p in procs], cases, seconds, tag, workdir)


def _clean_env() -> dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_", "GROUP_", "MASTER_", "TORCHELASTIC", "SLURM")
    return {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}


PYTEST_ARGS = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA"]


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed")
    workdir = tmp_path_factory.mktemp("torchrun2x2")
    rdzv = f"localhost:{_free_port()}"
    agent = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "2"]
    agent += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv]
    command = [*agent, *PYTEST_ARGS, "--junitxml=report.xml", "test_multinode.py"]
    return _run_job(workdir, "test_multinode.py", [command, command], [_clean_env()] * 2)


def _srun_port_and_job_id() -> tuple[int, int]:
    # Under srun the store listens on 20000 + SLURM_JOB_ID % 10000: pick a job id whose port
    # is free here (random, so pytest-xdist workers do not pick the same one).
    for _ in range(200):
        port = random.randint(20000, 29999)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port, port - 20000 + 10000 * random.randint(1, 99)
    raise RuntimeError("no free port between 20000 and 29999")


@pytest.fixture(scope="module")
def srun_job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("srun2x2")
    _, job_id = _srun_port_and_job_id()
    envs = []
    for rank in range(4):
        env = _clean_env()
        env.update(
            SLURM_JOB_ID=str(job_id),
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % 2),
            SLURM_NODEID=str(rank // 2),
            SLURM_NTASKS="4",
            SLURM_STEP_NUM_TASKS="4",
            SLURM_JOB_NODELIST="127.0.0.[1-2]",
            SLURM_STEP_NODELIST="127.0.0.[1-2]",
            # Rank 3's slot is killed on purpose: notice it in 4 s rather than 10 (a live
            # slot bumps its counter every half second).
            FSDP_TESTING_JOB_LIVENESS_S="4",
        )
        envs.append(env)
    command = [sys.executable, *PYTEST_ARGS, "--junitxml=report.xml", "test_multinode_srun.py"]
    return _run_job(workdir, "test_multinode_srun.py", [command] * 4, envs)


# --- two torchrun agents ----------------------------------------------------------------------


def test_every_world_size_up_to_the_jobs_runs(torchrun_job: Job) -> None:
    for name in (
        "test_all_reduce_across_nodes",
        "test_smaller_world[ws2]",
        "test_smaller_world[ws3]",
        "test_thread_mode_in_job",
        "test_plain",
    ):
        assert torchrun_job.case(name) == ("passed", ""), name
    outcome, reason = torchrun_job.case("test_needs_eight")
    assert outcome == "skipped"
    assert "this torchrun job has world size 4; the test needs 8" in reason


def test_a_failing_rank_is_named_with_its_node(torchrun_job: Job) -> None:
    outcome, text = torchrun_job.case("test_rank_three_fails")
    assert outcome == "failed"
    assert "rank 3 (node 1, local rank 1) failed: AssertionError: rank three disagrees" in text
    # Its traceback, written on the rank after its result was sent, reached the report.
    assert '>       assert rank != 3, "rank three disagrees"' in text, text


def test_a_hang_names_the_hung_rank_and_its_line_and_the_next_test_passes(
    torchrun_job: Job,
) -> None:
    outcome, text = torchrun_job.case("test_rank_three_hangs")
    assert outcome == "failed"
    assert f"timed out after {HANG_TIMEOUT_S} s: ranks 0-3 (nodes 0, 1) still running" in text
    named = "rank 3 (node 1, local rank 1) hangs: it never entered all_reduce #1"
    divergence = "ranks 0-2 (nodes 0, 1) wait in all_reduce #1 but rank 3 (node 1"
    assert named in text and divergence in text, text
    stacks = text.index("stack when the timeout hit:")
    assert text.index(named) < text.index(divergence) < stacks, "the divergence comes first"
    hung = text.split("[rank 3 (node 1, local rank 1)] stack when the timeout hit:")[1]
    line = line_of("test_multinode.py", "test_rank_three_hangs", "time.sleep(600)")
    assert f'test_multinode.py", line {line} in test_rank_three_hangs\n    time.sleep(600)' in hung
    # Ranks 0-2 wait at the same line: one stack for the three.
    waiting = text.split("[ranks 0-2 (3 of 4) (nodes 0, 1)] stack when the timeout hit:")[1]
    assert "dist.all_reduce(torch.ones(1))" in waiting.split("[rank")[0]
    assert "pytest_cmdline_main" not in waiting.split("[rank")[0], "frames from the fork"
    # The hang ends at its timeout: its ranks are dumped and killed, not waited for. The bound
    # is the (timeout + 30 s), generous for a loaded machine.
    assert float(torchrun_job.cases["test_rank_three_hangs"].get("time", 0)) < HANG_TIMEOUT_S + 30
    assert torchrun_job.case("test_after_the_hang") == ("passed", "")


def test_a_dead_rank_is_named_with_its_node_and_the_next_test_passes(torchrun_job: Job) -> None:
    outcome, text = torchrun_job.case("test_rank_two_dies")
    assert outcome == "failed"
    assert "rank 2 (node 1, local rank 0) exited with code 3 (ranks 0, 1, 3 aborted)" in text
    assert torchrun_job.case("test_after_the_death") == ("passed", "")


def test_a_rank_that_cannot_reset_fails_the_next_test_by_name(torchrun_job: Job) -> None:
    """Across nodes a rank's slot cannot start new ranks for one test: the test after a failed
    reset fails naming the rank and the traceback, and the test after it gets new ranks."""
    assert torchrun_job.case("test_rank_one_breaks_its_reset") == ("passed", "")
    outcome, text = torchrun_job.case("test_after_a_broken_reset")
    assert outcome == "failed"
    assert "rank 1 (node 0, local rank 1)" in text
    assert "could not reset its state after the last test" in text
    assert "RuntimeError: reset broken on purpose" in text
    assert torchrun_job.case("test_after_the_replacement") == ("passed", "")


def test_a_failure_on_every_rank_leaves_the_next_test_new_ranks(torchrun_job: Job) -> None:
    # Rank 0's failed test left an all-reduce in flight; the next test's would pair with it.
    outcome, _ = torchrun_job.case("test_fails_with_a_collective_in_flight")
    assert outcome == "failed"
    assert torchrun_job.case("test_after_a_failure_on_every_rank") == ("passed", "")


def test_new_ranks_on_every_node_start_with_what_earlier_ranks_imported(torchrun_job: Job) -> None:
    """Each slot imports what its earlier ranks imported before it forks new ones (see [Note:
    preloading what ranks import] in fsdp_testing/_launch/rank_process.py)."""
    assert torchrun_job.case("test_imports_a_module") == ("passed", "")
    assert torchrun_job.case("test_fails_on_every_rank_after_the_import")[0] == "failed"
    assert torchrun_job.case("test_new_ranks_start_with_what_earlier_ranks_imported") == (
        "passed",
        "",
    )


def _own_lines(output: str) -> list[str]:
    """Lines of a torchrun command's output that are not torchrun's own (its banner, its agent's
    logging and the failure summary it prints when its workers exit non-zero)."""
    lines: list[str] = []
    in_c10_warning = False
    for line in output.splitlines():
        if _C10_LOG.match(line):
            in_c10_warning = True
        elif not (in_c10_warning and (_C10_TRACE.match(line) or not line.strip())):
            in_c10_warning = False
            if not _TORCH_LOG.match(line):
                lines.append(line)
    if "Traceback (most recent call last):" in lines:
        # torchrun's own traceback is the last one (a test's failure report may hold others):
        # its failure summary (ChildFailedError), or on another node its agent's network error
        # when node 0's agent, which hosts the rendezvous store, ended first (DistNetworkError:
        # torchrun's own teardown on one host, after the report; see docs/multinode.md).
        start = len(lines) - 1 - lines[::-1].index("Traceback (most recent call last):")
        ours = not _TORCHRUN_SCRIPT.search(lines[start + 1])
        if "torch.distributed.elastic.multiprocessing.errors.ChildFailedError" in output:
            assert not ours, lines[start:]
        if not ours and any(line.startswith(_TORCHRUN_ENDS) for line in lines[start:]):
            # With the tracebacks chained before it (the store's error that the agent's
            # rendezvous error was raised from), which torchrun printed first.
            while True:
                before = [i for i in range(start) if lines[i].strip()]
                if not before or lines[before[-1]] not in _CHAINED:
                    break
                earlier = [i for i in range(before[-1]) if lines[i] == _TRACEBACK]
                if not earlier:
                    break
                start = earlier[-1]
            lines = lines[:start]
    return lines


_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


#: The first frame of torchrun's own traceback: its console script, whose line number depends on
#: the installer that wrote it (8 from pip here, 10 in another image's venv).
_TORCHRUN_SCRIPT = re.compile(r'/torchrun", line \d+, in <module>$')

_TORCHRUN_ENDS = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError",
    "torch.distributed.DistNetworkError",
    # The same teardown met while the agent polls the rendezvous (raised from the above).
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError",
)


def test_torchruns_own_chained_teardown_traceback_is_not_counted_as_ours() -> None:
    """Seen on another node: the agent's rendezvous error raised from the store's."""
    ending = [
        "fsdp_testing: node 1 (vm) runs ranks of the distributed tests of this torchrun job",
        "Traceback (most recent call last):",
        '  File "/x/c10d_rendezvous_backend.py", line 114, in _call_store',
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        '  File "/venv/bin/torchrun", line 10, in <module>',
        "    sys.exit(main())",
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to",
    ]
    assert _own_lines("\n".join(ending)) == ending[:1]
    # A traceback of a test's in the report before it stays.
    own = ["Traceback (most recent call last):", '  File "t.py", line 1', "ValueError: x"]
    own += ["=== 1 failed in 1.00s ==="]
    assert _own_lines("\n".join([*own, *ending[1:]])) == own


def test_one_report_on_the_first_node_and_one_line_on_the_other(torchrun_job: Job) -> None:
    first, other = (_own_lines(out) for out in torchrun_job.outputs)
    assert len(torchrun_job.cases) == 19, "the JUnit XML holds every test"
    assert sum("short test summary info" in line for line in first) == 1
    assert re.match(r"=+ 6 failed, 12 passed, 1 skipped" + SESSION_END, first[-1]), first[-1]
    assert len(other) == 1, other
    assert other[0].startswith("fsdp_testing: node 1 ("), other[0]
    assert "of this torchrun job; the report is on node 0 (" in other[0]
    assert other[0].endswith(f"JUnit XML {torchrun_job.workdir / 'report.xml'}"), other[0]


def test_the_job_exits_with_pytests_status_and_prints_nothing_at_exit(torchrun_job: Job) -> None:
    # pytest's status is 1 (tests failed); torchrun turns any failure into 1 on each node.
    assert torchrun_job.returncodes == [1, 1]
    for output in torchrun_job.outputs:
        assert "Exception ignored" not in output
        assert "atexit" not in output
    # After pytest's last line the first node shows only torchrun's own summary.
    assert re.match(r"=+ .*" + SESSION_END, _own_lines(torchrun_job.outputs[0])[-1])
    assert torchrun_job.seconds < JOB_LIMIT_S
    assert processes_tagged(torchrun_job.tag) == []


# --- srun's variables -------------------------------------------------------------------------


def test_srun_tasks_run_the_tests_and_rank_zero_hosts_the_store(srun_job: Job) -> None:
    assert srun_job.case("test_all_reduce_over_srun_tasks") == ("passed", "")
    assert srun_job.case("test_three_ranks_still_run") == ("passed", "")


def test_a_rank_that_cannot_be_recovered_skips_the_tests_that_need_it(srun_job: Job) -> None:
    outcome, text = srun_job.case("test_rank_three_loses_its_slot")
    assert outcome == "failed"
    assert "rank 3 (node 1, local rank 1) " in text.splitlines()[0]
    outcome, reason = srun_job.case("test_needs_rank_three")
    assert outcome == "skipped"
    assert reason.startswith("rank 3 (node 1, local rank 1) was lost ")
    assert "test_rank_three_loses_its_slot" in reason


def test_srun_tasks_exit_with_pytests_status_and_only_one_line_elsewhere(srun_job: Job) -> None:
    first, task1, task2, task3 = srun_job.outputs
    assert srun_job.returncodes[:3] == [1, 1, 1]
    assert srun_job.returncodes[3] == -signal.SIGKILL  # killed by its own test
    assert re.match(r"=+ 1 failed, 2 passed, 1 skipped" + SESSION_END, first.splitlines()[-1])
    assert task1 == task3 == ""
    assert task2.count("\n") == 1
    assert task2.startswith("fsdp_testing: node 1 (") and "srun job step" in task2
    assert processes_tagged(srun_job.tag) == []
