"""Fast, single-process tests of the torch-compatibility layer: torch's assertEqual, test names
of parametrize/subtest, the CPU world-size rule, requirement decorators, keyword aliases."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import unittest
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_testing._compat.fsdp import (
    DummyProcessGroup,
    _keyword_alias,
    mirror_engine,
    subtest_name,
)
from fsdp_testing._unittest import world
from fsdp_testing.common_distributed import (
    get_required_world_size,
    requires_gloo,
    requires_world_size,
    skip_if_no_gpu,
    skip_if_odd_worldsize,
    skip_if_rocm_multiprocess,
)
from fsdp_testing.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    subtest,
    xfailIf,
)


class _Probe(TestCase):
    def runTest(self) -> None:  # unittest needs a method to build an instance
        pass


@pytest.fixture
def case() -> _Probe:
    return _Probe()


# -- assertEqual ---------------------------------------------------------------------------------


def test_tensors_compare_with_dtype_tolerances(case: _Probe) -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    case.assertEqual(t, t + 1e-7)  # float noise within float32's rtol/atol
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        case.assertEqual(t, t + 1e-3)
    case.assertEqual(t.bfloat16(), (t + 1e-2).bfloat16())  # bfloat16's looser default


def test_dtype_is_checked_unless_told_otherwise(case: _Probe) -> None:
    t = torch.tensor([1.0, 2.0])
    with pytest.raises(AssertionError, match="dtype"):
        case.assertEqual(t, t.double())
    case.assertEqual(t, t.double(), exact_dtype=False)


def test_sequences_of_tensors_and_mappings_compare_elementwise(case: _Probe) -> None:
    a, b = torch.ones(3), torch.zeros(3)
    case.assertEqual([a, b], (a.clone(), b.clone()))
    with pytest.raises(AssertionError, match=r"item \[1\]"):
        case.assertEqual([a, b], [a, a])
    with pytest.raises(AssertionError, match="length of the sequences"):
        case.assertEqual([a], [a, a])
    with pytest.raises(AssertionError, match=r"item \['w'\]"):
        case.assertEqual({"w": a}, {"w": b})
    with pytest.raises(AssertionError, match="keys differ"):
        case.assertEqual({"w": a}, {"v": a})


def test_scalars_against_tensors_and_numbers(case: _Probe) -> None:
    case.assertEqual(torch.tensor(3.0), 3)
    case.assertEqual(3, 3.0)
    case.assertEqual(torch.tensor([2.0, 4.0]), [2, 4])
    case.assertEqual(True, torch.tensor(1))
    case.assertEqual(0.1 + 0.2, 0.3)
    with pytest.raises(AssertionError, match="Scalars are not close"):
        case.assertEqual(torch.tensor(3.0), 3.5)
    with pytest.raises(AssertionError, match="cannot compare"):
        case.assertEqual(torch.ones(2), 1)


def test_atol_rtol_and_precision_override(case: _Probe) -> None:
    t = torch.zeros(2)
    case.assertEqual(t, t + 0.05, atol=0.1, rtol=0)
    with pytest.raises(ValueError, match="pass both atol and rtol or neither"):
        case.assertEqual(t, t, atol=0.1)
    case.precision = 0.1
    case.assertEqual(t, t + 0.05)


def test_msg_is_appended_or_called(case: _Probe) -> None:
    t = torch.zeros(2)
    with pytest.raises(AssertionError, match=r"(?s)not close.*\nweights differ"):
        case.assertEqual(t, t + 1, msg="weights differ")
    with pytest.raises(AssertionError, match=r"^custom: Tensor-likes"):
        case.assertEqual(t, t + 1, msg=lambda generated: f"custom: {generated}")
    with pytest.raises(AssertionError, match="1 != 0 : rank one is off"):
        case.assertEqual(1, 0, "rank one is off")


def test_assert_not_equal_on_tensors(case: _Probe) -> None:
    t = torch.zeros(3)
    case.assertNotEqual(t, t + 1)
    with pytest.raises(AssertionError):
        case.assertNotEqual(t, t.clone())


class _SubclassA(torch.Tensor):
    # Like LocalTensor and AsyncCollectiveTensor: no __torch_function__ of its own.
    __torch_function__ = torch._C._disabled_torch_function_impl


class _SubclassB(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl


def test_unrelated_tensor_subclasses_compare_by_value(case: _Probe) -> None:
    # assert_close refuses a pair of which neither type is the other's (a LocalTensor against
    # an AsyncCollectiveTensor in torch's DTensor tests); torch's assertEqual compares them.
    a = torch.arange(3.0).as_subclass(_SubclassA)
    b = torch.arange(3.0).as_subclass(_SubclassB)
    case.assertEqual(a, b)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        case.assertEqual(a, (torch.arange(3.0) + 1).as_subclass(_SubclassB))


def test_assert_not_warn(case: _Probe) -> None:
    case.assertNotWarn(lambda: None)
    with pytest.raises(AssertionError, match=r"quiet please \(warned: UserWarning: loud\)"):
        case.assertNotWarn(lambda: warnings.warn("loud", stacklevel=1), "quiet please")


def test_attempt_load_from_subprocess(case: _Probe, tmp_path: Path) -> None:
    saved = tmp_path / "t.pt"
    torch.save(torch.ones(2), saved)
    case._attempt_load_from_subprocess(saved, "")
    missing = tmp_path / "missing.pt"
    case._attempt_load_from_subprocess(missing, "", "No such file or directory")
    with pytest.raises(AssertionError, match="succeeded; expected it to fail"):
        case._attempt_load_from_subprocess(saved, "import os;", "No such file")


# -- parametrize and subtest ---------------------------------------------------------------------


class _Thing:
    pass


def test_parametrized_names_are_torchs_and_never_hold_addresses() -> None:
    class Cases(TestCase):
        @parametrize("dtype", [torch.float32, torch.bfloat16])
        @parametrize("lr", [0.5, 1])
        def test_a(self, dtype: torch.dtype, lr: float) -> None:
            pass

        @parametrize("thing", [_Thing(), subtest(_Thing(), name="named"), None])
        def test_b(self, thing: object) -> None:
            pass

        @parametrize("x,y", [(1, "u"), (2, "v")], name_fn=lambda x, y: f"{y}{x}")
        def test_c(self, x: int, y: str) -> None:
            pass

    instantiate_parametrized_tests(Cases)
    names = sorted(n for n in vars(Cases) if n.startswith("test_"))
    assert names == [
        "test_a_bfloat16_lr_0_5",
        "test_a_bfloat16_lr_1",
        "test_a_float32_lr_0_5",
        "test_a_float32_lr_1",
        "test_b_named",
        "test_b_thing0",
        "test_b_thing2",
        "test_c_u1",
        "test_c_v2",
    ]


def test_subtest_decorators_apply_to_their_case_only() -> None:
    class Cases(TestCase):
        @parametrize("n", [subtest(1, name="fails", decorators=[xfailIf(True)]), 2])
        def test_n(self, n: int) -> None:
            assert n == 2

    instantiate_parametrized_tests(Cases)
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(Cases).run(result)
    assert result.testsRun == 2
    assert len(result.expectedFailures) == 1 and not result.failures
    assert "test_n_fails" in result.expectedFailures[0][0].id()


def test_parametrize_reports_mismatched_values() -> None:
    class Cases(TestCase):
        @parametrize("x,y", [(1, 2, 3)])
        def test_x(self, x: int, y: int) -> None:
            pass

    with pytest.raises(ValueError, match="case 0 has 3 values for 2 names"):
        instantiate_parametrized_tests(Cases)


def test_inherited_generic_parametrized_test_raises_torchs_error() -> None:
    class Base(TestCase):
        @parametrize("x", [1, 2])
        def test_a(self, x: int) -> None:
            pass

    class Sub(Base):
        @parametrize("y", [3])
        def test_b(self, y: int) -> None:
            pass

    with pytest.raises(AttributeError) as error:
        instantiate_parametrized_tests(Sub)
    # torch's words first (its delattr fails on the inherited attribute), then the fix.
    assert str(error.value).startswith("type object 'Sub' has no attribute 'test_a': ")
    assert "call instantiate_parametrized_tests(Base)" in str(error.value)
    assert "test_b" in vars(Sub) and "test_b_y_3" not in vars(Sub)  # nothing was changed


def test_inherited_generated_case_raises_torchs_error_and_own_cases_still_work() -> None:
    @instantiate_parametrized_tests
    class Base(TestCase):
        @parametrize("x", [1, 2])
        def test_a(self, x: int) -> None:
            assert x in (1, 2)

    class Sub(Base):
        pass

    with pytest.raises(AttributeError) as error:
        instantiate_parametrized_tests(Sub)
    assert str(error.value).startswith("type object 'Sub' has no attribute 'test_a_x_1': ")
    assert "leave the subclass out of instantiate_parametrized_tests" in str(error.value)
    # Left out, the subclass runs the cases it inherits.
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(Sub).run(result)
    assert result.testsRun == 2 and result.wasSuccessful()


def test_inherited_parametrized_tests_fail_as_under_torchs_function(tmp_path: Path) -> None:
    # torch's own instantiate_parametrized_tests, in a child process (importing torch's
    # common_utils changes global state), on the two inherited cases above: the same type and
    # the same words as ours.
    script = tmp_path / "inherited.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, unittest

            if sys.argv[1] == "torch":
                from torch.testing._internal.common_utils import (
                    instantiate_parametrized_tests, parametrize)
            else:
                from fsdp_testing.common_utils import instantiate_parametrized_tests, parametrize

            class Base(unittest.TestCase):
                @parametrize("x", [1, 2])
                def test_a(self, x):
                    pass

            class Sub(Base):
                pass

            @instantiate_parametrized_tests
            class Base2(unittest.TestCase):
                @parametrize("x", [1, 2])
                def test_a(self, x):
                    pass

            class Sub2(Base2):
                pass

            for cls in (Sub, Sub2):
                try:
                    instantiate_parametrized_tests(cls)
                    print("no error")
                except Exception as exc:
                    print(type(exc).__name__, str(exc).split(": ")[0])
            """
        )
    )
    outputs = {}
    for which in ("torch", "ours"):
        proc = subprocess.run(
            [sys.executable, str(script), which],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outputs[which] = proc.stdout
    assert outputs["torch"] == outputs["ours"], outputs
    assert outputs["ours"].splitlines() == [
        "AttributeError type object 'Sub' has no attribute 'test_a'",
        "AttributeError type object 'Sub2' has no attribute 'test_a_x_1'",
    ]


# -- world size ----------------------------------------------------------------------------------


def test_world_of_zero_on_cpu_gets_the_cpu_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(world.CPU_WORLD_SIZE_ENV, raising=False)
    choice = world.choose_world_size(0, accelerators=0, owner="T.world_size")
    assert choice.world_size == 2
    assert choice.note is not None and "ran on 2 CPU ranks" in choice.note
    assert world.choose_world_size(0, accelerators=0, min_ranks=4).world_size == 4
    assert world.choose_world_size(1, accelerators=0, min_ranks=2).world_size == 2
    assert world.choose_world_size(3, accelerators=0, min_ranks=2) == world.WorldChoice(3)
    monkeypatch.setenv(world.CPU_WORLD_SIZE_ENV, "3")
    assert world.choose_world_size(-2, accelerators=0).world_size == 3


def test_world_with_accelerators_is_the_declared_one() -> None:
    assert world.choose_world_size(2, accelerators=8) == world.WorldChoice(2)
    with pytest.raises(ValueError, match=r"T\.world_size is 0 on a machine with 2 accelerator"):
        world.choose_world_size(0, accelerators=2, owner="T.world_size")
    with pytest.raises(TypeError, match="must be an int"):
        world.choose_world_size(True, accelerators=0)


def test_cpu_world_size_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(world.CPU_WORLD_SIZE_ENV, raising=False)
    with pytest.raises(ValueError, match="positive number of ranks"):
        world.set_cpu_world_size(0)
    world.set_cpu_world_size(5)
    assert world.cpu_world_size() == 5
    world.set_cpu_world_size(None)
    assert world.cpu_world_size() == 2
    monkeypatch.setenv(world.CPU_WORLD_SIZE_ENV, "many")
    with pytest.raises(ValueError, match="FSDP_TESTING_CPU_WORLD_SIZE"):
        world.cpu_world_size()


def test_timeout_scales_with_ranks_per_core() -> None:
    assert world.scaled_timeout(120, 8, cpus=2) == 480
    assert world.scaled_timeout(120, 2, cpus=16) == 120


# -- requirements and helpers --------------------------------------------------------------------


def test_requirements_are_decided_at_decoration_with_the_reason() -> None:
    def body() -> None:
        pass

    assert not getattr(requires_gloo()(body), "__unittest_skip__", False)
    assert not getattr(skip_if_rocm_multiprocess(body), "__unittest_skip__", False)
    if not torch.cuda.is_available():
        skipped: Any = skip_if_no_gpu(body)
        # torch 2.15 says "accelerator is not available." (test_torch_release.py compares).
        assert skipped.__unittest_skip__ and skipped.__unittest_skip_why__ in (
            "CUDA is not available.",
            "accelerator is not available.",
        )


def test_requires_world_size_sets_the_world() -> None:
    class Case(TestCase):
        @requires_world_size(3)
        def test_x(self) -> None:
            pass

        def test_y(self) -> None:
            pass

    assert get_required_world_size(Case("test_x"), 2) == 3
    assert get_required_world_size(Case("test_y"), 2) == 2


def test_world_checks_on_the_rank_see_the_world_the_test_got(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The unittest classes enter ``world.in_test_world`` around a method on each rank; the
    rank-side decorators read it (outside one, ``$WORLD_SIZE``, as torch's do)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ran: list[int] = []
    body = skip_if_odd_worldsize(lambda: ran.append(1))
    assert world.running_world_size() is None
    body()  # no world known: nothing to check
    with world.in_test_world(3):
        assert world.running_world_size() == 3
        with pytest.raises(unittest.SkipTest, match=r"odd world size.*\(world size 3\)"):
            body()
        with world.in_test_world(2):
            body()
        assert world.running_world_size() == 3
    assert world.running_world_size() is None and ran == [1, 1]
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(unittest.SkipTest):
        body()
    with pytest.raises(ValueError, match="in_test_world must be a positive number of ranks"):
        with world.in_test_world(0):
            pass


def test_keyword_alias_accepts_one_name_only() -> None:
    assert _keyword_alias(None, "old", "device_init_mode", "cuda_init_mode", "api") == "old"
    with pytest.raises(TypeError, match="pass device_init_mode or its old name cuda_init_mode"):
        _keyword_alias(1, 2, "device_init_mode", "cuda_init_mode", "api")
    with pytest.raises(TypeError, match="missing the device_init_mode argument"):
        _keyword_alias(None, None, "device_init_mode", "cuda_init_mode", "api")


def test_mirror_engine_is_torchs_unless_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_testing._protocol import ENGINE_ENV

    monkeypatch.delenv(ENGINE_ENV, raising=False)
    assert mirror_engine() == "torch_fsdp1"
    monkeypatch.setenv(ENGINE_ENV, "fsdp_core")
    assert mirror_engine() == "fsdp_core"

    class Chosen:
        fsdp_engine = "torch_fsdp2"

    assert mirror_engine(Chosen()) == "torch_fsdp2"


def test_small_helpers() -> None:
    assert subtest_name({"a": "x", "b": "y"}, "a", None, "b") == "x_none_y"
    group = DummyProcessGroup(rank=1, size=4)
    assert (group.rank(), group.size()) == (1, 4)
    assert group.allreduce(torch.ones(1)).get_future().wait() == 1
