"""The waiting rules every launcher shares (``fsdp_testing/_launch/deadline.py``)."""

from __future__ import annotations

from fsdp_testing._launch.deadline import PG_TIMEOUT_MARGIN_S, pg_timeout_for


def test_gloo_waits_longer_than_the_test_so_a_hang_is_reported_as_one() -> None:
    # At the default 120 s, a group timing out at 120 s raised on the ranks as their stacks
    # were taken: the report showed pytest formatting their errors, not where they hung.
    for timeout in (1.0, 30.0, 120.0, 900.0):
        assert pg_timeout_for(timeout) >= timeout + PG_TIMEOUT_MARGIN_S >= timeout + 10


def test_short_tests_share_one_group_timeout() -> None:
    # A warm generation serves a test whose group timeout it meets: short timeouts must not
    # each need a generation of their own.
    assert pg_timeout_for(2.0) == pg_timeout_for(5.0) == pg_timeout_for(20.0)
