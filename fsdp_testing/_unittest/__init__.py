"""What the unittest classes (``fsdp_testing.testcase``) build on: torch's tensor-aware
``assertEqual`` (``assertions``) and the world sizes a torch-style test gets on this machine,
with the running test's world (``world``, no torch import). The torch mirror (``_compat``)
builds on ``testcase`` in turn, never the other way round."""
