"""The likely-cause analysis in one process, on synthetic tensors: the gradient inferred from an
SGD update, each cause from the numbers that make it, and each false-positive guard. The
planted bugs in real distributed code are ``test_causes_planted.py`` and
``test_causes_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from fsdp_testing.parity._causes import (
    Cause,
    CauseKind,
    Gradients,
    InitialPair,
    ParamStep,
    RankFacts,
    SGDRule,
    StepEvidence,
    cross_rank_causes,
    format_causes,
    local_causes,
    merge_causes,
    shard_causes,
)

LR = 0.05


def _sgd_step(
    value: torch.Tensor, grads: list[torch.Tensor], **options: float | bool
) -> list[torch.Tensor]:
    """The values after each of ``grads`` stepped by ``torch.optim.SGD``."""
    param = torch.nn.Parameter(value.clone())
    optim = torch.optim.SGD([param], lr=LR, **options)  # type: ignore[arg-type]
    out = []
    for grad in grads:
        param.grad = grad.clone()
        optim.step()
        out.append(param.detach().clone())
    return out


def _param(
    name: str,
    before: torch.Tensor,
    ref_grad: torch.Tensor,
    grad: torch.Tensor,
    *,
    kept: bool = False,
    diverged: bool | None = None,
) -> ParamStep:
    """One parameter at step 1 of SGD with momentum 0.9: the reference stepped with
    ``ref_grad``, the model under test with ``grad`` (or not at all: ``kept``)."""
    (ref_after,) = _sgd_step(before, [ref_grad], momentum=0.9)
    after = before.clone() if kept else _sgd_step(before, [grad], momentum=0.9)[0]
    return ParamStep(
        name=name,
        ref_before=before,
        ref_after=ref_after,
        before=before,
        after=after,
        ref_grad=ref_grad,
        sgd=SGDRule(lr=LR, momentum=0.9),
        diverged=not torch.equal(after, ref_after) if diverged is None else diverged,
    )


def _model(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Two linear layers' parameters and gradients, in the model's order."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"0.weight": (32, 16), "0.bias": (32,), "2.weight": (8, 32), "2.bias": (8,)}
    return {
        name: (torch.randn(shape, generator=g) * 0.3, torch.randn(shape, generator=g) * 0.1)
        for name, shape in shapes.items()
    }


def _evidence(params: list[ParamStep], *, world: int = 2, accum: int = 1, **kw) -> StepEvidence:
    return StepEvidence(
        step=1, rank=0, world_size=world, accum_steps=accum, params=tuple(params), **kw
    )


def _scaled(factor: float, only: set[str] | None = None, *, world: int = 2, accum: int = 1):
    params = [
        _param(n, v, g, g * factor if only is None or n in only else g)
        for n, (v, g) in _model().items()
    ]
    return local_causes(_evidence(params, world=world, accum=accum))


# -- the gradient an update implies -------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.3},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "weight_decay": 0.01},
        {"momentum": 0.9, "maximize": True},
    ],
    ids=["plain", "momentum", "dampening", "nesterov", "weight_decay", "maximize"],
)
def test_the_gradient_an_sgd_update_applied_is_recovered_within_its_noise(options):
    """At step 2 (momentum buffers equal before it), the model under test's gradient is read
    back from its update, whatever SGD's options, to within the bound it carries."""
    value, grad = _model()["0.weight"]
    first = grad * 0.7
    ref_mid, ref_after = _sgd_step(value, [first, grad], **options)
    _, after = _sgd_step(value, [first, 3 * grad], **options)
    step = ParamStep(
        name="w",
        ref_before=ref_mid,
        ref_after=ref_after,
        before=ref_mid,
        after=after,
        ref_grad=grad,
        sgd=SGDRule(lr=LR, first_step=False, **options),  # type: ignore[arg-type]
    )
    found = step.gradients()
    assert found is not None
    error = (found.actual - 3 * grad.double().reshape(-1)).abs()
    assert bool((error <= found.noise + 1e-12).all()), float((error - found.noise).max())
    assert float(found.noise.max()) < 1e-4  # tight enough to tell 3x from anything else


def test_no_gradient_is_inferred_without_sgd_or_a_reference_gradient():
    value, grad = _model()["0.bias"]
    step = _param("b", value, grad, grad)
    assert step.gradients() is not None
    assert ParamStep(**{**step.__dict__, "sgd": None}).gradients() is None
    assert ParamStep(**{**step.__dict__, "ref_grad": None}).gradients() is None
    adam = torch.optim.Adam([torch.nn.Parameter(value)])
    assert SGDRule.of(adam, adam.param_groups[0]["params"][0], first_step=True) is None
    with pytest.raises(ValueError, match=r"SGDRule: lr must be positive, got 0"):
        SGDRule(lr=0)


# -- one constant factor ------------------------------------------------------------------------


def test_every_gradient_twice_the_reference_at_world_size_2_is_a_sum():
    (cause,) = _scaled(2.0)
    assert cause.kind is CauseKind.GRADIENTS_SUMMED
    assert str(cause) == (
        "every gradient is 2.000x the reference's (world size 2): gradients summed, not averaged"
    )


def test_only_the_diverging_gradients_are_named_with_the_factor():
    (cause,) = _scaled(4.0, {"2.bias"}, world=4)
    assert cause.kind is CauseKind.GRADIENTS_SUMMED
    assert cause.evidence.startswith(
        "every diverging gradient (2.bias; 3 other parameters match) is 4.000x the reference's"
    )


@pytest.mark.parametrize(
    ("factor", "world", "accum", "kind", "words"),
    [
        (
            1 / 4,
            4,
            1,
            CauseKind.GRADIENTS_DIVIDED_TWICE,
            "0.250x the reference's (1/4, world size 4)",
        ),
        (3.0, 2, 3, CauseKind.ACCUMULATION_NOT_SCALED, "3.000x the reference's (accum_steps 3)"),
        (6.0, 2, 3, CauseKind.CONSTANT_FACTOR, "world size x accum_steps = 6"),
        (1 / 3, 2, 3, CauseKind.CONSTANT_FACTOR, "each micro-batch loss divided by 3 twice"),
        (5.0, 2, 1, CauseKind.CONSTANT_FACTOR, "a sum of 5 terms where their mean was meant"),
        (1.7, 2, 1, CauseKind.CONSTANT_FACTOR, "1.700x the reference's, not a factor of world"),
    ],
)
def test_each_factor_is_named_by_what_it_matches(factor, world, accum, kind, words):
    (cause,) = _scaled(factor, world=world, accum=accum)
    assert cause.kind is kind
    assert words in str(cause)


def test_a_factor_equal_to_both_the_world_size_and_the_accumulation_says_both():
    (cause,) = _scaled(2.0, world=2, accum=2)
    assert cause.kind is CauseKind.GRADIENTS_SUMMED
    assert "or accum_steps 2 not divided" in cause.conclusion


@pytest.mark.parametrize("world", [8, 16, 64])
def test_rounding_level_differences_at_larger_worlds_name_no_cause(world):
    """Summation order at W ranks: each gradient element off by a few fp32 ulps, different
    per element; diverging under exact comparison, explained by nothing."""
    g = torch.Generator().manual_seed(world)
    params = []
    for name, (value, grad) in _model().items():
        ulps = torch.randint(-world, world + 1, grad.shape, generator=g).float()
        noisy = grad + ulps * torch.finfo(torch.float32).eps * grad.abs()
        params.append(_param(name, value, grad, noisy))
    assert any(p.diverged for p in params)
    assert local_causes(_evidence(params, world=world)) == ()


def test_a_gradient_that_is_not_a_multiple_names_no_factor():
    g = torch.Generator().manual_seed(1)
    params = [
        _param(n, v, grad, grad + 0.5 * torch.randn(grad.shape, generator=g) * grad.abs().mean())
        for n, (v, grad) in _model().items()
    ]
    assert local_causes(_evidence(params)) == ()


# -- a factor per rank's slice, a parameter left alone ------------------------------------------


def test_each_flat_slice_scaled_by_its_own_constant_is_a_rank_local_scale():
    """A clipping coefficient computed from each rank's slice of the flat gradient."""
    model = _model()
    flat_ref = torch.cat([g.reshape(-1) for _, g in model.values()])
    half = -(-flat_ref.numel() // 2)
    scale = torch.ones_like(flat_ref)
    scale[:half] = 1.25
    flat = flat_ref * scale
    params, offset = [], 0
    for name, (value, grad) in model.items():
        part = flat[offset : offset + grad.numel()].view_as(grad)
        params.append(_param(name, value, grad, part))
        offset += grad.numel()
    (cause,) = local_causes(_evidence(params))
    assert cause.kind is CauseKind.PER_SLICE_FACTORS
    assert f"elements 0-{half - 1} (rank 0) 1.250x, elements {half}-" in cause.evidence
    assert "(rank 1) 1.000x the reference's" in cause.evidence


def test_a_parameter_that_kept_its_value_was_never_stepped():
    params = [_param(n, v, g, g, kept=n == "2.weight") for n, (v, g) in _model().items()]
    (cause,) = local_causes(_evidence(params))
    assert cause.kind is CauseKind.NEVER_STEPPED
    assert cause.evidence.startswith("2.weight kept its value through step 1 while the reference")


# -- a low-precision reduction ------------------------------------------------------------------


def _rounded(dtype: torch.dtype, *, reference_rounded: bool = False) -> tuple[Cause, ...]:
    params = []
    for name, (value, grad) in _model().items():
        ref = (
            grad.to(dtype).float() + grad * 1e-3
            if not reference_rounded
            else grad.to(dtype).float()
        )
        applied = ref.to(dtype).float()
        params.append(_param(name, value, ref, applied))
    return local_causes(_evidence(params))


@pytest.mark.parametrize(("dtype", "label"), [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_gradients_on_a_low_precision_grid_are_a_reduction_in_it(dtype, label):
    (cause,) = _rounded(dtype)
    assert cause.kind is CauseKind.LOW_PRECISION_REDUCTION
    assert f"lie on the {label} grid (100% of" in cause.evidence
    assert cause.conclusion.startswith(f"a reduction in {label}")


def test_no_low_precision_cause_where_the_reference_is_on_that_grid_too():
    """Mixed precision that reduces in bf16 on both sides: bf16-scale differences are the
    rounding both do, not a bug."""
    assert _rounded(torch.bfloat16, reference_rounded=True) == ()


# -- wrong slices, initial weights --------------------------------------------------------------


def _initial(model, actual_of) -> tuple[InitialPair, ...]:
    return tuple(InitialPair(n, v, actual_of(n, v)) for n, (v, _) in model.items())


def test_blocks_of_the_initial_weights_in_another_order_are_a_wrong_shard_slice():
    model = _model()

    def swapped(name: str, value: torch.Tensor) -> torch.Tensor:
        return torch.cat(value.chunk(2)[::-1]) if name == "0.weight" else value

    params = [_param(n, v, g, g) for n, (v, g) in model.items()]
    (cause,) = local_causes(_evidence(params, initial=_initial(model, swapped)))
    assert cause.kind is CauseKind.WRONG_SHARD_SLICE
    assert cause.evidence == (
        "before step 1, rank 0's shard of 0.weight (rows 0-15) equals the reference's rows "
        "16-31; rank 1's (rows 16-31) equals rows 0-15"
    )


def test_a_permutation_of_columns_is_found_along_dim_1():
    model = _model()

    def swapped(name: str, value: torch.Tensor) -> torch.Tensor:
        return torch.cat(value.chunk(4, dim=1)[::-1], dim=1) if name == "2.weight" else value

    params = [_param(n, v, g, g) for n, (v, g) in model.items()]
    (cause,) = local_causes(_evidence(params, world=4, initial=_initial(model, swapped)))
    assert cause.kind is CauseKind.WRONG_SHARD_SLICE
    assert "rank 0's shard of 2.weight (columns 0-7) equals the reference's columns 24-31" in str(
        cause
    )


def test_equal_blocks_give_no_order_to_read():
    """Zero biases: any permutation of equal blocks is the same tensor; a shifted copy is not
    a permutation. Neither is called a wrong slice."""
    zeros = torch.zeros(8)
    initial = (InitialPair("b", zeros, zeros + 1.0),)
    params = [_param("b", zeros, torch.ones(8), torch.ones(8))]
    (cause,) = local_causes(_evidence(params, initial=initial))
    assert cause.kind is CauseKind.INITIAL_STATE_DIFFERS
    assert (
        cause.evidence
        == "before step 1, b already differed from the reference (max abs diff 1.000e+00)"
    )


def test_initial_weights_off_by_rounding_name_no_cause():
    model = _model()
    params = [_param(n, v, g, g) for n, (v, g) in model.items()]
    initial = _initial(model, lambda n, v: v * (1 + torch.finfo(torch.float32).eps))
    assert local_causes(_evidence(params, initial=initial)) == ()


# -- across ranks -------------------------------------------------------------------------------

ORDER = ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")


def _facts(rank: int, gross: tuple[str, ...] = (), **kw) -> RankFacts:
    return RankFacts(
        rank=rank, diverged=bool(gross) or kw.pop("diverged", False), gross=gross, order=ORDER, **kw
    )


def test_only_the_parameters_before_one_layer_diverging_is_a_backward_that_stops_there():
    facts = [_facts(r, ("0.weight", "0.bias")) for r in range(2)]
    (cause,) = cross_rank_causes(facts)
    assert cause.kind is CauseKind.BACKWARD_STOPS
    assert str(cause).startswith(
        "only the 2 parameters before 2.weight diverge (0.weight, 0.bias); 2.weight and the 3 "
        "after it match: the gradient reaching them is wrong"
    )
    kept = [_facts(r, ("0.weight", "0.bias"), kept=("0.weight", "0.bias")) for r in range(2)]
    (cause,) = cross_rank_causes(kept)
    assert "and none of them moved" in cause.evidence
    assert cause.conclusion.startswith("no gradient reached them")


def test_a_prefix_that_splits_a_layer_or_covers_everything_is_not_a_layer_boundary():
    assert cross_rank_causes([_facts(r, ("0.weight",)) for r in range(2)]) == ()
    assert cross_rank_causes([_facts(r, ORDER) for r in range(2)]) == ()
    assert cross_rank_causes([_facts(r, ("2.weight", "2.bias")) for r in range(2)]) == ()


def test_some_ranks_diverging_while_others_match_is_a_result_that_reached_only_some():
    facts = [_facts(0), _facts(1, ("0.weight",)), _facts(2), _facts(3, ("0.weight",))]
    (cause,) = cross_rank_causes(facts)
    assert cause.kind is CauseKind.SOME_RANKS_ONLY
    assert cause.evidence == "only ranks 1, 3 diverge (0.weight); ranks 0, 2 match the reference"
    # A rank that diverged only at rounding level (not grossly) does not "match".
    blurred = [_facts(0, diverged=True), _facts(1, ("0.weight",))]
    assert cross_rank_causes(blurred) == ()


def test_ranks_apart_before_step_1_need_the_reference_to_agree_across_ranks():
    values = {"4.bias": [torch.zeros(4), torch.full((4,), 0.5)]}
    (cause,) = cross_rank_causes([_facts(r) for r in range(2)], initial=values)
    assert cause.kind is CauseKind.RANKS_STARTED_APART
    assert "rank 1's differs from rank 0's by up to 5.000e-01" in cause.evidence
    same = {"4.bias": [torch.zeros(4), torch.zeros(4)]}
    assert cross_rank_causes([_facts(r) for r in range(2)], initial=same) == ()


def _per_rank(reference: torch.Tensor, ranks: list[torch.Tensor]) -> dict[str, list[Gradients]]:
    zero = torch.zeros(reference.numel(), dtype=torch.float64)
    return {"0.weight": [Gradients(reference.double(), r.double(), zero) for r in ranks]}


@pytest.mark.parametrize(("how", "combine"), [("average", 0.5), ("sum", 1.0)])
def test_rank_gradients_that_average_or_sum_to_the_reference_were_not_all_reduced(how, combine):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    grads = _per_rank(combine * (a + b), [a, b])
    facts = [_facts(r, ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight")) for r in range(2)]
    (cause,) = cross_rank_causes(facts, gradients=grads)
    assert cause.kind is CauseKind.GRADIENTS_NOT_REDUCED
    assert f"differ from each other but {how} to the reference's" in cause.evidence
    # Ranks that agree were reduced, whatever else is wrong.
    assert cross_rank_causes(facts, gradients=_per_rank(a, [2 * a, 2 * a])) == ()


def test_the_merged_list_is_the_same_for_every_rank_in_kind_order():
    summed = Cause(CauseKind.GRADIENTS_SUMMED, "every gradient is 2.000x", "summed")
    kept = Cause(CauseKind.NEVER_STEPPED, "0.bias kept its value", "never stepped")
    facts = [
        _facts(0, ("0.bias",), local=(summed,)),
        _facts(1, ("0.bias",), local=(summed, kept)),
    ]
    causes = merge_causes((), facts)
    assert [c.kind for c in causes] == [CauseKind.NEVER_STEPPED, CauseKind.GRADIENTS_SUMMED]
    assert causes[0].evidence == "on rank 1: 0.bias kept its value"  # not on every rank
    assert causes[1] == summed
    apart = Cause(CauseKind.RANKS_STARTED_APART, "ranks differ", "apart")
    init = Cause(CauseKind.INITIAL_STATE_DIFFERS, "differed", "init")
    assert merge_causes((apart,), [_facts(0, local=(init,))]) == (apart,)


def test_the_report_section_says_when_no_cause_is_clear():
    assert format_causes(()).startswith("likely cause: none that the numbers make clear")
    one = Cause(CauseKind.GRADIENTS_SUMMED, "every gradient is 2.000x", "gradients summed")
    assert format_causes([one]) == "likely cause:\n  every gradient is 2.000x: gradients summed"
    assert format_causes([one, one]).startswith("likely causes, first the strongest:\n  ")


# -- local shards (check_sharded_parity) --------------------------------------------------------


def test_a_local_shard_equal_to_another_ranks_rows_names_both_row_ranges():
    full = torch.arange(32.0).view(8, 4)
    (cause,) = shard_causes([("w", full, full[0:4], 0)], [], rank=1, world_size=2)
    assert cause.kind is CauseKind.WRONG_SHARD_SLICE
    assert (
        cause.evidence == "rank 1's shard of w equals the reference's rows 0-3, expected rows 4-7"
    )


def test_local_gradient_shards_twice_the_expected_are_a_sum():
    g = torch.Generator().manual_seed(5)
    grads = [(f"p{i}", e, 2 * e) for i, e in enumerate(torch.randn(3, 10, generator=g))]
    (cause,) = shard_causes([], grads, rank=0, world_size=2)
    assert cause.kind is CauseKind.GRADIENTS_SUMMED


def test_without_sgd_the_structural_causes_remain():
    """An Adam reference: no gradient is inferred, gross divergence is read from the values,
    and a parameter left alone is still named."""
    params = [
        ParamStep(**{**_param(n, v, g, g, kept=n == "0.bias").__dict__, "sgd": None})
        for n, (v, g) in _model().items()
    ]
    assert all(p.gradients() is None for p in params)
    (cause,) = local_causes(_evidence(params))
    assert cause.kind is CauseKind.NEVER_STEPPED
    assert cause.evidence.startswith("0.bias kept its value")
