"""fsdp_testing: a pytest plugin and distributed test harness for sharded-training code."""

__all__: list[str] = []
