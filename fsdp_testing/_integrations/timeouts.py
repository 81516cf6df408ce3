"""One timeout story with pytest-timeout and pytest's ``faulthandler_timeout``.

[Note: outer timeouts]
pytest-timeout (``--timeout``, the ``timeout`` ini key, ``PYTEST_TIMEOUT``,
``@pytest.mark.timeout``) fails a test, or ends the whole session (its thread method), when the
test outlives its limit, with the stack of the pytest process: for a distributed test that is
the parent waiting on its ranks, which says nothing about the rank that hung.
``faulthandler_timeout`` dumps the same stacks (and, with ``faulthandler_exit_on_timeout``,
ends the session). So, for a distributed test under either:

- the harness's deadline for the ranks is the tighter of its own timeout (the marker's,
  ``--dist-timeout``, 120 s) and what is left of the outer limit when the ranks get the test,
  less a reserve for the report and the teardown (:func:`reserve_for`): the harness's hang
  report, with every rank's stack and the collective divergence, is what the user sees;
- while the harness runs the ranks (from the moment it sends the test until it has judged it,
  starting new ranks included), the outer timers are pushed back by ``HARNESS_GRACE_S``
  (:meth:`TimeoutBridge.before_harness`); they stay armed, as a safety net for a fault of the
  harness itself, and are set again to what is left of the test's limit as soon as the harness
  is done (:meth:`TimeoutBridge.after_harness`), so a fixture that hangs in setup or teardown is
  still caught by them at their usual time.

Starting ranks (a first test, the test after a failure) does not count against the ranks'
deadline, as without pytest-timeout; a test may then end a few seconds after the outer limit,
with the harness's report.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

__all__ = ["HARNESS_GRACE_S", "PLUGIN_NAME", "TimeoutBridge", "reserve_for"]

PLUGIN_NAME = "fsdp_testing_timeouts"
HARNESS_GRACE_S = 90.0
"""How far the outer timers are pushed back while the harness runs: the longest it may spend
beyond its own deadline (starting ranks: at most 60 s; dumping and stopping stragglers)."""
_RESUME_FLOOR_S = 2.0
"""The least time an outer timer gets when it is set again after the harness."""


def reserve_for(limit: float) -> float:
    """Seconds of an outer limit kept for the report and teardown: a tenth, 1 to 10 s."""
    return min(10.0, max(1.0, 0.1 * limit))


@dataclasses.dataclass
class _Outer:
    """One outer timer of the running test."""

    limit: float
    """Its timeout, seconds."""
    end: float
    """``time.monotonic()`` when it fires (unless pushed back)."""
    settings: Any = None
    """pytest-timeout's settings for the test (None: the faulthandler timer)."""


_timers_key = pytest.StashKey[dict[str, _Outer]]()
_suspended_key = pytest.StashKey[bool]()


class TimeoutBridge:
    """Registered as a plugin when pytest-timeout is active or ``faulthandler_timeout`` is set."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._rearming = False
        self._faulthandler = float(config.getini("faulthandler_timeout") or 0.0)

    # --- recording the outer timers ---------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        # faulthandler's timer starts just inside this wrapper (its own wrapper is trylast).
        timers = item.stash[_timers_key] = {}
        if self._faulthandler > 0:
            timers["faulthandler"] = _Outer(
                self._faulthandler, time.monotonic() + self._faulthandler
            )
        try:
            return (yield)
        finally:
            item.stash[_timers_key] = {}

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings: Any) -> bool | None:
        if self._rearming:
            return None  # pytest-timeout's own implementation arms it
        timers = item.stash.setdefault(_timers_key, {})
        timers["pytest-timeout"] = _Outer(
            float(settings.timeout), time.monotonic() + settings.timeout, settings
        )
        if item.stash.get(_suspended_key, False):  # set in the call while the ranks run
            self._arm_pytest_timeout(item, settings, settings.timeout + HARNESS_GRACE_S)
            return True
        return None

    # --- the harness's window -----------------------------------------------------------------

    @staticmethod
    def func_only_pending(item: pytest.Item) -> bool:
        """Whether pytest-timeout will time only the call of ``item`` (``func_only``): its limit
        is not known before the call, so nothing may be sent to the ranks in setup."""
        try:
            from pytest_timeout import _get_item_settings

            settings = _get_item_settings(item)
        except Exception:  # another version: be safe
            return True
        return bool(settings.timeout and settings.func_only)

    def limit(self, item: pytest.Item) -> tuple[float, str] | None:
        """The seconds the ranks of ``item`` may run from now under the outer timers, and why
        (for the report); None when no outer timer runs."""
        now = time.monotonic()
        best: tuple[float, str] | None = None
        for name, outer in item.stash.get(_timers_key, {}).items():
            seconds = max(0.1, round(outer.end - now - reserve_for(outer.limit), 1))
            if best is None or seconds < best[0]:
                what = "pytest-timeout's" if name == "pytest-timeout" else "faulthandler_timeout's"
                best = (
                    seconds,
                    f"{what} {outer.limit:g} s for this test, less "
                    f"{reserve_for(outer.limit):g} s kept for the report and teardown",
                )
        return best

    def before_harness(self, item: pytest.Item) -> None:
        """The ranks are about to get ``item``: push the outer timers back."""
        item.stash[_suspended_key] = True
        self._rearm(item, extra=HARNESS_GRACE_S)

    def after_harness(self, item: pytest.Item) -> None:
        """The harness has judged ``item``: the outer timers get what is left of its limit."""
        if item.stash.get(_suspended_key, False):
            item.stash[_suspended_key] = False
            self._rearm(item, extra=0.0)

    def _rearm(self, item: pytest.Item, *, extra: float) -> None:
        now = time.monotonic()
        for name, outer in item.stash.get(_timers_key, {}).items():
            seconds = max(outer.end - now, _RESUME_FLOOR_S) + extra
            if name == "faulthandler":
                _arm_faulthandler(self._config, seconds)
            else:
                self._arm_pytest_timeout(item, outer.settings, seconds)

    def _arm_pytest_timeout(self, item: pytest.Item, settings: Any, seconds: float) -> None:
        hook = item.config.hook
        hook.pytest_timeout_cancel_timer(item=item)
        self._rearming = True
        try:
            hook.pytest_timeout_set_timer(item=item, settings=settings._replace(timeout=seconds))
        finally:
            self._rearming = False


def _arm_faulthandler(config: pytest.Config, seconds: float) -> None:
    import faulthandler

    try:  # where pytest's faulthandler plugin dumps (pytest's private stash key)
        from _pytest.faulthandler import (
            fault_handler_stderr_fd_key,
            get_exit_on_timeout_config_value,
        )

        fd = config.stash[fault_handler_stderr_fd_key]
        exit_on_timeout = get_exit_on_timeout_config_value(config)
    except (ImportError, KeyError):  # another pytest: leave its timer alone
        return
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(seconds, file=fd, exit=exit_on_timeout)


def install(config: pytest.Config) -> TimeoutBridge | None:
    """Register the bridge when an outer timer can run (pytest-timeout is active or
    ``faulthandler_timeout`` is set); None otherwise."""
    has_timeout = config.pluginmanager.hasplugin("timeout")
    if not has_timeout and not float(config.getini("faulthandler_timeout") or 0.0) > 0:
        return None
    bridge = TimeoutBridge(config)
    config.pluginmanager.register(bridge, PLUGIN_NAME)
    return bridge
