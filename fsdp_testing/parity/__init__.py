"""Parity checks: a sharded model against a data parallel reference, sharded parameters against
replicated ones, and module states across ranks.

One trainer serves every parity check: :class:`Lockstep` (two :class:`TrainingLoop` s, compared
after every step under one :class:`ParityRule`) is what :func:`check_fsdp_parity` (torch's
``_test_fsdp_parity``), ``fsdp-testing check`` and the core's own tests train with. The rule for
mixed precision is [Note: mixed precision parity] (``_reference``), the tolerances [Note: parity
rule] (``_compare``); ``docs/parity.md`` has both.

The same trainer checks a user's own code with no engine adapter: :func:`check_parity` takes a
model factory, the user's wrapping (or step) function and a batch function, with a DDP or
single-process reference ([Note: the user's reference]).

A failure of any of them (and of :func:`check_sharded_parity` and ``fsdp-testing check``) adds
the likely causes its numbers support, each a :class:`Cause` with one line of evidence, or says
that none is clear ([Note: likely causes]).

The package, by role: ``_training`` (the training loop), ``_reference`` (the data parallel and
mixed precision references), ``_lockstep`` (the lockstep trainer and ``check_fsdp_parity``),
``_user`` (``check_parity``, for a user's own code, and its trainer ``UserLockstep``, which
``fsdp-testing check --parallelize`` steps too),
``_compare`` (divergences and the rule), ``_causes`` (the likely causes of a divergence: pure
analysis of typed evidence), ``_explain`` (what a lockstep keeps for them and the exchange
between ranks on a failure, [Note: keeping the evidence]), ``_resume`` (a DCP checkpoint
resumed at another world size, [Note: resuming at another world size]), ``_sharded`` (sharded
parameters, cross-rank states, full parameters) and ``_mixin`` (torch's methods for
unittest-style test cases).
"""

from ._causes import Cause, CauseKind, format_causes
from ._compare import (
    FP32_TOLERANCE,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    Divergence,
    ParityRule,
    Tolerance,
    compare_named,
    format_divergences,
)
from ._lockstep import (
    Lockstep,
    StepReport,
    _test_fsdp_parity,
    check_fsdp_parity,
    raise_on_divergence,
)
from ._mesh import layout_from_plan
from ._mixin import FSDPParityMixin
from ._reference import MixedPrecisionReference, find_test_model, reference_body
from ._resume import ResumeReport, check_resume_parity
from ._sharded import (
    _assert_module_states,
    assert_module_states_equal,
    check_sharded_parity,
    get_full_params,
)
from ._training import TrainingLoop, Workload, train_for_several_steps
from ._user import REFERENCES, check_parity, mean_square_loss

_train_for_several_steps = train_for_several_steps

__all__ = [
    "FP32_TOLERANCE",
    "LOSS_TOLERANCE",
    "PARAM_TOLERANCE",
    "REFERENCES",
    "Cause",
    "CauseKind",
    "Divergence",
    "FSDPParityMixin",
    "Lockstep",
    "MixedPrecisionReference",
    "ParityRule",
    "ResumeReport",
    "StepReport",
    "Tolerance",
    "TrainingLoop",
    "Workload",
    "_assert_module_states",
    "_test_fsdp_parity",
    "_train_for_several_steps",
    "assert_module_states_equal",
    "check_fsdp_parity",
    "check_parity",
    "check_resume_parity",
    "check_sharded_parity",
    "compare_named",
    "find_test_model",
    "format_causes",
    "format_divergences",
    "get_full_params",
    "layout_from_plan",
    "mean_square_loss",
    "raise_on_divergence",
    "reference_body",
    "train_for_several_steps",
]
