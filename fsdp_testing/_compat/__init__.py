"""torch-compatibility layer behind the drop-in modules ``fsdp_testing.common_distributed``,
``fsdp_testing.common_fsdp``, ``fsdp_testing.common_dtensor`` and ``fsdp_testing.common_utils``.

One module per job: ``env`` (torch's environment flags and device constants), ``parametrize``
(``parametrize``/``subtest`` and the ``common_utils`` decorators), ``gates`` (torch 2.15's
hardware and CI gates of ``common_utils``), ``requirements`` (the ``requires_*``/``skip_if_*``
decorators of ``common_distributed``), ``dist_helpers`` (its remaining helpers), ``classes``
(the extra test-case classes), ``fsdp`` (``common_fsdp``'s classes and helpers), ``leaks``
(``common_utils.check_leaked_tensors``), ``dtensor`` (``common_dtensor``'s test classes,
``with_comms`` and device constants), ``dtensor_local`` (its ``LocalTensorMode`` classes),
``dtensor_helpers`` (its converter, per-rank and shard-order helpers) and ``dtensor_rules`` (its
sharding-rule checks; its models are in ``fsdp_testing/models/tensor_parallel.py`` and
``experts.py``). The mirror modules only re-export. Where torch releases differ, the installed
one decides (``env.TORCH_RELEASE``); docs/migration.md and docs/compatibility.md describe what
differs from torch.
The world sizes (``fsdp_testing._unittest.world``) and torch's tensor-aware ``assertEqual``
(``fsdp_testing._unittest.assertions``) live beside ``testcase``, which builds on them: this package
builds on ``testcase`` and never the other way round.
"""
