"""The rule engine: evaluates every enabled rule on one node's view after each of its reports.

``RuleEngine(rules).evaluate(view)`` returns the node's rule findings that are active after this
report. The engine keeps a little state per node, and only what the view cannot give it:

- ``for:`` timers, per (rule, subject): a condition has to hold on every report for that long
  before it becomes a finding; a report where it does not hold (or cannot be told) restarts it;
- findings that clear on reboot (an XID 79), which stay active until the node reports a new
  ``boot_id`` whatever later reports say;
- the GPUs seen in the current boot (a GPU that disappears is a finding);
- recent matching events of ``repeat`` rules (the same application XID on the same GPU again).

A reboot drops the timers, the latched findings and the GPUs seen; repeat history survives it,
because a GPU that keeps faulting across jobs keeps doing so across reboots.

Rules are compiled once into closures over their constants, grouped by what they read (events,
GPUs, NVLinks, NICs), so a report costs one pass over its GPUs and NICs with no parsing or name
lookups beyond ``getattr`` on the report's structs.

A rate rule's value is the counter's increase over its window divided by the window (history
shorter than the window, right after a boot, counts as no events). Rates are the costly part of a
report, so the view is not asked for them when it cannot matter: for a rule that fires on a high
rate, if nothing it reads moved since the previous report and it was under its threshold then,
it still is (a sliding window's increase can only shrink while the counter stands still). That
needs the previous report to be the one this engine evaluated last for the node; otherwise (the
first report, an engine restarted mid-boot) every rate is asked for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import types
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final

from msgspec import UNSET

from agent.report import (
    NIC_COUNTER_CATALOGUE,
    CollectorError,
    Event,
    Gpu,
    Nic,
    Report,
    error_code,
    error_gpu,
)
from aggregator.fleet.view import NodeView
from aggregator.model import Finding
from aggregator.rules.model import (
    NIC_TOTALS,
    Condition,
    ErrorRule,
    EventRule,
    FieldRule,
    GpuMissingRule,
    GpuSelector,
    NicSelector,
    RateRule,
    Rule,
    ShareRule,
)
from aggregator.rules.sequential import CountEvidence, PoissonCusum
from aggregator.story import iso

log = logging.getLogger(__name__)
# A sequential rule's statistic for a subject (port, GPU) no report has carried for this long is
# dropped: ten minutes is sixty 10-s reports, far past a lost report or two.
_COUNTS_FORGET_S: Final = 600.0
# Report times are an agent's timer plus its collection time, so "down on two reports 10 s apart"
# may read 9.99 s; a for: period is met within this much, or a 10s hold on 10-s reports would
# need a third report whenever the second came a few milliseconds early.
HOLD_SLACK_SECONDS: Final = 0.5

Test = Callable[[Any], bool]
Evidence = dict[str, Any]

_COMPARE: Final[Mapping[str, Callable[[Any, Any], bool]]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
_GPU_FIELD, _NVLINK, _NIC_COUNTER, _NIC_TOTAL = range(4)
_NO_COUNTERS: Final[Mapping[str, int]] = {}
_NONE_HELD: Final[AbstractSet[tuple[int, str]]] = frozenset()
_NONE_ARMED: Final[Mapping[tuple[int, str], None]] = types.MappingProxyType({})
# (rule, subject) pairs a node keeps armed: a node has at most a few dozen NICs and GPUs, each armed
# once per rule with ``after``; more is a sender naming new ones report after report.
_MAX_ARMED: Final = 256
# Matching events kept per (node, repeat rule): bounds memory under an event storm.
_MAX_HISTORY: Final = 1024
_UNIT: Final[Mapping[str, str]] = {"second": "/s", "minute": "/min", "hour": "/h"}


# ---------------------------------------------------------------------------------------------
# Compiling conditions


def _any_test(tests: Sequence[Test]) -> Test:
    if len(tests) == 1:
        return tests[0]
    return lambda e: any(t(e) for t in tests)


def _entity_test(cond: Condition) -> Test:
    """A test of one GPU or NIC struct; a null field never satisfies a condition."""
    field = cond.field
    op = cond.op
    value = cond.value
    if op == "is_true":
        return lambda e: getattr(e, field) is True
    if op == "is_false":
        return lambda e: getattr(e, field) is False
    if op in ("in", "not_in"):
        assert isinstance(value, frozenset)
        names: frozenset[str] = value
        if op == "in":
            return lambda e: (x := getattr(e, field)) is not None and x in names
        return lambda e: (x := getattr(e, field)) is not None and x not in names
    if op == "any_bits":
        assert isinstance(value, int)
        mask = value
        return lambda e: (x := getattr(e, field)) is not None and x & mask != 0
    compare = _COMPARE[op]
    if cond.value_of is not None:
        other = cond.value_of
        return lambda e: (
            (x := getattr(e, field)) is not None and (y := getattr(e, other)) is not None and compare(x, y)
        )
    return lambda e: (x := getattr(e, field)) is not None and compare(x, value)


def _sample_test(cond: Condition) -> Callable[[float], bool]:
    """The same test on one sample from ``NodeView.gpu_samples`` (flags come as 0.0/1.0)."""
    op = cond.op
    if op == "is_true":
        return lambda v: v == 1.0
    if op == "is_false":
        return lambda v: v == 0.0
    if op == "any_bits":
        assert isinstance(cond.value, int)
        mask = cond.value
        return lambda v: int(v) & mask != 0
    compare = _COMPARE[op]
    value = cond.value
    return lambda v: compare(v, value)


def _threshold(cond: Condition, entity: Any) -> Any:
    if cond.value_of is not None:
        return getattr(entity, cond.value_of)
    if cond.op in ("is_true", "is_false"):
        return cond.op == "is_true"
    if isinstance(cond.value, frozenset):
        return "|".join(sorted(cond.value))
    return cond.value


def _gpu_select(sel: GpuSelector | None) -> Test | None:
    if sel is None:
        return None
    index, model = sel.index, sel.model
    return lambda g: (
        (index is None or g.index in index)
        and (model is None or (g.model is not None and model.search(g.model) is not None))
    )


def _nic_select(sel: NicSelector | None) -> Test | None:
    if sel is None:
        return None
    link_layer, rdma, device = sel.link_layer, sel.rdma, sel.device
    return lambda n: (
        (link_layer is None or n.link_layer == link_layer)
        and (rdma is None or (n.port is not None) == rdma)
        and (device is None or device.search(n.device) is not None)
    )


def _seen_uuid(state: _NodeState, index: int | None) -> str | None:
    return state.gpus_seen.get(index) if index is not None else None


def _gpu_subject(gpu: Gpu) -> str:
    return f"gpu{gpu.index}"


def _unchanged(source: int, field: str, entity: Any, prev: Any) -> bool | None:
    """Whether the counter a rate check reads kept its value since ``prev``; None: the entity
    does not report it, so the check has nothing to read."""
    if source == _NVLINK:
        links = entity.nvlink
        if links is UNSET or not links or getattr(links[0], field) is None:
            return None
        return prev is not None and links == prev.nvlink
    if source == _NIC_COUNTER:
        # A NIC counter's BER budget moves with the link rate, so a changed rate counts as moved.
        value = (entity.counters if entity.counters is not UNSET else _NO_COUNTERS).get(field)
        if value is None:
            return None
        return (
            prev is not None
            and prev.rate_bytes_per_second == entity.rate_bytes_per_second
            and prev.counters is not UNSET
            and prev.counters.get(field) == value
        )
    value = getattr(entity, field)
    if value is None:
        return None
    return prev is not None and value == getattr(prev, field)


def _counter_value(source: int, field: str, entity: Any) -> int | None:
    """The counter a rate check reads, as the report has it now (NVLink: summed over the links)."""
    if source == _NVLINK:
        links = entity.nvlink
        if links is UNSET or not links:
            return None
        values = [getattr(link, field) for link in links]
        return None if any(v is None for v in values) else sum(values)
    if source == _NIC_COUNTER:
        value = (entity.counters if entity.counters is not UNSET else _NO_COUNTERS).get(field)
        return value if isinstance(value, int) else None
    value = getattr(entity, field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _previous_entity(source: int, entity: Any, previous: Report) -> Any:
    """The same GPU or NIC on an earlier report, or None."""
    if source in (_GPU_FIELD, _NVLINK):
        return next((g for g in previous.gpus if g.index == entity.index), None)
    return next((n for n in previous.nics if n.device == entity.device and n.port == entity.port), None)


def _nic_subject(nic: Nic) -> str:
    return nic.device if nic.port is None else f"{nic.device}/{nic.port}"


def _gpu_evidence(gpu: Gpu) -> Evidence:
    return {"gpu": gpu.index, "uuid": gpu.uuid, "model": gpu.model}


def _nic_evidence(nic: Nic) -> Evidence:
    return {
        "device": nic.device,
        "port": nic.port,
        "netdev": nic.netdev,
        "link_layer": nic.link_layer,
        "state": nic.state,
        "phys_state": nic.phys_state,
    }


# ---------------------------------------------------------------------------------------------
# Compiled rules


@dataclass(frozen=True, slots=True)
class Series:
    """What a rule set reads through ``NodeView``: rates of counters, samples of gauges."""

    gpu_counters: frozenset[str]
    nvlink_counters: frozenset[str]
    nic_counters: frozenset[str]  # Nic.counters keys, or rx_bytes_total and friends
    gpu_gauges: frozenset[str]


@dataclass(frozen=True, slots=True)
class _FieldCheck:
    rid: int
    rule: FieldRule
    select: Test | None
    test: Test
    guard: Test | None
    arm: Test | None = None  # ``after``: any of its conditions


@dataclass(frozen=True, slots=True)
class _RateCheck:
    rid: int
    rule: RateRule
    source: int  # _GPU_FIELD, _NVLINK, _NIC_COUNTER or _NIC_TOTAL
    field: str
    window_s: float
    select: Test | None
    guard: Test | None
    compare: Callable[[Any, Any], bool]
    upward: bool  # fires on a high rate (> or >=)
    # Upward, no guard: while it does not hold, a report whose counter did not move cannot make
    # it hold (the increase in a sliding window only shrinks), so the view need not be asked.
    skippable: bool
    per_s: float
    sequential: bool = False  # test: sequential (a Poisson CUSUM per subject, no window)
    # What the counter stops at (an IBTA PortCounters error counter), if anything.
    saturates_at: int | None = None
    # Sequential designs by budget (counts per second): a fleet has a handful of link rates.
    designs: dict[float, PoissonCusum] = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class _ShareCheck:
    rid: int
    rule: ShareRule
    select: Test | None
    now_test: Test  # the condition on the current report (with its guard)
    sample_test: Callable[[float], bool]
    guard_test: Callable[[float], bool] | None


@dataclass(frozen=True, slots=True)
class _EventCheck:
    rid: int
    rule: EventRule
    select: Test | None


@dataclass(frozen=True, slots=True)
class _Hit:
    """One subject for which a rule's condition holds on this report."""

    key: str
    rid: int
    rule: Rule
    since: float
    until: float  # an event finding that clears on condition stays active until then
    evidence: Evidence


@dataclass(slots=True)
class _Active:
    finding: Finding
    until: float
    latched: bool  # clears on reboot


class _NodeState:
    __slots__ = (
        "active",
        "armed",
        "boot_id",
        "boot_seen",
        "counts",
        "gpus_seen",
        "held",
        "history",
        "last_time",
        "pending",
    )

    def __init__(self, now: float) -> None:
        self.boot_id: str | None = None
        self.boot_seen = now  # the first report of this boot we saw: how far back rates can see
        self.active: dict[str, _Active] = {}
        self.pending: dict[tuple[int, str], float] = {}
        # (rate rule, subject) whose threshold was crossed on the last report; the shared empty
        # set while none was (most nodes, most reports): an empty set a node is one more object
        # the cycle collector tracks.
        self.held: AbstractSet[tuple[int, str]] = _NONE_HELD
        self.last_time: float | None = None  # the report evaluated last
        self.gpus_seen: dict[int, str] = {}  # index -> uuid, this boot
        # rid -> (event time, gpu, code, message) of matching events of a repeat rule
        self.history: dict[int, deque[tuple[float, int, int, str | None]]] = {}
        # (sequential rate rule, subject) -> its statistic; a new boot starts every counter over
        self.counts: dict[tuple[int, str], CountEvidence] = {}
        # (field rule with ``after``, subject) seen armed, in the order they were: kept across
        # reboots (a port that was up before a reboot and does not come back is down), forgotten
        # with the node, at most _MAX_ARMED (a token naming new ports in every report pushes out
        # its own oldest, not memory). The shared empty mapping until the first.
        self.armed: Mapping[tuple[int, str], None] = _NONE_ARMED

    def armed_for(self, rid: int, subject: str, arm: Test, entity: Any) -> bool:
        """Whether field rule ``rid`` applies to ``subject``: its ``after`` (``arm``) held at an
        earlier report, or holds for ``entity`` now (asked only while it never has)."""
        key = (rid, subject)
        if key in self.armed:
            return True
        if not arm(entity):
            return False
        armed = self.armed if isinstance(self.armed, dict) else {}
        armed[key] = None
        if len(armed) > _MAX_ARMED:
            del armed[next(iter(armed))]
        self.armed = armed
        return True

    def new_boot(self, now: float) -> None:
        self.boot_seen = now
        self.active = {k: a for k, a in self.active.items() if not a.latched}
        self.pending = {}
        self.held = _NONE_HELD
        self.gpus_seen = {}
        self.counts = {}


def _compile_rate(rid: int, rule: RateRule) -> _RateCheck:
    if rule.target == "nic":
        select = _nic_select(rule.nics)
        source = _NIC_TOTAL if rule.field in NIC_TOTALS else _NIC_COUNTER
    else:
        select = _gpu_select(rule.gpus)
        source = _GPU_FIELD if rule.target == "gpu" else _NVLINK
    upward = rule.op in (">", ">=")
    sequential = rule.test == "sequential"
    catalogued = NIC_COUNTER_CATALOGUE.get(rule.field) if source == _NIC_COUNTER else None
    return _RateCheck(
        rid=rid,
        rule=rule,
        source=source,
        field=rule.field,
        window_s=rule.window_s,
        select=select,
        guard=_entity_test(rule.when) if rule.when is not None else None,
        compare=_COMPARE[rule.op],
        upward=upward,
        # A sequential statistic moves with time even when the counter does not (it drains).
        skippable=upward and rule.when is None and not sequential,
        per_s=rule.per_s,
        sequential=sequential,
        saturates_at=catalogued.saturates_at if catalogued is not None else None,
    )


def _compile_share(rid: int, rule: ShareRule) -> _ShareCheck:
    test = _entity_test(rule.condition)
    guard = _entity_test(rule.when) if rule.when is not None else None
    now_test: Test = test if guard is None else (lambda g: test(g) and guard(g))
    return _ShareCheck(
        rid=rid,
        rule=rule,
        select=_gpu_select(rule.gpus),
        now_test=now_test,
        sample_test=_sample_test(rule.condition),
        guard_test=_sample_test(rule.when) if rule.when is not None else None,
    )


class _Pass:
    """One evaluation: the report's view, the node's state, and what this report found."""

    __slots__ = ("_prev_gpus", "_prev_nics", "held", "hits", "now", "pending", "previous", "state", "view")

    def __init__(self, view: NodeView, state: _NodeState) -> None:
        self.view = view
        self.state = state
        self.now = view.report.time
        self.hits: list[_Hit] = []
        # The for: timers of conditions that hold on this report; the others are dropped.
        self.pending: dict[tuple[int, str], float] = {}
        self.held: set[tuple[int, str]] = set()
        # The previous report, only if it is the one this engine evaluated last for the node:
        # what was held then is known, so unchanged counters can be skipped.
        previous = view.previous
        self.previous = previous if previous is not None and previous.time == state.last_time else None
        self._prev_gpus: dict[int, Gpu] | None = None
        self._prev_nics: dict[tuple[str, int | None], Nic] | None = None

    def prev_gpu(self, index: int) -> Gpu | None:
        if self.previous is None:
            return None
        if self._prev_gpus is None:
            self._prev_gpus = {g.index: g for g in self.previous.gpus}
        return self._prev_gpus.get(index)

    def prev_nic(self, nic: Nic) -> Nic | None:
        if self.previous is None:
            return None
        if self._prev_nics is None:
            self._prev_nics = {(n.device, n.port): n for n in self.previous.nics}
        return self._prev_nics.get((nic.device, nic.port))

    def hold(self, rid: int, subject: str, for_s: float) -> float | None:
        """When the condition started holding, once it has held ``for_s``; None until then."""
        if for_s <= 0:
            return self.now
        key = (rid, subject)
        start = self.state.pending.get(key, self.now)
        self.pending[key] = start
        return start if self.now - start >= for_s - HOLD_SLACK_SECONDS else None

    def hit(
        self, key: str, rid: int, rule: Rule, since: float, evidence: Evidence, *, hold: float = 0.0
    ) -> None:
        self.hits.append(_Hit(key, rid, rule, since, self.now + hold, evidence))


@dataclass(frozen=True, slots=True)
class _Family:
    """Rate checks of one selector that read the same kind of counter."""

    source: int
    checks: tuple[_RateCheck, ...]
    skippable: bool  # every check is
    snapshot: Callable[[Any], Any]  # the counters the family reads, comparable between reports


def _snapshot(source: int, fields: tuple[str, ...]) -> Callable[[Any], Any]:
    if source == _NVLINK:
        return lambda g: g.nvlink
    if source in (_GPU_FIELD, _NIC_TOTAL):
        return operator.attrgetter(*fields)
    get = operator.itemgetter(*fields)

    def counters(n: Any) -> Any:
        values = n.counters
        if values is UNSET:
            return None
        try:
            return get(values), n.rate_bytes_per_second  # the BER budget moves with the link rate
        except KeyError:
            return tuple(values.get(f) for f in fields), n.rate_bytes_per_second

    return counters


def _group(
    checks: list[_RateCheck], selector: Callable[[_RateCheck], GpuSelector | NicSelector | None]
) -> tuple[tuple[Test | None, tuple[_Family, ...]], ...]:
    """Rate checks by selector (a GPU or NIC is matched once per distinct one), then by source;
    sequential checks (never skippable) in families of their own, so that the window checks of
    the same selector and source keep skipping unchanged counters together."""
    groups: dict[GpuSelector | NicSelector | None, dict[tuple[int, bool], list[_RateCheck]]] = {}
    for check in checks:
        family_key = (check.source, check.sequential)
        groups.setdefault(selector(check), {}).setdefault(family_key, []).append(check)
    out = []
    for by_source in groups.values():
        families = tuple(
            _Family(
                source=source,
                checks=tuple(members),
                skippable=all(c.skippable for c in members),
                snapshot=_snapshot(source, tuple(dict.fromkeys(c.field for c in members))),
            )
            for (source, _), members in by_source.items()
        )
        first = next(iter(by_source.values()))[0]
        out.append((first.select, families))
    return tuple(out)


def _event_time(entry: tuple[float, int, int, str | None]) -> float:
    return entry[0]


# ---------------------------------------------------------------------------------------------
# The engine


class RuleEngine:
    """Evaluates rules per node; keeps per-node state between reports (see the module doc)."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._rules: tuple[Rule, ...] = tuple(rules)
        enabled = [r for r in self._rules if r.enabled]
        names = [r.name for r in enabled]
        if len(set(names)) != len(names):
            raise ValueError("rule names must be unique")
        self._events: dict[tuple[str, int], list[_EventCheck]] = {}
        self._repeats: list[_EventCheck] = []
        self._gpu_fields: list[_FieldCheck] = []
        self._nic_fields: list[_FieldCheck] = []
        self._gpu_rates: list[_RateCheck] = []  # gpu and nvlink targets
        self._nic_rates: list[_RateCheck] = []
        self._shares: list[_ShareCheck] = []
        self._missing: list[tuple[int, GpuMissingRule]] = []
        self._errors: list[tuple[int, ErrorRule]] = []
        for rid, rule in enumerate(enabled):
            if isinstance(rule, EventRule):
                check = _EventCheck(rid=rid, rule=rule, select=_gpu_select(rule.gpus))
                for code in rule.codes:
                    self._events.setdefault((rule.events, code), []).append(check)
                if rule.repeat is not None:
                    self._repeats.append(check)
            elif isinstance(rule, FieldRule):
                select = _gpu_select(rule.gpus) if rule.target == "gpu" else _nic_select(rule.nics)
                field_check = _FieldCheck(
                    rid=rid,
                    rule=rule,
                    select=select,
                    test=_entity_test(rule.condition),
                    guard=_entity_test(rule.when) if rule.when is not None else None,
                    arm=_any_test([_entity_test(c) for c in rule.after]) if rule.after else None,
                )
                (self._gpu_fields if rule.target == "gpu" else self._nic_fields).append(field_check)
            elif isinstance(rule, RateRule):
                rates = self._nic_rates if rule.target == "nic" else self._gpu_rates
                rates.append(_compile_rate(rid, rule))
            elif isinstance(rule, ShareRule):
                self._shares.append(_compile_share(rid, rule))
            elif isinstance(rule, GpuMissingRule):
                self._missing.append((rid, rule))
            else:
                self._errors.append((rid, rule))
        # Rate rules grouped by selector, so a GPU or NIC is matched once per distinct selector.
        self._gpu_rate_groups = _group(self._gpu_rates, lambda rc: rc.rule.gpus)
        self._nic_rate_groups = _group(self._nic_rates, lambda rc: rc.rule.nics)
        self._per_gpu = bool(self._gpu_fields or self._gpu_rates or self._shares)
        self._per_nic = bool(self._nic_fields or self._nic_rates)
        self._nodes: dict[str, _NodeState] = {}

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self._rules

    @property
    def series(self) -> Series:
        """The counters and gauges the enabled rules read from the view, for a history that keeps
        only what it is asked for (register them up front, before the first report)."""
        return Series(
            # A sequential rule reads each report's counter itself, not the view's history; its
            # counter stays registered all the same, for the detectors that read its rate from
            # the history (the pool frames' symbol error rates), as before.
            gpu_counters=frozenset(rc.field for rc in self._gpu_rates if rc.source == _GPU_FIELD),
            nvlink_counters=frozenset(rc.field for rc in self._gpu_rates if rc.source == _NVLINK),
            nic_counters=frozenset(rc.field for rc in self._nic_rates),
            gpu_gauges=frozenset(
                f
                for sc in self._shares
                for f in (sc.rule.condition.field, sc.rule.when.field if sc.rule.when else None)
                if f is not None
            ),
        )

    def restore_latched(self, node: str, boot_id: str, findings: Sequence[Finding], now: float) -> None:
        """After an aggregator restart: findings that clear only on reboot (an XID 79) are active
        again for ``node`` until it reports a boot other than ``boot_id``. A node that reported
        since the restart keeps its live findings too, unless it is on another boot already."""
        state = self._restored_state(node, boot_id, now) if findings else None
        if state is None:
            return
        for f in findings:
            state.active.setdefault(f.key, _Active(finding=f, until=math.inf, latched=True))

    def restore_saturated(self, node: str, boot_id: str, findings: Sequence[Finding], now: float) -> None:
        """After an aggregator restart: rate findings on an error counter that stops at its
        maximum hold again while the counter reads it. A stopped counter cannot give the evidence
        a second time (a window rule's whole window of counts may be before the restart); a
        counter below it decides again from its next counts. A sequential finding is restored only
        if it was already held by the saturated counter (``evidence_state``). Same boot only, as
        for ``restore_latched``; other findings are ignored."""
        checks = (*self._nic_rates, *self._gpu_rates)
        rates = {rc.rule.name: rc for rc in checks if rc.saturates_at is not None}
        state: _NodeState | None = None
        for f in findings:
            rc = rates.get(f.rule or "")
            prefix = f"{f.rule}:"
            if rc is None or not f.key.startswith(prefix):
                continue
            if rc.sequential and f.evidence.get("evidence_state") != "saturated":
                continue
            state = state or self._restored_state(node, boot_id, now)
            if state is None:
                return
            key = (rc.rid, f.key[len(prefix) :])
            if rc.sequential:
                evidence = state.counts.get(key)
                if evidence is None:
                    # Decided, and stopped at the counter's maximum: the next report either reads
                    # it there (held) or lower (cleared: the statistic starts over, undecided).
                    state.counts[key] = CountEvidence(
                        value=rc.saturates_at, at=-math.inf, decided=True, saturated=True
                    )
                else:
                    evidence.decided = True  # reported since the restart: its counter says next
            else:
                state.held = {*state.held, key}
                state.pending.setdefault(key, f.since)

    def _restored_state(self, node: str, boot_id: str, now: float) -> _NodeState | None:
        """The node's state to restore into: new, or the live one if it is on ``boot_id``."""
        state = self._nodes.get(node)
        if state is None:
            state = self._nodes[node] = _NodeState(now)
            state.boot_id = boot_id
        elif state.boot_id != boot_id:
            return None  # rebooted since the snapshot: that boot's evidence is over
        return state

    def forget(self, node: str) -> None:
        """Drop everything remembered about a node (it left the fleet)."""
        self._nodes.pop(node, None)

    def evaluate(self, view: NodeView) -> list[Finding]:
        """The node's active rule findings after its latest report, sorted by key."""
        report = view.report
        state = self._nodes.get(report.node)
        if state is None or state.last_time is None:
            # The node's first report here (its state new, or restored after a restart and
            # evaluated never yet).
            if state is None:
                state = self._nodes[report.node] = _NodeState(report.time)
            else:
                state.boot_seen = report.time
            previous = view.previous
            if previous is not None and previous.boot_id == report.boot_id:
                # The view has history of this boot from before we started: trust its rates.
                state.boot_seen = -math.inf
                state.gpus_seen = {g.index: g.uuid for g in previous.gpus}
        # A reboot (what view.rebooted says), decided on the boot_id we saw last so that a report
        # evaluated twice (a late one arrived meanwhile) does not reset anything the second time.
        if state.boot_id is not None and state.boot_id != report.boot_id:
            state.new_boot(report.time)
        state.boot_id = report.boot_id
        run = _Pass(view, state)
        if self._events:
            if report.events is not UNSET and report.events:
                self._check_events(run, report, report.events)
            # A report that arrived late (HistoryView.added, older than the latest) is otherwise
            # not looked at; its XIDs must not be lost.
            added = view.added
            if (
                isinstance(added, Report)
                and added is not report
                and added.events is not UNSET
                and added.events
            ):
                self._check_events(run, added, added.events)
        if self._repeats and state.history:
            self._check_repeats(run)
        if self._per_gpu:
            for gpu in report.gpus:
                self._check_gpu(run, gpu)
        if self._per_nic:
            for nic in report.nics:
                self._check_nic(run, nic)
        if self._missing:
            self._check_missing(run)
        if self._errors and report.errors is not UNSET and report.errors:
            self._check_errors(run, report.errors)
        state.pending = run.pending
        state.held = run.held or _NONE_HELD
        state.last_time = report.time
        return self._merge(report, state, run.hits)

    # -- per kind ------------------------------------------------------------------------------

    def _check_gpu(self, run: _Pass, gpu: Gpu) -> None:
        self._check_fields(run, self._gpu_fields, gpu, _gpu_subject, _gpu_evidence)
        if self._gpu_rates:
            self._check_rates(
                run,
                gpu,
                _gpu_subject(gpu),
                run.prev_gpu(gpu.index),
                groups=self._gpu_rate_groups,
                base=_gpu_evidence,
            )
        active = run.state.active
        for sc in self._shares:
            # Reading the window costs a pass over its samples: only when the condition holds now,
            # or to decide whether an active finding still stands (so it does not flap with every
            # sample).
            if (sc.select is None or sc.select(gpu)) and (
                sc.now_test(gpu) or (active and f"{sc.rule.name}:gpu{gpu.index}" in active)
            ):
                self._share_hit(run, sc, gpu)

    def _check_nic(self, run: _Pass, nic: Nic) -> None:
        self._check_fields(run, self._nic_fields, nic, _nic_subject, _nic_evidence)
        if self._nic_rates:
            self._check_rates(
                run,
                nic,
                _nic_subject(nic),
                run.prev_nic(nic),
                groups=self._nic_rate_groups,
                base=_nic_evidence,
            )

    @staticmethod
    def _check_fields(
        run: _Pass,
        checks: list[_FieldCheck],
        entity: Any,
        subject_of: Callable[[Any], str],
        base: Callable[[Any], Evidence],
    ) -> None:
        for fc in checks:
            if fc.select is not None and not fc.select(entity):
                continue
            subject: str | None = None
            if fc.arm is not None:
                subject = subject_of(entity)
                if not run.state.armed_for(fc.rid, subject, fc.arm, entity):
                    continue
            if fc.test(entity) and (fc.guard is None or fc.guard(entity)):
                subject = subject or subject_of(entity)
                since = run.hold(fc.rid, subject, fc.rule.for_s)
                if since is not None:
                    cond = fc.rule.condition
                    evidence = base(entity)
                    evidence.update(
                        field=cond.field,
                        value=getattr(entity, cond.field),
                        threshold=_threshold(cond, entity),
                    )
                    run.hit(f"{fc.rule.name}:{subject}", fc.rid, fc.rule, since, evidence)

    def _check_rates(
        self,
        run: _Pass,
        entity: Any,
        subject: str,
        prev: Any,
        *,
        groups: tuple[tuple[Test | None, tuple[_Family, ...]], ...],
        base: Callable[[Any], Evidence],
    ) -> None:
        """The rate checks of one GPU or NIC; ``prev`` is the same entity on the previous report."""
        held = run.state.held
        for select, families in groups:
            if select is not None and not select(entity):
                continue
            for family in families:
                # Nothing this family reads moved and nothing of the node was over a threshold on
                # the last report: no rate here can have crossed one now (see _RateCheck).
                if (
                    family.skippable
                    and prev is not None
                    and not held
                    and family.snapshot(entity) == family.snapshot(prev)
                ):
                    continue
                for rc in family.checks:
                    unchanged = _unchanged(rc.source, rc.field, entity, prev)
                    if unchanged is None:
                        continue
                    if rc.guard is not None and not rc.guard(entity):
                        continue
                    if unchanged and rc.skippable and (rc.rid, subject) not in held:
                        continue
                    if rc.sequential:
                        self._sequential_hit(run, rc, entity, subject, base)
                    else:
                        self._rate_hit(run, rc, entity, subject, base)

    def _sequential_hit(
        self, run: _Pass, rc: _RateCheck, entity: Any, subject: str, base: Callable[[Any], Evidence]
    ) -> None:
        """Feed the report's counter to the subject's Poisson CUSUM (aggregator/rules/sequential.py);
        a finding while it stands decided."""
        rule = rc.rule
        if rule.max_ber is not None:
            link = entity.rate_bytes_per_second
            if not link:
                return  # the budget scales with the link rate; without it there is no budget
            budget = rule.max_ber * link * 8.0  # per second
        else:
            assert rule.value is not None
            budget = rule.value / rc.per_s
        key = (rc.rid, subject)
        counts = run.state.counts
        evidence_state = counts.get(key)
        value = _counter_value(rc.source, rc.field, entity)
        if evidence_state is not None and evidence_state.idle(value, run.now, rc.saturates_at):
            return  # nothing counted, nothing standing: only the time moved (not decided)
        design = rc.designs.get(budget)
        if design is None:
            design = rc.designs[budget] = PoissonCusum.design(budget, rule.design_ratio, rule.arl_hours)
        if evidence_state is None:
            # A new subject: first drop the ones no report has carried for a while (a port
            # renamed or gone). Without it a node naming new ports in every report would grow
            # this without bound; the evidence of a subject that comes back starts over.
            stale = [
                k for k, ev in counts.items() if ev.at is not None and ev.at < run.now - _COUNTS_FORGET_S
            ]
            for k in stale:
                del counts[k]
            evidence_state = counts[key] = CountEvidence()
            # After an aggregator restart (or for a new subject) the view may still hold the
            # previous report of this boot: one interval of evidence gained.
            previous = run.view.previous
            if previous is not None and previous.time < run.now:
                before = _previous_entity(rc.source, entity, previous)
                if before is not None:
                    evidence_state.observe(
                        _counter_value(rc.source, rc.field, before), previous.time, design, rc.saturates_at
                    )
        evidence_state.observe(value, run.now, design, rc.saturates_at)
        if not evidence_state.decided:
            return
        since = run.hold(rc.rid, subject, rule.for_s)
        if since is None:
            return
        per_second = evidence_state.rate()
        start = evidence_state.start if evidence_state.start is not None else run.now
        evidence = base(entity)
        rate = round(per_second * rc.per_s, 9) if per_second is not None else None
        evidence.update(
            field=rule.field,
            value=rate,
            rate=rate,
            threshold=round(budget * rc.per_s, 9),
            per=rule.per,
            test="sequential",
            statistic=round(evidence_state.statistic, 3),
            limit=round(design.h, 3),
            arl=design.arl_hours,
            design_ratio=design.ratio,
            since=start,
            counts=evidence_state.counts,
            evidence_state=evidence_state.state,
        )
        run.hit(f"{rule.name}:{subject}", rc.rid, rule, max(since, start) if rule.for_s else start, evidence)

    def _rate_hit(
        self, run: _Pass, rc: _RateCheck, entity: Any, subject: str, base: Callable[[Any], Evidence]
    ) -> None:
        source, field, window = rc.source, rc.field, rc.window_s
        view = run.view
        if source == _GPU_FIELD:
            per_second = view.gpu_rate(entity.index, field, window)
        elif source == _NVLINK:
            per_second = view.nvlink_rate(entity.index, field, window)
        else:
            per_second = view.nic_rate(entity.device, entity.port, field, window)
        key = (rc.rid, subject)
        rule = rc.rule
        if rule.max_ber is not None:
            link = entity.rate_bytes_per_second
            if not link:
                return  # the budget scales with the link rate; without it there is no budget
            threshold = rule.max_ber * link * 8.0 * rc.per_s
        else:
            assert rule.value is not None
            threshold = rule.value
        threshold = round(threshold, 9)
        if per_second is None:
            # No rate yet (the first report after an aggregator restart): only a finding restored
            # on a counter at its maximum holds.
            if not self._stuck(run, rc, entity, key):
                return
            value, saturated = 0.0, True
        else:
            # The increase over the window, per unit: history shorter than the window (a fresh
            # boot) counts as no events, so a burst in the first minutes cannot pass for a
            # sustained rate. A rule that fires on a low rate waits for a full window instead.
            seen = min(window, run.now - run.state.boot_seen)
            if rc.upward:
                value = per_second * rc.per_s * (seen / window)
            elif seen < window:
                return
            else:
                value = per_second * rc.per_s
            # Rounded so that a rate sitting exactly on its threshold (2 link downs in 30 minutes
            # is 4 per hour) does not flicker with floating-point noise between reports.
            value = round(value, 9)
            saturated = not rc.compare(value, threshold)
            if saturated and not self._stuck(run, rc, entity, key):
                return
        run.held.add(key)
        since = run.hold(rc.rid, subject, rule.for_s)
        if since is None:
            return
        evidence = base(entity)
        evidence.update(
            field=rule.field, value=value, rate=value, threshold=threshold, window=rule.window_s, per=rule.per
        )
        if saturated:
            evidence["evidence_state"] = "saturated"
        run.hit(f"{rule.name}:{subject}", rc.rid, rule, since, evidence)

    @staticmethod
    def _stuck(run: _Pass, rc: _RateCheck, entity: Any, key: tuple[int, str]) -> bool:
        """Whether a window rule that does not hold on its rate holds all the same: an IBTA
        PortCounters error counter stops at its maximum until it is cleared, and from then on
        reads as a rate of 0, which is silence, not health. A rule that held on the last report
        keeps holding while its counter stays there (as the sequential test keeps its decision);
        one that did not hold is not decided by it."""
        saturates_at = rc.saturates_at
        if saturates_at is None or not rc.upward or key not in run.state.held:
            return False
        count = _counter_value(rc.source, rc.field, entity)
        return count is not None and count >= saturates_at

    def _share_hit(self, run: _Pass, sc: _ShareCheck, gpu: Gpu) -> None:
        rule = sc.rule
        key = f"{rule.name}:gpu{gpu.index}"
        field = rule.condition.field
        samples = run.view.gpu_samples(gpu.index, field, rule.window_s)
        guard_at: dict[float, float | None] | None = None
        if rule.when is not None:
            guard_at = dict(run.view.gpu_samples(gpu.index, rule.when.field, rule.window_s))
        total = matched = 0
        sample_test, guard_test = sc.sample_test, sc.guard_test
        for at, value in samples:
            if value is None:
                continue
            total += 1
            if not sample_test(value):
                continue
            if guard_at is not None and guard_test is not None:
                guard_value = guard_at.get(at)
                if guard_value is None or not guard_test(guard_value):
                    continue
            matched += 1
        if total < rule.min_samples or matched < rule.share * total:
            return
        evidence = _gpu_evidence(gpu)
        share = matched / total
        evidence.update(
            field=field,
            value=share,
            share=share,
            threshold=rule.share,
            window=rule.window_s,
            count=total,
            current=getattr(gpu, field),
        )
        run.hit(key, sc.rid, rule, run.now, evidence)

    def _check_events(self, run: _Pass, source: Report, events: Sequence[Event]) -> None:
        gpus: dict[int, Gpu] | None = None
        for event in events:
            code = event.code
            if code is None:
                continue
            checks = self._events.get((event.kind, code))
            if not checks:
                continue
            if gpus is None:
                gpus = {g.index: g for g in source.gpus}
            gpu = gpus.get(event.gpu) if event.gpu is not None else None
            for check in checks:
                rule = check.rule
                if check.select is not None and (gpu is None or not check.select(gpu)):
                    continue
                message = event.message
                if rule.match is not None and (message is None or rule.match.search(message) is None):
                    continue
                if rule.repeat is not None:
                    if event.gpu is not None:
                        history = run.state.history.get(check.rid)
                        if history is None:
                            history = run.state.history[check.rid] = deque(maxlen=_MAX_HISTORY)
                        entry = (event.time, event.gpu, code, message)
                        if entry not in history:  # the same report evaluated twice counts once
                            history.append(entry)
                    continue
                subject = "node" if event.gpu is None else f"gpu{event.gpu}"
                evidence: Evidence = {
                    "gpu": event.gpu,
                    "uuid": gpu.uuid if gpu is not None else _seen_uuid(run.state, event.gpu),
                    "model": gpu.model if gpu is not None else None,
                    "xid": code,
                    "code": code,
                    "kind": event.kind,
                    "message": message,
                    "time": event.time,
                }
                run.hit(f"{rule.name}:{subject}", check.rid, rule, run.now, evidence, hold=rule.hold_s)

    def _check_repeats(self, run: _Pass) -> None:
        history_by_rule = run.state.history
        gpus: dict[int, Gpu] | None = None
        for check in self._repeats:
            history = history_by_rule.get(check.rid)
            if not history:
                continue
            rule = check.rule
            repeat = rule.repeat
            assert repeat is not None
            horizon = run.now - repeat.within_s
            while history and history[0][0] < horizon:
                history.popleft()
            if not history:
                del history_by_rule[check.rid]
                continue
            per_gpu: dict[int, list[tuple[float, int, int, str | None]]] = {}
            for entry in sorted(history, key=_event_time):
                per_gpu.setdefault(entry[1], []).append(entry)
            if repeat.alone and len(per_gpu) > 1:
                continue  # the same fault on several GPUs at once is the job, not a GPU
            for index, entries in per_gpu.items():
                episodes, last = 0, -math.inf
                for entry in entries:
                    if entry[0] - last >= repeat.apart_s:
                        episodes += 1
                        last = entry[0]
                if episodes < repeat.count:
                    continue
                if gpus is None:
                    gpus = {g.index: g for g in run.view.report.gpus}
                gpu = gpus.get(index)
                at, _, code, message = entries[-1]
                evidence: Evidence = {
                    "gpu": index,
                    "uuid": gpu.uuid if gpu is not None else _seen_uuid(run.state, index),
                    "model": gpu.model if gpu is not None else None,
                    "xid": code,
                    "code": code,
                    "message": message,
                    "time": at,
                    "count": episodes,
                    "window": repeat.within_s,
                }
                run.hit(f"{rule.name}:gpu{index}", check.rid, rule, run.now, evidence)

    def _check_missing(self, run: _Pass) -> None:
        seen = run.state.gpus_seen
        gpus = run.view.report.gpus
        for gpu in gpus:
            if gpu.uuid or gpu.index not in seen:  # "": unread this time, not another GPU
                seen[gpu.index] = gpu.uuid
        if len(gpus) == len(seen):
            return
        here = {g.index for g in gpus}
        for index in sorted(seen):
            if index in here:
                continue
            for rid, rule in self._missing:
                evidence: Evidence = {
                    "gpu": index,
                    "uuid": seen[index],
                    "model": None,
                    "value": len(gpus),
                    "threshold": len(seen),
                }
                run.hit(f"{rule.name}:gpu{index}", rid, rule, run.now, evidence)

    def _check_errors(self, run: _Pass, errors: Sequence[CollectorError]) -> None:
        gpus = run.view.report.gpus
        for rid, rule in self._errors:
            for error in errors:
                if rule.collector is not None and error.collector != rule.collector:
                    continue
                index: int | None = None
                if rule.codes is not None:
                    if error_code(error) not in rule.codes:
                        continue
                    index = error_gpu(error)
                if rule.match is not None:
                    m = rule.match.search(error.message)
                    if m is None:
                        continue
                    index_text = m.groupdict().get("gpu")
                    if index_text is not None:
                        index = int(index_text)
                gpu = next((g for g in gpus if g.index == index), None) if index is not None else None
                evidence: Evidence = {
                    "gpu": index,
                    "uuid": gpu.uuid if gpu is not None else _seen_uuid(run.state, index),
                    "model": gpu.model if gpu is not None else None,
                    "collector": error.collector,
                    "message": error.message,
                }
                subject = f"gpu{index}" if index is not None else error.collector
                run.hit(f"{rule.name}:{subject}", rid, rule, run.now, evidence)

    # -- merging -------------------------------------------------------------------------------

    def _merge(self, report: Report, state: _NodeState, hits: list[_Hit]) -> list[Finding]:
        now = report.time
        old = state.active
        if not hits and not old:
            return []
        active: dict[str, _Active] = {k: a for k, a in old.items() if a.latched or a.until >= now}
        for hit in hits:
            previous = active.get(hit.key) or old.get(hit.key)
            if previous is not None and previous.latched:
                continue  # a latched finding keeps the evidence it was first seen with
            rule = hit.rule
            since = previous.finding.since if previous is not None else hit.since
            until = max(hit.until, previous.until) if previous is not None else hit.until
            active[hit.key] = _Active(
                finding=_finding(report, rule, hit, since), until=until, latched=rule.clears == "reboot"
            )
        state.active = active
        if log.isEnabledFor(logging.DEBUG) and active.keys() != old.keys():
            log.debug(
                "rule findings changed",
                extra={
                    "node": report.node,
                    "raised": sorted(active.keys() - old.keys()),
                    "cleared": sorted(old.keys() - active.keys()),
                },
            )
        return [active[k].finding for k in sorted(active)]


# ---------------------------------------------------------------------------------------------
# Findings


def _finding(report: Report, rule: Rule, hit: _Hit, since: float) -> Finding:
    evidence = hit.evidence
    subject = hit.key.partition(":")[2]
    values = {key: _display(key, evidence.get(key), evidence) for key in rule.summary.keys}
    values.update(node=report.node, rule=rule.name, subject=subject)
    if "time" in rule.summary.keys:
        values["time"] = _clock(evidence.get("time", report.time))
    return Finding(
        detector="rule",
        key=hit.key,
        severity=rule.severity,
        action=rule.action,
        summary=rule.summary.render(values),
        since=since,
        rule=rule.name,
        hard=rule.hard,
        # A sequential rule's hit is its CUSUM's crossing: the threshold's false-alarm rate is the
        # one of deciding then, so the health machine adds no persistence (aggregator/health.py).
        decided=isinstance(rule, RateRule) and rule.test == "sequential",
        clears=rule.clears,
        evidence=dict(evidence),
        runbook_url=rule.runbook_url,
        shadow=rule.shadow,
        taint_effect=rule.taint_effect,
    )


def _clock(at: float) -> str:
    return iso(at)  # with the date and the zone: a summary is read days later too


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and (seconds / size) == int(seconds / size):
            return f"{int(seconds / size)}{unit}"
    return f"{seconds:g}s"


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _display(key: str, value: Any, evidence: Evidence) -> str:
    """An evidence value as a summary shows it; never fails, whatever the report carried."""
    if value is None:
        return "?"
    if key == "uuid" and isinstance(value, str) and len(value) > 12:
        return value[:12] + "..."
    if key == "window" and isinstance(value, int | float):
        return _duration(float(value))
    if key == "since" and isinstance(value, int | float):
        return _clock(float(value))
    if key == "arl" and isinstance(value, int | float):
        return f"{value:g} h"
    if key in ("rate", "threshold") and "per" in evidence and isinstance(value, int | float):
        return f"{value:.4g}{_UNIT.get(evidence.get('per', ''), '')}"
    if key in ("share", "threshold", "value") and "share" in evidence and isinstance(value, float):
        return f"{value * 100:.0f}%"
    return _number(value)
