"""Reading a launched job from its environment, and naming ranks by node in reports (fast,
in-process; the jobs themselves run in test_multinode.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_testing._launch.job_child import split_dump
from fsdp_testing._launch.torchrun import JobEnv, expand_nodelist, read_job_env
from fsdp_testing._protocol import Outcome, RankResult
from fsdp_testing._report.hang_report import readable_stack, stack_sources
from fsdp_testing._report.observation import Observation
from fsdp_testing._report.verdict import VerdictOutcome, judge

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NODELIST": "gpu[01-08]",
    "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.99",
}


def test_torchrun_variables_place_the_process_on_its_node() -> None:
    job = read_job_env(TORCHRUN)
    assert job == JobEnv(
        launcher="torchrun",
        rank=3,
        world_size=4,
        local_rank=1,
        node=1,
        master_addr="node0",
        master_port=29500,
        agent_store=True,
        job_id="torchrun-abc.0",
    )
    assert job.describe() == "this torchrun job"


def test_a_pytorchjob_pod_without_torchrun_is_one_node_per_rank() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    job = read_job_env(env)
    assert job is not None
    assert (job.launcher, job.rank, job.node, job.local_rank, job.agent_store) == (
        "env",
        2,
        2,
        0,
        False,
    )
    assert (job.master_addr, job.master_port) == ("job-master-0", 23456)
    # With LOCAL_RANK but no node number, nodes are learnt from host names.
    assert read_job_env({**env, "LOCAL_RANK": "0"}).node is None  # type: ignore[union-attr]


def test_srun_variables_and_the_master_on_the_steps_first_node() -> None:
    job = read_job_env(SRUN)
    assert job is not None
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.node) == (
        "srun",
        2,
        4,
        0,
        1,
    )
    # Rank 0 runs on the step's first node (block distribution), not where srun was typed.
    assert job.master_addr == "gpu07"
    assert job.master_port == 20000 + 123456 % 10000
    assert job.describe() == "this srun job step"
    assert not job.agent_store


def test_master_addr_and_port_win_over_slurms_defaults() -> None:
    job = read_job_env({**SRUN, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4242"})
    assert job is not None and (job.master_addr, job.master_port) == ("10.1.2.3", 4242)


def test_torchrun_inside_srun_is_a_torchrun_job() -> None:
    job = read_job_env({**SRUN, **TORCHRUN})
    assert job is not None and job.launcher == "torchrun" and job.rank == 3


@pytest.mark.parametrize(
    "env",
    [
        {},
        # A batch script: SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but no step.
        {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")},
        {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1"},
        {**TORCHRUN, "FSDP_TESTING_JOB": "0"},
    ],
    ids=["plain", "sbatch-script", "one-process", "opted-out"],
)
def test_what_is_not_a_job(env: dict[str, str]) -> None:
    assert read_job_env(env) is None


def test_a_malformed_job_environment_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer.*FSDP_TESTING_JOB=0"):
        read_job_env({**TORCHRUN, "RANK": "x"})
    with pytest.raises(ValueError, match="rank 4 is outside the job's world size 4"):
        read_job_env({**TORCHRUN, "RANK": "4"})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
        ("a[1,3-4]", ["a1", "a3", "a4"]),
        ("rack[1-2]-n[7,9]", ["rack1-n7", "rack1-n9", "rack2-n7", "rack2-n9"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
        ("solo", ["solo"]),
    ],
)
def test_slurm_node_lists_expand_as_scontrol_does(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_an_unsupported_node_list_is_an_error() -> None:
    with pytest.raises(ValueError, match="range 'x-y'"):
        expand_nodelist("n[x-y]")


WHERE = {0: "node 0, local rank 0", 1: "node 0, local rank 1", 2: "node 1, local rank 0"}


def test_a_dead_rank_is_named_with_its_node() -> None:
    obs = Observation(world_size=3, timeout=5, where=WHERE)
    obs.results[0] = RankResult(0, Outcome.PASSED)
    obs.results[1] = RankResult(1, Outcome.PASSED)
    obs.dead.add(2)
    obs.exit_status[2] = "exited with code 3"
    verdict = judge(obs)
    assert verdict.outcome is VerdictOutcome.FAILED
    assert verdict.message.startswith("rank 2 (node 1, local rank 0) exited with code 3")
    assert "[rank 2 (node 1, local rank 0)] exited with code 3 without reporting" in verdict.message


def test_a_hang_names_the_rank_the_others_wait_for_with_its_node() -> None:
    waiting = {"seq": 1, "op": "all_reduce", "group": "default", "shapes": [[1]], "dtype": "f"}
    obs = Observation(world_size=3, timeout=4, where=WHERE, timed_out=True, stragglers={0, 1, 2})
    obs.records = {0: [{**waiting, "state": "entered"}], 1: [{**waiting, "state": "entered"}]}
    obs.records[2] = []
    message = judge(obs).message
    lines = message.splitlines()
    assert lines[0] == (
        "timed out after 4 s: ranks 0-2 (nodes 0, 1) still running (of world size 3)"
    )
    assert lines[1] == (
        "rank 2 (node 1, local rank 0) hangs: it never entered all_reduce #1, which ranks 0, 1 "
        "(node 0) wait in"
    )
    assert (
        "ranks 0, 1 (node 0) wait in all_reduce #1 but rank 2 (node 1, local rank 0) never "
        "entered it" in message
    )
    # No rank sent a stack: the three "(none)" are one entry.
    assert "[ranks 0-2 (3 of 3) (nodes 0, 1)] stack when the timeout hit:" in message


def test_a_remote_ranks_stack_shows_the_source_lines_read_on_its_node() -> None:
    dump = (
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/elsewhere/test_remote.py", line 12 in test_hangs\n'
    )
    assert stack_sources(dump) == {}  # the file is not on this machine
    text = readable_stack(dump, {"/elsewhere/test_remote.py:12": "time.sleep(600)"})
    assert text.splitlines()[1:] == [
        '  File "/elsewhere/test_remote.py", line 12 in test_hangs',
        "    time.sleep(600)",
    ]


def test_a_slots_dump_drops_the_frames_its_rank_inherited_from_the_fork() -> None:
    log = (
        "printed before\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/t/test_x.py", line 3 in test_x\n'
        '  File "/pkg/fsdp_testing/_launch/rank_process.py", line 120 in serve\n'
        '  File "/pkg/fsdp_testing/_launch/job_slot.py", line 250 in _become_rank\n'
        '  File "/pkg/fsdp_testing/plugin.py", line 141 in pytest_cmdline_main\n'
        '  File "/venv/_pytest/config/__init__.py", line 262 in _main\n'
    )
    output, stack = split_dump(log)
    assert output == "printed before\n"
    assert stack.splitlines() == [
        "Current thread 0x00007f (most recent call first):",
        '  File "/t/test_x.py", line 3 in test_x',
        '  File "/pkg/fsdp_testing/_launch/rank_process.py", line 120 in serve',
    ]


# A slot that cannot reach the store returns at once; what it imported by then is printed.
_SLOT_IMPORTS = """
import sys
from fsdp_testing._launch import job_slot
from fsdp_testing._launch.torchrun import read_job_env

def no_store(*args, **kwargs):
    raise ConnectionError("no store in this test")

job_slot.connect_store = no_store
names = ("pytest", "_pytest.assertion.rewrite", "torch.distributed")
print(sorted(n for n in names if n in sys.modules))
print(job_slot.serve_slot(read_job_env(TORCHRUN), helper=True))
print(sorted(n for n in names if n in sys.modules))
"""


def test_a_slot_imports_what_its_ranks_need_before_it_forks_them() -> None:
    """The ranks a slot forks start warm, as the fork server's do: pytest (every test module
    imports it) and its assertion rewriting are not imported inside a new rank's first test,
    and so inside its timeout (the first process's helper slot, a fresh interpreter, had
    neither; a rank of it was seen still importing pytest when a 3 s timeout hit)."""
    code = f"TORCHRUN = {TORCHRUN!r}\n{_SLOT_IMPORTS}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == "[]", proc.stdout + proc.stderr  # nothing of it before the slot runs
    assert lines[1] == "1", proc.stdout + proc.stderr  # no store: the slot gives up
    assert lines[2] == "['_pytest.assertion.rewrite', 'pytest', 'torch.distributed']"
