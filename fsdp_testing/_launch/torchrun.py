"""How pytest knows that it is one process of a launched job, and where it sits in it.

A launcher starts pytest on every rank of a job: ``torchrun`` (single- or multi-node), Slurm's
``srun``, or a Kubernetes PyTorchJob (which sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` in every pod, with or without torchrun inside). This module reads what each of
them sets into one :class:`JobEnv`; it imports no torch (the plugin reads it at import). What the
job then does with its processes is in ``job.py`` (the first process) and ``job_slot.py`` (every
other one); docs/multinode.md describes both.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping

__all__ = [
    "DEFAULT_SLURM_PORT_BASE",
    "OPT_OUT_ENV",
    "JobEnv",
    "expand_nodelist",
    "job_env",
    "read_job_env",
]

OPT_OUT_ENV = "FSDP_TESTING_JOB"
"""Set to ``0`` to run a plain pytest session even though the environment describes a job."""
DEFAULT_SLURM_PORT_BASE = 20000
"""Under srun without ``MASTER_PORT`` the store listens on ``20000 + SLURM_JOB_ID % 10000``, so
two jobs that share their first node do not pick the same port."""


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """This process's place in a launched job.

    Args:
        launcher: ``"torchrun"``, ``"srun"`` or ``"env"`` (``RANK``/``WORLD_SIZE`` set by
            another launcher, e.g. a PyTorchJob without torchrun).
        rank: this process's global rank.
        world_size: the number of processes in the job.
        local_rank: this process's index on its node.
        node: the node's index, when the launcher says it (None: learnt from host names).
        master_addr: the host of the job's store (c10d ``TCPStore``).
        master_port: its port.
        agent_store: whether the launcher hosts that store (torchrun's agent does); otherwise
            global rank 0 hosts it.
        job_id: names this job's keys in the store.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    node: int | None
    master_addr: str
    master_port: int
    agent_store: bool
    job_id: str

    def describe(self) -> str:
        """``"this torchrun job"``, ``"this srun job step"``, ``"this launched job"``."""
        return {
            "torchrun": "this torchrun job",
            "srun": "this srun job step",
        }.get(self.launcher, "this launched job")


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"fsdp_testing: {name}={raw!r} is not an integer; the launcher's environment is "
            f"malformed (set {OPT_OUT_ENV}=0 to run a plain pytest session instead)"
        ) from None


_BRACKETED = re.compile(r"\[([^\]]*)\]")


def _expand_host(item: str) -> list[str]:
    match = _BRACKETED.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    hosts: list[str] = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"fsdp_testing: cannot read the Slurm node list range {part!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            hosts.extend(head + str(n).zfill(width) + rest for rest in _expand_host(tail))
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a Slurm node list, in order, as ``scontrol show hostnames`` prints
    them: ``"node[01-03],gpu7"`` gives ``node01, node02, node03, gpu7``.

    Supported: comma-separated items, each a name with any number of bracketed groups of
    numbers and zero-padded ranges (``rack[1-2]-n[07,09]``). Not supported (raises
    ``ValueError``): Slurm's ``*`` repetition and step suffixes in ranges.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (i.strip() for i in items):
        if item:
            hosts.extend(_expand_host(item))
    return hosts


def _slurm(environ: Mapping[str, str]) -> JobEnv | None:
    # srun sets SLURM_STEP_NUM_TASKS for the tasks of a step; a batch script (where
    # SLURM_PROCID is 0 and SLURM_NTASKS counts the whole allocation) does not, and must not
    # wait for peers that nobody started.
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return None
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS")
    master = environ.get("MASTER_ADDR")
    if not master:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
        hosts = expand_nodelist(nodelist) if nodelist else []
        master = hosts[0] if hosts else environ.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if not master:
        raise ValueError(
            "fsdp_testing: this srun job step names no node list (SLURM_STEP_NODELIST, "
            "SLURM_JOB_NODELIST) to find rank 0's host: set MASTER_ADDR to it"
        )
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    else:
        job = environ.get("SLURM_JOB_ID", "0")
        port = DEFAULT_SLURM_PORT_BASE + (int(job) % 10000 if job.isdigit() else 0)
    return JobEnv(
        launcher="srun",
        rank=_int(environ, "SLURM_PROCID"),
        world_size=world_size,
        local_rank=_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0,
        node=_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else None,
        master_addr=master,
        master_port=port,
        agent_store=False,
        job_id=f"slurm-{environ.get('SLURM_JOB_ID', '0')}.{environ.get('SLURM_STEP_ID', '0')}",
    )


def _rank_env(environ: Mapping[str, str]) -> JobEnv | None:
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    torchrun = "TORCHELASTIC_RUN_ID" in environ
    if not all(k in environ for k in needed):
        return None
    rank, world_size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
    node: int | None = None
    if "GROUP_RANK" in environ:  # torchrun: the node's index in the rendezvous
        node = _int(environ, "GROUP_RANK")
    elif "LOCAL_WORLD_SIZE" in environ:
        node = rank // max(1, _int(environ, "LOCAL_WORLD_SIZE"))
    elif "LOCAL_RANK" not in environ:
        node = rank  # one process per pod (a PyTorchJob without torchrun)
    if torchrun:
        job_id = (
            f"torchrun-{environ['TORCHELASTIC_RUN_ID']}."
            f"{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
    else:
        job_id = "env"
    return JobEnv(
        launcher="torchrun" if torchrun else "env",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        node=node,
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        job_id=job_id,
    )


def read_job_env(environ: Mapping[str, str]) -> JobEnv | None:
    """The job ``environ`` describes, or None for a plain session.

    torchrun's and a PyTorchJob's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) win over Slurm's (torchrun inside srun sets them). A job of one process is
    a plain session. ``FSDP_TESTING_JOB=0`` turns detection off.
    """
    if environ.get(OPT_OUT_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    job = _rank_env(environ) or _slurm(environ)
    if job is None or job.world_size <= 1:
        return None
    if not 0 <= job.rank < job.world_size:
        raise ValueError(
            f"fsdp_testing: rank {job.rank} is outside the job's world size {job.world_size} "
            f"({job.launcher}); the launcher's environment is malformed"
        )
    return job


@functools.cache
def job_env() -> JobEnv | None:
    """This process's job (read once from ``os.environ``), or None for a plain session."""
    return read_job_env(os.environ)
