"""The mirrors follow the installed torch (docs/compatibility.md, "Supported torch releases"):
``TEST_SKIPS``, skip reasons, ``_min_gpus_required``, the device selection of ``common_fsdp``,
backend checks, ``DistTestCases`` and torch 2.14/2.15's additions. Each test compares with the
installed torch's own module where it can, so it checks every release of the range it runs
under (scripts/torch_matrix.sh), and checks the release-dependent rules with both releases."""

from __future__ import annotations

import resource
import sys
import unittest
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_testing._compat.classes import backend_available
from fsdp_testing._compat.env import TORCH_RELEASE, fsdp_device_selection
from fsdp_testing._rank.skips import skip_message_for_exit_code
from fsdp_testing._unittest.world import cpu_world_size

no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks what a machine without a GPU does"
)


def _torchs() -> Any:
    from torch.testing._internal import common_distributed

    return common_distributed


def test_test_skips_are_the_installed_torchs() -> None:
    from fsdp_testing.common_distributed import TEST_SKIPS

    theirs = {key: tuple(skip) for key, skip in _torchs().TEST_SKIPS.items()}
    assert {key: tuple(skip) for key, skip in TEST_SKIPS.items()} == theirs
    for exit_code, message in theirs.values():
        assert skip_message_for_exit_code(exit_code) == message


@no_gpu
def test_skip_reasons_are_the_installed_torchs() -> None:
    from fsdp_testing.common_distributed import skip_if_lt_x_gpu, skip_if_no_gpu

    torchs = _torchs()
    by_code = {skip.exit_code: skip.message for skip in torchs.TEST_SKIPS.values()}

    @skip_if_lt_x_gpu(2, allow_cpu=False)
    def needs_two() -> None:
        raise AssertionError("must not run without GPUs")

    with pytest.raises(unittest.SkipTest) as ours:
        needs_two()
    assert str(ours.value) == by_code[77]  # torch's exit code for "needs 2 devices"

    # torch's skip_if_no_gpu exits on the rank with its code; ours skips with that code's words.
    @torchs.skip_if_no_gpu
    def torch_body() -> None:
        raise AssertionError("must not run without GPUs")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as exited:
            torch_body()
    skipped: Any = skip_if_no_gpu(lambda: None)
    assert skipped.__unittest_skip_why__ == by_code[exited.value.code]


def test_min_gpus_required_is_set_where_torch_sets_it() -> None:
    from fsdp_testing import common_distributed as ours

    torchs = _torchs()

    def body() -> None:
        pass

    decorators = [
        ("skip_if_lt_x_gpu", (3,), 3),
        ("nccl_skip_if_lt_x_gpu", ("nccl", 2), 2),
        ("require_n_gpus_for_nccl_backend", (4, "nccl"), 4),
        ("nccl_skip_if_lt_x_gpu", ("gloo", 2), None),
        ("require_n_gpus_for_nccl_backend", (4, "gloo"), None),
    ]
    for name, args, expected in decorators:
        mine = getattr(ours, name)(*args)(body)
        assert getattr(mine, "_min_gpus_required", None) == expected, name
        theirs = getattr(torchs, name)(*args)(body)
        if hasattr(theirs, "_min_gpus_required"):  # torch 2.15 and later
            assert theirs._min_gpus_required == expected, name


def test_device_selection_before_and_from_2_15(monkeypatch: pytest.MonkeyPatch) -> None:
    # An HPU machine: torch 2.15 asks torch.accelerator (type "hpu", its registered backend);
    # before, torch named the device "hpu:0".
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("hpu"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 3)
    assert fsdp_device_selection((2, 15)) == ("hpu", dist.get_default_backend_for_device("hpu"), 3)
    # MPS counts as no accelerator (gloo takes no MPS tensors).
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("mps"))
    assert fsdp_device_selection((2, 15)) == ("cpu", "gloo", cpu_world_size())
    # Before 2.15: CUDA, HPU, XPU in that order, from their own modules.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    if hasattr(torch, "hpu"):
        monkeypatch.setattr(torch.hpu, "is_available", lambda: False)
    assert fsdp_device_selection((2, 13)) == ("xpu", "xccl", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert fsdp_device_selection((2, 13)) == ("cuda", "nccl", 8)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert fsdp_device_selection((2, 15)) == ("cpu", "gloo", cpu_world_size())


def test_common_fsdp_device_constants_are_the_installed_torchs() -> None:
    from torch.testing._internal import common_fsdp as torchs

    from fsdp_testing import common_fsdp

    assert (common_fsdp.DEVICE_TYPE, common_fsdp.DISTRIBUTED_BACKEND) == (
        torchs.DEVICE_TYPE,
        torchs.DISTRIBUTED_BACKEND,
    )
    assert (
        common_fsdp.DEVICE_TYPE,
        common_fsdp.DISTRIBUTED_BACKEND,
        common_fsdp.DEVICE_COUNT,
    ) == fsdp_device_selection(TORCH_RELEASE)


def test_backend_check_of_continuous_classes_before_and_from_2_15() -> None:
    assert backend_available("gloo", (2, 13)) and backend_available("gloo", (2, 15))
    # An unknown name: torch 2.15 asks is_backend_available (no), 2.14 checked four names only.
    assert not backend_available("no_such_backend", (2, 15))
    assert backend_available("no_such_backend", (2, 14))
    for release in ((2, 13), (2, 15)):
        assert backend_available("mpi", release) == dist.is_mpi_available()


def test_dist_test_cases_are_the_installed_torchs() -> None:
    from fsdp_testing.common_distributed import DistTestCases

    torchs = _torchs().DistTestCases
    assert DistTestCases.backend_feature == torchs.backend_feature
    assert DistTestCases.skip_collective == torchs.skip_collective


def test_rocm_version_gates_let_the_test_run_off_rocm() -> None:
    from fsdp_testing.common_distributed import (
        skip_if_rocm_ver_atleast_multiprocess,
        skip_if_rocm_ver_lessthan_multiprocess,
    )

    def body() -> None:
        pass

    assert skip_if_rocm_ver_atleast_multiprocess((6, 0))(body) is body
    assert skip_if_rocm_ver_lessthan_multiprocess((6, 0))(body) is body


def test_requires_xccl_skips_without_the_backend() -> None:
    from fsdp_testing.common_distributed import requires_xccl

    decorated: Any = requires_xccl()(lambda: None)
    xccl = bool(getattr(dist, "is_xccl_available", lambda: False)())
    assert getattr(decorated, "__unittest_skip__", False) is not xccl
    if not xccl:
        assert decorated.__unittest_skip_why__ == "c10d was not compiled with the XCCL backend"


@pytest.mark.skipif(sys.platform == "win32", reason="Windows has no RLIMIT_CORE")
def test_core_dumps_disabled_inside_the_block_and_restored_after() -> None:
    from fsdp_testing.common_distributed import core_dumps_disabled

    before = resource.getrlimit(resource.RLIMIT_CORE)
    with pytest.raises(RuntimeError, match="inside"):
        with core_dumps_disabled():
            assert resource.getrlimit(resource.RLIMIT_CORE) == (0, before[1])
            raise RuntimeError("inside")
    assert resource.getrlimit(resource.RLIMIT_CORE) == before


@no_gpu
def test_requires_accelerator_skips_functions_when_run_and_classes_when_defined() -> None:
    from fsdp_testing.common_utils import requires_accelerator

    ran: list[int] = []
    body = requires_accelerator(lambda: ran.append(1))
    with pytest.raises(unittest.SkipTest, match=r"^requires accelerator$"):
        body()
    assert ran == []

    @requires_accelerator
    class Case(unittest.TestCase):
        pass

    assert Case.__unittest_skip__ and Case.__unittest_skip_why__ == "requires accelerator"  # type: ignore[attr-defined]


def test_hardware_classification_has_torchs_members() -> None:
    from fsdp_testing.common_utils import HardwareClassification

    assert {m.name: m.value for m in HardwareClassification} == {
        "GENERIC": "generic",
        "ACCELERATOR": "accelerator",
        "CPU": "cpu",
        "CUDA": "cuda",
        "MPS": "mps",
        "XPU": "xpu",
    }
    torch_utils = pytest.importorskip("torch.testing._internal.common_utils")
    if hasattr(torch_utils, "HardwareClassification"):
        theirs = torch_utils.HardwareClassification
        assert [(m.name, m.value) for m in theirs] == [
            (m.name, m.value) for m in HardwareClassification
        ]


GATES = """
import unittest

from fsdp_testing.common_utils import periodic, requires_multigpu


@requires_multigpu
def test_two_gpus():
    pass


@periodic
def test_nightly():
    pass


@requires_multigpu
class TestOnTwoGpus(unittest.TestCase):
    def test_x(self):
        pass
"""


def test_multigpu_and_periodic_gates_with_their_markers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(test_gates=GATES)
    two_gpus = torch.cuda.device_count() >= 2
    result = pytester.runpytest_subprocess("--strict-markers", "-rs")
    if two_gpus:
        result.assert_outcomes(passed=3)
    else:
        result.assert_outcomes(passed=1, skipped=2)
        result.stdout.fnmatch_lines(["*requires >= 2 GPUs*"])
    # The markers select: -m "not multigpu" leaves the periodic test only.
    result = pytester.runpytest_subprocess("--strict-markers", "-m", "not multigpu")
    result.assert_outcomes(passed=1, deselected=2)
    # In CI a periodic test is skipped unless PYTORCH_TEST_WITH_PERIODIC asks for it.
    monkeypatch.setenv("CI", "1")
    monkeypatch.delenv("PYTORCH_TEST_WITH_PERIODIC", raising=False)
    result = pytester.runpytest_subprocess("-m", "periodic", "-rs")
    result.assert_outcomes(skipped=1, deselected=2)
    result.stdout.fnmatch_lines(["*test is periodic; run with PYTORCH_TEST_WITH_PERIODIC*"])
    monkeypatch.setenv("PYTORCH_TEST_WITH_PERIODIC", "1")
    result = pytester.runpytest_subprocess("-m", "periodic")
    result.assert_outcomes(passed=1, deselected=2)


def test_efa_probe_result_is_has_efas_cached_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch up to 2.9 names the probe's cache EFA_PROBE_RESULT in common_distributed.
    import subprocess

    from fsdp_testing import common_distributed
    from fsdp_testing._compat import dist_helpers

    probes: list[list[str]] = []

    def fi_info(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        probes.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fi_info)
    monkeypatch.setattr(dist_helpers, "EFA_PROBE_RESULT", None)
    assert common_distributed.EFA_PROBE_RESULT is None
    assert common_distributed.has_efa() is True
    assert common_distributed.EFA_PROBE_RESULT is True
    assert common_distributed.tp_transports() == ["shm", "uv"]
    assert probes == [["fi_info", "-p", "efa", "-t", "FI_EP_RDM"]]  # probed once

    def no_fi_info(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    monkeypatch.setattr(subprocess, "run", no_fi_info)
    monkeypatch.setattr(dist_helpers, "EFA_PROBE_RESULT", None)
    assert common_distributed.has_efa() is False
    assert common_distributed.EFA_PROBE_RESULT is False
    assert common_distributed.tp_transports() is None
