"""Debugging a rank (issue 43): ``--pdb`` opens its post-mortem on the failing rank's own frames
(thread and local mode in the pytest process; process mode through a copy of the rank on the
session's terminal), ``breakpoint()`` in a process-mode rank opens pdb on the terminal, and
without a terminal both say so and what to do instead. See [Note: debugging a rank] in
fsdp_testing/_integrations/debugging.py."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAILING = """
import pytest
import torch
import torch.distributed as dist


def check(rank):
    secret = rank * 10 + 7
    assert secret == 7, "rank mismatch"


@pytest.mark.distributed(world_size=2, mode="{mode}")
def test_fails_on_rank_one(rank):
    dist.all_reduce(torch.ones(1))
    check(rank)


@pytest.mark.distributed(world_size=2, mode="{mode}")
def test_next(rank):
    dist.barrier()
"""

BREAKPOINT = """
import pytest
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_breakpoint(rank):
    value = rank + 100
    breakpoint()
    dist.barrier()
"""


def _pytest(path: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """pytest in ``path`` in a session of its own: no controlling terminal, as in CI."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=path,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )


def _pytest_on_a_terminal(path: Path, *args: str, answers: list[str]) -> tuple[str, int]:
    """pytest in ``path`` on a pseudo-terminal, answering each ``(Pdb)`` prompt with the next
    of ``answers`` (then ``c``); its output and exit code."""
    import pty

    try:
        pid, fd = pty.fork()
    except OSError as exc:
        pytest.skip(f"no pseudo-terminal here: {exc}")
    if pid == 0:  # the child: pytest, with the pty as its controlling terminal
        os.chdir(path)
        os.execv(sys.executable, [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args])
    out, pending = b"", b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(fd, 4096)
            except OSError:  # the child ended
                break
            if not data:
                break
            out += data
            pending += data
            if pending.rstrip().endswith(b"(Pdb)"):
                pending = b""
                os.write(fd, ((answers.pop(0) if answers else "c") + "\n").encode())
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return out.decode(errors="replace").replace("\r\n", "\n"), os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("mode", ["thread", "local"])
def test_pdb_opens_on_the_failing_ranks_frames_in_process(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makepyfile(test_it=FAILING.format(mode=mode))
    proc = _pytest(pytester.path, "--pdb", stdin="p secret\np rank\nc\n")
    assert "fsdp_testing: --pdb opens on rank 1's frames (the first rank to fail)" in proc.stdout
    # pdb stops in check() on rank 1, where its locals are: secret is 17 and rank is 1.
    post_mortem = proc.stdout.split("PDB post_mortem")[1]
    assert "test_it.py(8)check()" in post_mortem, proc.stdout
    assert "(Pdb) 17\n(Pdb) 1\n" in post_mortem, proc.stdout
    assert "1 failed, 1 passed" in proc.stdout


RANK_THREAD_BREAKPOINT = """
import pytest
import torch.distributed as dist


@pytest.mark.distributed(world_size=2, mode="{mode}")
def test_breakpoint(rank):
    value = rank + 100
    if rank == 0:
        breakpoint()
    dist.barrier()
"""


@pytest.mark.parametrize(("mode", "capture"), [("thread", "-s"), ("local", "--capture=fd")])
def test_breakpoint_on_a_rank_thread_talks_to_the_terminal(
    pytester: pytest.Pytester, mode: str, capture: str
) -> None:
    # Under -s a rank thread's output is the harness's to keep for the report: pdb's must not
    # be (it would wait for an answer to a prompt nobody sees).
    pytester.makepyfile(test_it=RANK_THREAD_BREAKPOINT.format(mode=mode))
    proc = _pytest(pytester.path, capture, stdin="p value\nc\n")
    assert "test_it.py(10)test_breakpoint()" in proc.stdout, proc.stdout
    assert "(Pdb) 100\n" in proc.stdout, proc.stdout
    assert "1 passed" in proc.stdout


def test_pdb_and_breakpoint_in_process_mode_use_the_terminal(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a_breakpoint=BREAKPOINT, test_b_fails=FAILING.format(mode="process"))
    out, code = _pytest_on_a_terminal(
        pytester.path,
        "--pdb",
        answers=["p value", "c", "p secret", "p rank", "c", "p 'parent'", "c"],
    )
    assert code == 1, out
    # breakpoint() on the first rank to reach it, which it names; the other rank goes on.
    found = re.search(
        r"fsdp_testing: breakpoint\(\) on rank (\d) \(pid \d+; the other ranks go on\)", out
    )
    assert found is not None, out
    breakpoint_session = out[found.end() :]
    assert f"(Pdb) p value\n{100 + int(found.group(1))}\n" in breakpoint_session, out
    # The failing rank's post-mortem, on its own frames, before pytest's own on the parent.
    assert "fsdp_testing: rank 1 failed: post-mortem on its own frames" in out, out
    rank_session = out.split("fsdp_testing: rank 1 failed: post-mortem on its own frames")[1]
    assert "test_b_fails.py(8)check()" in rank_session, out
    assert "(Pdb) p secret\n17\n(Pdb) p rank\n1\n" in rank_session, out
    assert "(Pdb) p 'parent'\n'parent'\n" in rank_session.split("PDB post_mortem")[1], out
    assert "1 failed, 2 passed" in out, out


def test_without_a_terminal_pdb_and_breakpoint_say_what_to_do(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_it=FAILING.format(mode="process"))
    proc = _pytest(pytester.path, "--pdb", stdin="c\n")
    assert (
        "fsdp_testing: --pdb: no post-mortem on rank 1: /dev/tty cannot be opened" in proc.stdout
    ), proc.stdout
    assert "Run pytest from a terminal, or use mode='thread'" in proc.stdout
    assert "1 failed, 1 passed" in proc.stdout

    (pytester.path / "test_it.py").unlink()
    pytester.makepyfile(test_bp=BREAKPOINT)
    proc = _pytest(pytester.path)
    assert "RuntimeError: breakpoint() in a process-mode rank: /dev/tty cannot be opened" in (
        proc.stdout
    ), proc.stdout
    assert "or run the test with mode='thread'" in proc.stdout
    assert "1 failed" in proc.stdout
