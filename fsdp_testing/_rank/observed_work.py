"""The work a process group returns, as the rank's code receives it when calls are observed: the
group's own work, forwarded, that tells the rank's collective log when the rank waits on it and
when it completed (see [Note: observing without replacing] in ``comm_observer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["observed_work"]


def _work_class() -> type:
    import torch.distributed as dist

    class ObservedWork(dist.Work):
        """A process group's work, forwarded (a ``dist.Work``, as torch's callers check)."""

        def __init__(self, work: Any, report: Callable[[str], None]) -> None:
            super().__init__()
            self._work = work
            self._report = report
            self._done = False

        def wait(self, *args: Any, **kwargs: Any) -> Any:
            if not self._done:
                self._report("waiting")
            try:
                out = self._work.wait(*args, **kwargs)
            except BaseException:
                self._finish("raised")
                raise
            self._finish("completed")
            return out

        def _finish(self, state: str) -> None:
            if not self._done:
                self._done = True
                self._report(state)

        def is_completed(self) -> bool:
            return bool(self._work.is_completed())

        def is_success(self) -> bool:
            return bool(self._work.is_success())

        def exception(self) -> Any:
            return self._work.exception()

        def source_rank(self) -> int:
            return int(self._work.source_rank())

        def _source_rank(self) -> int:
            return int(self._work._source_rank())

        def result(self) -> list[Any]:
            return list(self._work.result())

        def synchronize(self) -> None:
            self._work.synchronize()

        def get_future(self) -> Any:
            return self._work.get_future()

        def get_future_result(self) -> Any:
            return self._work.get_future_result()

        def block_current_stream(self) -> None:
            self._work.block_current_stream()

        def boxed(self) -> Any:
            return self._work.boxed()

        def _get_op_type(self) -> Any:
            return self._work._get_op_type()

        def _get_duration(self) -> float:
            return float(self._work._get_duration())

        def __getattr__(self, name: str) -> Any:
            return getattr(self.__dict__["_work"], name)

        def __repr__(self) -> str:
            return repr(self._work)

    return ObservedWork


_cls: type | None = None


def observed_work(work: Any, report: Callable[[str], None]) -> Any:
    """``work`` as the rank's code receives it; ``report(state)`` is told when the rank waits on
    it (``"waiting"``) and how it ended (``"completed"``, ``"raised"``)."""
    global _cls
    if _cls is None:
        _cls = _work_class()
    return _cls(work, report)
