"""Tests that leak process state through pytest's fixtures and around them, among tests that
check a warm rank is as clean as a fresh one; run in random order (pytest-randomly, several
seeds) by tests/plugin/test_isolation.py. A check that ever sees a leak fails."""

import logging
import os
import signal
import sys
import threading
import time
import warnings

import pytest
import torch

START_CWD = os.getcwd()  # on a rank: read when the rank imports this file, before any test body


@pytest.mark.parametrize("n", range(3))
@pytest.mark.distributed(world_size=2)
def test_leak_through_monkeypatch(rank, monkeypatch, tmp_path, n):
    monkeypatch.setenv("LEAK_ENV", "1")
    monkeypatch.setattr(torch, "leak_attr", 1, raising=False)
    monkeypatch.setitem(sys.modules, "leak_module", os)
    monkeypatch.syspath_prepend("/leaked/by/monkeypatch")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.nn.Linear, "leak_method", lambda self: 1, raising=False)


@pytest.mark.parametrize("n", range(3))
@pytest.mark.distributed(world_size=2)
def test_leak_around_the_fixtures(rank, n):
    os.environ["LEAK_DIRECT"] = "1"
    sys.path.append("/leaked/path")
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(True)
    signal.signal(signal.SIGUSR2, lambda *args: None)


@pytest.mark.parametrize("n", range(2))
@pytest.mark.distributed(world_size=2)
def test_leak_a_thread(rank, n):
    threading.Thread(target=time.sleep, args=(60,), daemon=True, name="leaked-thread").start()


@pytest.mark.parametrize("n", range(2))
@pytest.mark.distributed(world_size=2)
def test_pytest_process_fixtures_work_on_ranks(rank, caplog, capsys, recwarn, n):
    logging.getLogger("user").warning("rank %s logs", rank)
    assert caplog.messages == [f"rank {rank} logs"]
    print("printed")
    assert capsys.readouterr().out == "printed\n"
    warnings.warn("a user warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["a user warning"]


@pytest.mark.parametrize("n", range(6))
@pytest.mark.distributed(world_size=2)
def test_check_a_clean_rank(rank, n):
    assert "LEAK_ENV" not in os.environ and "LEAK_DIRECT" not in os.environ
    assert not hasattr(torch, "leak_attr") and "leak_module" not in sys.modules
    assert not hasattr(torch.nn.Linear, "leak_method")
    assert "/leaked/path" not in sys.path and "/leaked/by/monkeypatch" not in sys.path
    assert os.getcwd() == START_CWD
    assert torch.get_float32_matmul_precision() == "highest"
    assert not torch.are_deterministic_algorithms_enabled() and not torch.is_anomaly_enabled()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    assert not any(t.name == "leaked-thread" for t in threading.enumerate())
    assert not logging.getLogger().handlers or all(
        type(h).__name__ != "LogCaptureHandler" for h in logging.getLogger().handlers
    )
