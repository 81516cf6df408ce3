"""The recorder's one-line assertions: each fails with ``[rank N]``, what was expected, what was
recorded and the records that matter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from ..engines import FSDPEngine
from ..patching import rank_prefix
from ._probes import UnitNames
from ._records import OffloadRecord, Record, RecordLog, ReshardRecord, UnshardRecord

__all__ = ["RecordAssertions"]


class RecordAssertions(RecordLog):
    """``assert_*`` over the records of :class:`RecordLog`; the subclass sets ``engine`` (the
    recorded engine) and ``_names`` (the recorded model's FQNs)."""

    engine: FSDPEngine
    _names: UnitNames

    def _fail(self, message: str) -> AssertionError:
        return AssertionError(f"{rank_prefix(self.rank)}{message}")

    def _names_of(self, expected: Sequence[str | nn.Module]) -> list[str]:
        return [e if isinstance(e, str) else self._names.module(e) for e in expected]

    def assert_count(
        self,
        op: str,
        expected: int,
        *,
        step: int | None = None,
        unit: str | None = None,
        phase: str | None = None,
        mesh_dim: str | None = None,
    ) -> None:
        """Asserts that ``op`` ran ``expected`` times (see :meth:`count`), optionally in one
        ``phase`` (forward, backward, optimizer, outside) or over one ``mesh_dim``."""
        actual = self.count(op, step=step, unit=unit, phase=phase, mesh_dim=mesh_dim)
        if actual != expected:
            seen = Counter(
                r.op for r in self.collectives(step=step, unit=unit, phase=phase, mesh_dim=mesh_dim)
            )
            where = _where(step, unit)
            if phase is not None:
                where += f" in the {phase} phase"
            if mesh_dim is not None:
                where += f" over mesh dim {mesh_dim!r}"
            raise self._fail(
                f"expected {expected} {op} collective(s){where}, recorded {actual}; all "
                f"collectives{where}: {dict(seen) or 'none'}"
            )

    def assert_p2p_order(
        self, expected: Sequence[tuple[str, int | None]], *, step: int | None = None
    ) -> None:
        """Asserts this rank's point-to-point ops, in the order issued, as ``(kind, peer)``
        pairs: ``[("recv", 0), ("send", 2)]`` (see :meth:`p2p_order`)."""
        actual = self.p2p_order(step=step)
        want = [(kind, peer) for kind, peer in expected]
        if actual != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(actual, want, strict=False)) if a != b),
                min(len(actual), len(want)),
            )
            raise self._fail(
                f"expected point-to-point ops{_where(step, None)} {want}, recorded {actual}; "
                f"they differ from op {first + 1} on"
            )

    def assert_p2p_bytes(
        self, expected: dict[tuple[str, int | None], int], *, step: int | None = None
    ) -> None:
        """Asserts the bytes this rank sent to and received from each peer:
        ``{("send", 1): 4096, ("recv", 1): 4096}`` (see :meth:`p2p_bytes`)."""
        actual = self.p2p_bytes(step=step)
        if actual != dict(expected):
            wrong = {
                key: (expected.get(key, 0), actual.get(key, 0))
                for key in sorted({*actual, *expected}, key=str)
                if expected.get(key, 0) != actual.get(key, 0)
            }
            detail = "; ".join(
                f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}: expected {want}, "
                f"recorded {have}"
                for (kind, peer), (want, have) in wrong.items()
            )
            raise self._fail(f"point-to-point bytes{_where(step, None)} differ: {detail}")

    def assert_unshard_order(
        self,
        expected: Sequence[str | nn.Module],
        *,
        reason: str | Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts the order in which units were unsharded (for ``reason``, in ``step``)."""
        want = self._names_of(expected)
        actual = self.unshard_order(reason, step=step)
        if actual != want:
            described = reason if isinstance(reason, str | None) else sorted(reason)
            raise self._fail(
                f"expected units unsharded (reason {described or 'any'}"
                f"{_where(step, None)}) in the order {want}, recorded {actual}; every unshard: "
                f"{_describe(self.unshards(step=step))}"
            )

    def assert_prefetch_order(
        self,
        expected: Sequence[str | nn.Module],
        *,
        direction: str = "backward",
        step: int | None = None,
    ) -> None:
        """Asserts which units were prefetched, in order.

        Args:
            expected: unit FQNs (or modules of the recorded model) in prefetch order.
            direction: ``"backward"`` (default) or ``"forward"`` prefetch.
            step: only this step (default: all recorded).
        """
        if direction not in ("forward", "backward"):
            raise ValueError(
                f"assert_prefetch_order: direction={direction!r}; use 'forward' or 'backward'"
            )
        self.assert_unshard_order(expected, reason=f"{direction}_prefetch", step=step)

    def assert_graph_order(self, model: nn.Module, expected_modules: Sequence[nn.Module]) -> None:
        """Asserts the forward (graph) order of the sharded modules of ``model``.

        Where the engine keeps it (``fsdp_core``: ``_fsdp_graph_order`` and
        ``_my_fsdp_idx_in_graph`` on every instance) that order is checked, on every instance;
        otherwise the order recorded by forward hooks (``record_fsdp(model)``). Modules may be
        the sharded instances or the modules they wrap.

        Args:
            model: the root module.
            expected_modules: the modules in the expected order.
        """
        if not self._names:
            self._names.add_model(model)
        want = self._names_of(expected_modules)
        instances = [m for m in model.modules() if self.engine.is_wrapped(m)]
        engine_order = getattr(instances[0], "_fsdp_graph_order", None) if instances else None
        if engine_order is not None:
            actual = [self._names.module(m) for m in engine_order]
            source = "the engine's _fsdp_graph_order"
            for instance in instances:
                index = getattr(instance, "_my_fsdp_idx_in_graph", None)
                mine = getattr(instance, "_fsdp_graph_order", None)
                if mine is not engine_order and mine != engine_order:
                    raise self._fail(
                        f"FSDP instance {self._names.module(instance)!r} has a different "
                        f"_fsdp_graph_order ({[self._names.module(m) for m in mine or []]}) "
                        f"than the root ({actual})"
                    )
                if index is None or not 0 <= index < len(engine_order):
                    raise self._fail(
                        f"FSDP instance {self._names.module(instance)!r} has "
                        f"_my_fsdp_idx_in_graph={index!r}, not an index into the graph order"
                    )
                if engine_order[index] is not instance:
                    raise self._fail(
                        f"FSDP instance {self._names.module(instance)!r} has "
                        f"_my_fsdp_idx_in_graph={index}, but position {index} of the graph order "
                        f"is {actual[index]!r}"
                    )
        else:
            actual = self.graph_order()
            source = "the recorded forwards"
            if not actual:
                raise self._fail(
                    f"engine {self.engine.name!r} keeps no graph order and no forward was "
                    "recorded; record the first forward with record_fsdp(model)"
                )
        if actual != want:
            raise self._fail(f"expected graph order {want}; according to {source} it is {actual}")

    def assert_resharded(
        self,
        *,
        after: str = "forward",
        units: Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts that every unit unsharded in a pass was resharded after that pass.

        Args:
            after: ``"forward"``: each unit unsharded for forward (or forward prefetch) has a
                later reshard with reason ``"forward"`` in the same step; the root (``""``) is
                exempt by default, as every engine keeps it for backward. ``"backward"``: each
                unit unsharded in a step has a later reshard with reason ``"backward"``.
            units: the units to check (default: every unit unsharded in that pass).
            step: only this step (default: every recorded step).
        """
        if after not in ("forward", "backward"):
            raise ValueError(f"assert_resharded: after={after!r}; use 'forward' or 'backward'")
        reasons = ("forward", "forward_prefetch") if after == "forward" else None
        wanted = set(units) if units is not None else None
        checked = 0
        problems = []
        for unshard in self.unshards(reasons, step=step):
            if wanted is None and after == "forward" and unshard.unit == "":
                continue
            if wanted is not None and unshard.unit not in wanted:
                continue
            checked += 1
            later = [
                r
                for r in self.reshards(after, step=unshard.step)
                if r.unit == unshard.unit and r.seq > unshard.seq
            ]
            if not later:
                problems.append(
                    f"unit {unshard.unit!r} unsharded for {unshard.reason} in step "
                    f"{unshard.step} was never resharded after {after}"
                )
        if checked == 0:
            raise self._fail(f"assert_resharded(after={after!r}): no matching unshard was recorded")
        if problems:
            reshards = _describe(self.reshards(step=step))
            raise self._fail("; ".join(dict.fromkeys(problems)) + f" (reshards: {reshards})")

    def assert_params_on(
        self,
        device: str | torch.device,
        *,
        when: str = "resharded",
        units: Iterable[str] | None = None,
        step: int | None = None,
    ) -> None:
        """Asserts where the parameters were at every recorded transition.

        Args:
            device: e.g. ``"cpu"``; a device without an index matches any index.
            when: ``"resharded"`` (the sharded parameters after each reshard, default) or
                ``"unsharded"`` (the full parameters after each unshard).
            units: only these units (default: all).
            step: only this step (default: all).
        """
        if when not in ("resharded", "unsharded"):
            raise ValueError(f"assert_params_on: when={when!r}; use 'resharded' or 'unsharded'")
        want = torch.device(device)
        records: list[UnshardRecord] = (
            list(self.reshards(step=step)) if when == "resharded" else self.unshards(step=step)
        )
        if units is not None:
            chosen = set(units)
            records = [r for r in records if r.unit in chosen]
        if not records:
            raise self._fail(f"assert_params_on: no unit was {when}{_where(step, None)}")
        wrong = [r for r in records if not all(_same_device(d, want) for d in r.devices)]
        if wrong:
            listed = ", ".join(
                f"{r.unit!r} ({r.reason}, step {r.step}): {list(r.devices)}" for r in wrong[:5]
            )
            raise self._fail(
                f"expected parameters on {want} when {when}, but {len(wrong)} of "
                f"{len(records)} transitions left them elsewhere: {listed}"
            )

    def assert_offloaded(
        self, *, units: Iterable[str] | None = None, step: int | None = None
    ) -> None:
        """Asserts CPU offload: after every reshard the sharded parameters are on the CPU, the
        engine reports offloading for the unit (torch engines), and (``fsdp_core`` with offload
        events) every unshard was preceded by a copy to the device since the unit's last
        reshard.

        Args:
            units: only these units (default: all).
            step: only this step (default: all).
        """
        self.assert_params_on("cpu", when="resharded", units=units, step=step)
        chosen = set(units) if units is not None else None
        transitions = [
            r for r in self.select(UnshardRecord, step=step) if chosen is None or r.unit in chosen
        ]
        not_offloaded = sorted({r.unit for r in transitions if r.offload is False})
        if not_offloaded:
            raise self._fail(
                f"units {not_offloaded} are not offloaded: the engine keeps their sharded "
                "parameters on the compute device (no CPU offload policy)"
            )
        if not self.engine.probe().reports_offload_copies:
            return
        copied: set[str] = set()
        missing = []
        for record in self.select(Record, step=step):
            if isinstance(record, OffloadRecord) and record.direction == "to_device":
                copied.add(record.unit)
            elif isinstance(record, ReshardRecord):
                copied.discard(record.unit)
            elif isinstance(record, UnshardRecord) and (chosen is None or record.unit in chosen):
                if record.unit not in copied:
                    missing.append(f"{record.unit!r} ({record.reason}, step {record.step})")
        if missing:
            raise self._fail(
                f"unshards with no copy of the CPU shard to the device before them: {missing}"
            )


def _where(step: int | None, unit: str | None) -> str:
    parts = ([f"step {step}"] if step is not None else []) + (
        [f"unit {unit!r}"] if unit is not None else []
    )
    return f" in {', '.join(parts)}" if parts else ""


def _describe(records: Sequence[UnshardRecord]) -> str:
    return ", ".join(f"{r.unit!r}:{r.reason}" for r in records) or "none"


def _same_device(actual: str, want: torch.device) -> bool:
    have = torch.device(actual)
    return have.type == want.type and (want.index is None or have.index == want.index)
