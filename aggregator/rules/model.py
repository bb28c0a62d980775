"""Rules as data: the YAML files under ``rules/`` parsed into typed, validated rule objects.

A rule file is read with YAML's safe loader and every rule is checked against a closed schema when
the aggregator starts: unknown keys, unknown fields, bad comparators, bad regular expressions,
bad summary placeholders and duplicate names are refused with a ``RuleError`` that names the file,
the rule and the key. Nothing in a rule file is ever evaluated as code: conditions are a field, a
comparator from a fixed set and a constant (or a second field), and summaries are templates over
a fixed set of evidence keys. ``rules/README.md`` documents the format for operators.

The objects here are plain data; ``aggregator.rules.engine`` compiles them into closures once.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import string
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, TypeAlias, get_args

import yaml

from agent import report
from agent.errors import ConfigError
from agent.report import ERROR_CODES, Gpu, Nic
from aggregator.model import Action, Clears, Severity

log = logging.getLogger(__name__)


class RuleError(ConfigError):
    """A rule file that cannot be used; the message names the file, the rule and the key."""

    def __init__(self, message: str, *, path: Path, rule: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.rule = rule
        self.key = key


# Where the shipped rules are, in order: beside the aggregator package (a source checkout or an
# editable install), then where the container image puts them.
_RULES_DIRS = (Path(__file__).resolve().parents[2] / "rules", Path("/usr/share/gpuwarden/rules"))


def default_rules_dir() -> Path:
    """The shipped ``rules/`` directory; ``$GPUWARDEN_RULES_DIR`` overrides it."""
    override = os.environ.get("GPUWARDEN_RULES_DIR")
    if override:
        return Path(override)
    for candidate in _RULES_DIRS:
        if candidate.is_dir():
            return candidate
    raise ConfigError(
        f"no rules directory found (looked in {', '.join(str(d) for d in _RULES_DIRS)}); "
        "pass --rules or set GPUWARDEN_RULES_DIR"
    )


# ---------------------------------------------------------------------------------------------
# Vocabulary

Target = Literal["gpu", "nic", "nvlink"]
RateTest = Literal["window", "sequential"]
Per = Literal["second", "minute", "hour"]
CompareOp = Literal[">", ">=", "<", "<=", "==", "!="]
Op = Literal[">", ">=", "<", "<=", "==", "!=", "in", "not_in", "is_true", "is_false", "any_bits"]
EventKind = Literal["xid", "sxid"]
FieldType = Literal["int", "float", "bool", "str"]
TaintEffectName = Literal["NoSchedule", "NoExecute"]

SEVERITIES: Final[frozenset[str]] = frozenset(get_args(Severity))
ACTIONS: Final[frozenset[str]] = frozenset(get_args(Action))
CLEARS: Final[frozenset[str]] = frozenset(get_args(Clears))
TAINT_EFFECTS: Final[frozenset[str]] = frozenset(get_args(TaintEffectName))
COMPARE_OPS: Final[frozenset[str]] = frozenset(get_args(CompareOp))
PER_SECONDS: Final[Mapping[str, float]] = types.MappingProxyType(
    {"second": 1.0, "minute": 60.0, "hour": 3600.0}
)


def _scalar_fields(struct: type) -> dict[str, FieldType]:
    """Field name -> scalar type of a report struct; lists and maps are not rule fields."""
    out: dict[str, FieldType] = {}
    for name, hint in typing.get_type_hints(struct).items():
        union = typing.get_origin(hint) in (types.UnionType, typing.Union)
        args = [a for a in (get_args(hint) if union else (hint,)) if a is not type(None)]
        if len(args) != 1:
            continue
        base = args[0]
        if base is bool:
            out[name] = "bool"
        elif base is int:
            out[name] = "int"
        elif base is float:
            out[name] = "float"
        elif base is str or typing.get_origin(base) is Literal:
            out[name] = "str"
    return out


GPU_FIELDS: Final[Mapping[str, FieldType]] = types.MappingProxyType(_scalar_fields(Gpu))
NIC_FIELDS: Final[Mapping[str, FieldType]] = types.MappingProxyType(_scalar_fields(Nic))
# What a rate can be taken of: the counters of the field catalogue (agent/report.py).
NVLINK_COUNTERS: Final[frozenset[str]] = frozenset(report.NVLINK_COUNTERS)
GPU_COUNTERS: Final[frozenset[str]] = frozenset(report.GPU_COUNTERS)
NIC_TOTALS: Final[frozenset[str]] = frozenset(report.NIC_TYPED_COUNTERS)
# Counter names the agent reports in Nic.counters (agent/report.py has the one list).
NIC_COUNTERS: Final[frozenset[str]] = report.NIC_COUNTER_NAMES
# NVML's clock event reasons by the name a rule uses (``any_bits``).
CLOCK_EVENT_BITS: Final[Mapping[str, int]] = report.CLOCK_EVENT_BITS
DRIVER_PREFIX: Final = "driver:"
# A sequential rate rule's defaults (rules/README.md): 2x the budget is the smallest excess it is
# designed to decide quickly; at the budget itself, one decision per 100,000 hours of a subject
# (0.1 per 10,000 port-hours; healthy ports sit far below the budget, where it is never).
DEFAULT_DESIGN_RATIO: Final = 2.0
DEFAULT_ARL_HOURS: Final = 100_000.0

# Evidence keys a summary may name, by rule kind; every one is always present (rendered as "?"
# when the report did not carry it), so a summary can never fail at evaluation time.
_COMMON_KEYS: Final = frozenset({"node", "rule", "subject", "time"})
_GPU_KEYS: Final = frozenset({"gpu", "uuid", "model"})
_NIC_KEYS: Final = frozenset({"device", "port", "netdev", "link_layer", "state", "phys_state"})
# A sequential rate rule: the rate estimate, the budget (threshold), the statistic and its decision
# threshold (limit), the in-control ARL in hours (arl), and since when the evidence accumulated.
_SEQUENTIAL_KEYS: Final = frozenset(
    {"field", "value", "rate", "threshold", "statistic", "limit", "arl", "since", "evidence_state"}
)
SUMMARY_KEYS: Final[Mapping[str, frozenset[str]]] = types.MappingProxyType(
    {
        "event": _COMMON_KEYS | _GPU_KEYS | {"xid", "code", "message"},
        "event_repeat": _COMMON_KEYS | _GPU_KEYS | {"xid", "code", "message", "count", "window"},
        "field:gpu": _COMMON_KEYS | _GPU_KEYS | {"field", "value", "threshold"},
        "field:nic": _COMMON_KEYS | _NIC_KEYS | {"field", "value", "threshold"},
        "rate:gpu": _COMMON_KEYS | _GPU_KEYS | {"field", "value", "rate", "threshold", "window"},
        "rate:nvlink": _COMMON_KEYS | _GPU_KEYS | {"field", "value", "rate", "threshold", "window"},
        "rate:nic": _COMMON_KEYS | _NIC_KEYS | {"field", "value", "rate", "threshold", "window"},
        "sequential:gpu": _COMMON_KEYS | _GPU_KEYS | _SEQUENTIAL_KEYS,
        "sequential:nvlink": _COMMON_KEYS | _GPU_KEYS | _SEQUENTIAL_KEYS,
        "sequential:nic": _COMMON_KEYS | _NIC_KEYS | _SEQUENTIAL_KEYS,
        "share": _COMMON_KEYS | _GPU_KEYS | {"field", "value", "share", "threshold", "window", "count"},
        "gpu_missing": _COMMON_KEYS | _GPU_KEYS | {"value", "threshold"},
        "error": _COMMON_KEYS | _GPU_KEYS | {"collector", "message"},
    }
)
_DEFAULT_SUMMARIES: Final[Mapping[str, str]] = types.MappingProxyType(
    {
        "event": "GPU {gpu} ({uuid}) XID {xid} at {time}: {message}",
        "event_repeat": "GPU {gpu} ({uuid}) XID {xid} {count} times in {window}",
        "field:gpu": "GPU {gpu} ({uuid}) {field} is {value} (threshold {threshold})",
        "field:nic": "{device}/{port} {field} is {value} (threshold {threshold})",
        "rate:gpu": "GPU {gpu} ({uuid}) {field} at {rate} over {window} (threshold {threshold})",
        "rate:nvlink": "GPU {gpu} ({uuid}) NVLink {field} at {rate} over {window} (threshold {threshold})",
        "rate:nic": "{device}/{port} {field} at {rate} over {window} (threshold {threshold})",
        "sequential:gpu": "GPU {gpu} ({uuid}) {field} at {rate} since {since}, budget {threshold}",
        "sequential:nvlink": "GPU {gpu} ({uuid}) NVLink {field} at {rate} since {since}, budget {threshold}",
        "sequential:nic": "{device}/{port} {field} at {rate} since {since}, budget {threshold}",
        "share": "GPU {gpu} ({uuid}) {field} matched in {share} of samples over {window}",
        "gpu_missing": "GPU {gpu} ({uuid}) is gone: {value} of {threshold} GPUs reported",
        "error": "{collector}: {message}",
    }
)


# ---------------------------------------------------------------------------------------------
# Rule objects


@dataclass(frozen=True, slots=True)
class Template:
    """A summary with ``{key}`` placeholders, split once into literal text and keys."""

    text: str
    parts: tuple[tuple[str, str | None], ...]  # (literal, key or None)

    def render(self, values: Mapping[str, str]) -> str:
        return "".join(lit + values[key] if key is not None else lit for lit, key in self.parts)

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(key for _, key in self.parts if key is not None)


@dataclass(frozen=True, slots=True)
class Condition:
    """``field op value``, ``field op value_of`` (another field of the same GPU/NIC), or a flag test."""

    field: str
    op: Op
    value: float | bool | str | frozenset[str] | int | None = None
    value_of: str | None = None

    def describe(self) -> str:
        if self.op in ("is_true", "is_false"):
            return f"{self.field} {self.op}"
        if self.value_of is not None:
            return f"{self.field} {self.op} {self.value_of}"
        value = sorted(self.value) if isinstance(self.value, frozenset) else self.value
        if self.op == "any_bits" and isinstance(value, int):
            value = hex(value)
        return f"{self.field} {self.op} {value}"


@dataclass(frozen=True, slots=True)
class GpuSelector:
    index: frozenset[int] | None = None
    model: re.Pattern[str] | None = None


@dataclass(frozen=True, slots=True)
class NicSelector:
    link_layer: str | None = None
    rdma: bool | None = None  # True: RDMA ports (port is set); False: netdevs (port is null)
    device: re.Pattern[str] | None = None


@dataclass(frozen=True, slots=True)
class Repeat:
    """The same event on the same GPU at least ``count`` times ``apart`` within ``within_s``.

    ``alone``: only while no other GPU of the node showed a matching event in the window.
    """

    count: int
    within_s: float
    apart_s: float
    alone: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleBase:
    name: str
    description: str
    severity: Severity
    action: Action
    hard: bool
    clears: Clears
    summary: Template
    runbook_url: str | None
    enabled: bool
    # shadow: evaluated, shown in the API and counted, but never changes a node's state (a rule on
    # trial). taint_effect: what a quarantine by this rule asks of the scheduler; NoExecute also
    # needs remediation.allow_no_execute.
    shadow: bool
    taint_effect: TaintEffectName
    source: Path  # the file it came from, for messages


@dataclass(frozen=True, slots=True, kw_only=True)
class EventRule(RuleBase):
    events: EventKind
    codes: frozenset[int]
    match: re.Pattern[str] | None
    gpus: GpuSelector | None
    hold_s: float  # clears "condition": active this long after the last matching event
    repeat: Repeat | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldRule(RuleBase):
    target: Literal["gpu", "nic"]
    condition: Condition
    for_s: float
    when: Condition | None
    gpus: GpuSelector | None
    nics: NicSelector | None
    # The rule holds for a GPU/NIC only once one of these has held for it at some report (the
    # aggregator remembers it across the node's reboots): a port judged down only once it was
    # known to be up. Empty: from the first report.
    after: tuple[Condition, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RateRule(RuleBase):
    target: Target
    field: str  # a GPU/NVLink counter field, or a NIC counter name (without "driver:")
    op: CompareOp
    value: float | None  # threshold in events per ``per``
    max_ber: float | None  # NIC only: threshold = max_ber * the port's link rate in bits/s
    window_s: float  # test "window": how far back; 0 for a sequential rule (it has none)
    per: Per
    for_s: float
    when: Condition | None
    gpus: GpuSelector | None
    nics: NicSelector | None
    # "window": the increase over ``window_s`` against the threshold. "sequential": a Poisson
    # CUSUM of the counts against the threshold as a budget (aggregator/rules/sequential.py).
    test: RateTest = "window"
    design_ratio: float = DEFAULT_DESIGN_RATIO  # sequential: the alternative is this x the budget
    arl_hours: float = DEFAULT_ARL_HOURS  # sequential: mean time between decisions at the budget

    @property
    def per_s(self) -> float:
        return PER_SECONDS[self.per]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareRule(RuleBase):
    condition: Condition  # tested on each sample of the window
    when: Condition | None  # a sample counts only when this also holds (e.g. under load)
    share: float
    window_s: float
    min_samples: int
    gpus: GpuSelector | None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuMissingRule(RuleBase):
    """A GPU seen earlier in this boot is missing from the report."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorRule(RuleBase):
    """A collector error; every filter given must hold (at least ``codes`` or ``match``)."""

    collector: str | None
    codes: frozenset[str] | None  # the error's code (``CollectorError.code``) is one of these
    match: re.Pattern[str] | None  # on the message; a named group "gpu" makes the finding per GPU


Rule: TypeAlias = EventRule | FieldRule | RateRule | ShareRule | GpuMissingRule | ErrorRule

KINDS: Final = ("event", "field", "rate", "share", "gpu_missing", "error")


# ---------------------------------------------------------------------------------------------
# YAML loading


class _Map(dict[Any, Any]):
    """A YAML mapping that remembers its line, so messages can point at it."""

    line: int = 0


def _make_loader() -> type[yaml.SafeLoader]:
    base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[valid-type,misc]
        pass

    def construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Iterable[_Map]:
        data = _Map()
        data.line = node.start_mark.line + 1
        yield data
        loader.flatten_mapping(node)
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in data:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            data[key] = loader.construct_object(value_node, deep=True)

    Loader.add_constructor("tag:yaml.org,2002:map", construct_map)
    return Loader


_LOADER: Final = _make_loader()


def load_rules(paths: Sequence[Path]) -> list[Rule]:
    """Parse and validate rule files (a directory stands for its ``*.yaml``/``*.yml`` files).

    Raises ``RuleError`` for the first problem found. Disabled rules are returned too (with
    ``enabled`` false) so that tools can list them; the engine skips them.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()))
        else:
            files.append(path)
    rules: list[Rule] = []
    seen: dict[str, Path] = {}
    for file in files:
        for rule in _load_file(file):
            if rule.name in seen:
                where = "earlier in this file" if seen[rule.name] == file else f"in {seen[rule.name]}"
                raise RuleError(
                    f"{file}: rule {rule.name!r}: name: duplicate rule name (also defined {where})",
                    path=file,
                    rule=rule.name,
                    key="name",
                )
            seen[rule.name] = file
            rules.append(rule)
    log.info(
        "rules loaded",
        extra={
            "files": [str(f) for f in files],
            "rules": len(rules),
            "enabled": sum(r.enabled for r in rules),
        },
    )
    return rules


def _load_file(path: Path) -> list[Rule]:
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise RuleError(f"{path}: cannot read rule file: {exc.strerror or exc}", path=path) from exc
    except UnicodeDecodeError as exc:
        raise RuleError(f"{path}: rule file is not UTF-8: {exc}", path=path) from exc
    try:
        doc = yaml.load(text, Loader=_LOADER)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        raise RuleError(f"{path}: not valid YAML: {exc}", path=path) from exc
    if not isinstance(doc, dict):
        raise RuleError(f"{path}: expected a mapping with a 'rules:' list at the top", path=path)
    extra = [k for k in doc if k != "rules"]
    if extra:
        raise RuleError(f"{path}: unknown top-level key {extra[0]!r} (only 'rules' is allowed)", path=path)
    items = doc.get("rules")
    if not isinstance(items, list):
        raise RuleError(f"{path}: 'rules' must be a list of rules", path=path)
    return [_parse_rule(path, index, item) for index, item in enumerate(items, start=1)]


# ---------------------------------------------------------------------------------------------
# Parsing one rule

_NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_DURATION_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS: Final[Mapping[str, float]] = types.MappingProxyType(
    {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
)
_CODE_RANGE_RE: Final = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
_MAX_CODE: Final = 4096

_COMMON_KEYS_ALLOWED: Final = frozenset(
    {
        "name",
        "kind",
        "description",
        "severity",
        "action",
        "hard",
        "clears",
        "summary",
        "runbook_url",
        "enabled",
        "shadow",
        "taint_effect",
    }
)
_CONDITION_KEYS: Final = frozenset({"field", "op", "value", "value_of"})
_KIND_KEYS: Final[Mapping[str, frozenset[str]]] = types.MappingProxyType(
    {
        "event": frozenset({"events", "codes", "match", "gpus", "hold", "repeat"}),
        "field": frozenset({"target", "for", "when", "after", "gpus", "nics"}) | _CONDITION_KEYS,
        "rate": frozenset({"target", "field", "op", "value", "max_ber", "window", "per", "for", "when"})
        | frozenset({"gpus", "nics", "test", "design_ratio", "arl_hours"}),
        "share": frozenset({"target", "share", "window", "min_samples", "when", "gpus"}) | _CONDITION_KEYS,
        "gpu_missing": frozenset(),
        "error": frozenset({"collector", "code", "match"}),
    }
)


class _Ctx:
    """Where we are in a file, for messages that point at the rule and the key."""

    def __init__(self, path: Path, index: int, line: int) -> None:
        self.path = path
        self.index = index
        self.line = line
        self.name: str | None = None

    def fail(self, key: str | None, problem: str) -> NoReturn:
        who = f"rule {self.name!r}" if self.name else f"rule #{self.index}"
        where = f" (line {self.line})" if self.line else ""
        at = f"{key}: " if key else ""
        raise RuleError(f"{self.path}: {who}{where}: {at}{problem}", path=self.path, rule=self.name, key=key)


def _parse_rule(path: Path, index: int, item: Any) -> Rule:
    ctx = _Ctx(path, index, getattr(item, "line", 0))
    if not isinstance(item, dict):
        ctx.fail(None, f"expected a mapping of keys, got {type(item).__name__}")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        ctx.fail("name", "required: lowercase letters, digits, '.', '_' or '-', at most 63 characters")
    ctx.name = name
    for key in item:
        if not isinstance(key, str):
            hint = " (YAML reads on/off/yes/no as booleans)" if isinstance(key, bool) else ""
            ctx.fail(None, f"key {key!r} is not a name{hint}")
    kind = item.get("kind")
    if kind not in KINDS:
        ctx.fail("kind", f"required, one of {', '.join(KINDS)}; got {kind!r}")
    allowed = _COMMON_KEYS_ALLOWED | _KIND_KEYS[kind]
    for key in item:
        if key not in allowed:
            ctx.fail(key, f"unknown key for a {kind} rule{_suggest(key, allowed)}")

    severity = _choice(ctx, item, "severity", SEVERITIES, None)
    action = _choice(ctx, item, "action", ACTIONS, None)
    hard = _bool(ctx, item, "hard", False)
    if hard and action != "quarantine":
        ctx.fail("hard", "only a quarantine rule can be hard")
    clears = _choice(ctx, item, "clears", CLEARS, "reboot" if kind == "event" else "condition")
    enabled = _bool(ctx, item, "enabled", True)
    shadow = _bool(ctx, item, "shadow", False)
    taint_effect = _choice(ctx, item, "taint_effect", TAINT_EFFECTS, "NoSchedule")
    if taint_effect != "NoSchedule" and action != "quarantine":
        ctx.fail("taint_effect", "only a quarantine rule taints")
    description = _text(ctx, item, "description", "")
    runbook_url = _url(ctx, item)
    common: dict[str, Any] = {
        "name": name,
        "description": description,
        "severity": severity,
        "action": action,
        "hard": hard,
        "clears": clears,
        "runbook_url": runbook_url,
        "enabled": enabled,
        "shadow": shadow,
        "taint_effect": taint_effect,
        "source": path,
    }
    if kind == "event":
        return _parse_event(ctx, item, common)
    if kind == "field":
        return _parse_field(ctx, item, common)
    if kind == "rate":
        return _parse_rate(ctx, item, common)
    if kind == "share":
        return _parse_share(ctx, item, common)
    if kind == "gpu_missing":
        return GpuMissingRule(**common, summary=_summary(ctx, item, "gpu_missing"))
    return _parse_error(ctx, item, common)


def _parse_event(ctx: _Ctx, item: Mapping[str, Any], common: dict[str, Any]) -> EventRule:
    events = _choice(ctx, item, "events", frozenset({"xid", "sxid"}), "xid")
    codes = _codes(ctx, item.get("codes"))
    repeat = _repeat(ctx, item.get("repeat")) if "repeat" in item else None
    hold_s = 0.0
    if "hold" in item:
        if common["clears"] != "condition":
            ctx.fail("hold", "only applies to a rule that clears on 'condition'")
        hold_s = _duration(ctx, "hold", item["hold"], allow_zero=True)
    if repeat is not None and "hold" in item:
        ctx.fail("hold", "a repeat rule holds for its 'within' window; leave 'hold' out")
    return EventRule(
        **common,
        summary=_summary(ctx, item, "event_repeat" if repeat is not None else "event"),
        events=events,
        codes=codes,
        match=_regex(ctx, "match", item["match"]) if "match" in item else None,
        gpus=_gpu_selector(ctx, item.get("gpus")),
        hold_s=hold_s,
        repeat=repeat,
    )


def _one_selector(ctx: _Ctx, item: Mapping[str, Any], target: str, gpu_targets: str) -> None:
    """A rule on NICs takes no GPU selector and one on GPUs (``gpu_targets``) no NIC selector."""
    if target != "nic" and "nics" in item:
        ctx.fail("nics", "only applies to target: nic")
    if target == "nic" and "gpus" in item:
        ctx.fail("gpus", f"only applies to target: {gpu_targets}")


def _entity_scope(ctx: _Ctx, item: Mapping[str, Any], fields: Mapping[str, FieldType]) -> dict[str, Any]:
    """What a field and a rate rule both take: how long it must hold, its guard, its selectors."""
    return {
        "for_s": _duration(ctx, "for", item["for"], allow_zero=True) if "for" in item else 0.0,
        "when": _when(ctx, item, fields),
        "gpus": _gpu_selector(ctx, item.get("gpus")),
        "nics": _nic_selector(ctx, item.get("nics")),
    }


def _parse_field(ctx: _Ctx, item: Mapping[str, Any], common: dict[str, Any]) -> FieldRule:
    target = _choice(ctx, item, "target", frozenset({"gpu", "nic"}), None)
    fields = GPU_FIELDS if target == "gpu" else NIC_FIELDS
    condition = _condition(ctx, item, fields, key_prefix="")
    _one_selector(ctx, item, target, "gpu")
    return FieldRule(
        **common,
        summary=_summary(ctx, item, f"field:{target}"),
        target=target,
        condition=condition,
        after=_after(ctx, item, fields),
        **_entity_scope(ctx, item, fields),
    )


def _parse_rate(ctx: _Ctx, item: Mapping[str, Any], common: dict[str, Any]) -> RateRule:
    target = _choice(ctx, item, "target", frozenset({"gpu", "nvlink", "nic"}), None)
    field = item.get("field")
    if not isinstance(field, str):
        ctx.fail("field", "required: the counter to take the rate of")
    if target == "gpu":
        if field not in GPU_COUNTERS:
            problem = "is a gauge, not a counter" if field in GPU_FIELDS else "is not a GPU counter field"
            ctx.fail("field", f"{field!r} {problem}{_suggest(field, GPU_COUNTERS)}")
    elif target == "nvlink":
        if field not in NVLINK_COUNTERS:
            ctx.fail("field", f"{field!r} is not an NVLink counter{_suggest(field, NVLINK_COUNTERS)}")
    elif field.startswith(DRIVER_PREFIX):
        field = field[len(DRIVER_PREFIX) :]
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", field):
            ctx.fail("field", f"{field!r} is not a counter file name")
    elif field not in NIC_COUNTERS and field not in NIC_TOTALS:
        ctx.fail(
            "field",
            f"unknown NIC counter {field!r}{_suggest(field, NIC_COUNTERS | NIC_TOTALS)}"
            f" (a driver counter not in the well-known list is named as '{DRIVER_PREFIX}NAME')",
        )
    op = _choice(ctx, item, "op", COMPARE_OPS, None)
    value: float | None = None
    max_ber: float | None = None
    if "max_ber" in item:
        if target != "nic":
            ctx.fail(
                "max_ber", "only applies to target: nic (the threshold scales with the port's link rate)"
            )
        if "value" in item:
            ctx.fail("max_ber", "give either 'value' or 'max_ber', not both")
        max_ber = _number(ctx, "max_ber", item["max_ber"])
        if not 0 < max_ber < 1:
            ctx.fail("max_ber", f"a bit error ratio is between 0 and 1, got {max_ber}")
    elif "value" in item:
        value = _number(ctx, "value", item["value"])
    else:
        ctx.fail("value", "required: the threshold, in events per 'per'")
    per = _choice(ctx, item, "per", frozenset(PER_SECONDS), "second")
    fields = NIC_FIELDS if target == "nic" else GPU_FIELDS
    _one_selector(ctx, item, target, "gpu or nvlink")
    test = _choice(ctx, item, "test", frozenset({"window", "sequential"}), "window")
    if test == "sequential":
        return _parse_sequential(ctx, item, common, target=target, field=field, value=value, max_ber=max_ber)
    for key in ("design_ratio", "arl_hours"):
        if key in item:
            ctx.fail(key, "only applies to test: sequential")
    if "window" not in item:
        ctx.fail("window", "required: how far back the rate looks, e.g. 10m")
    return RateRule(
        **common,
        summary=_summary(ctx, item, f"rate:{target}"),
        target=target,
        field=field,
        op=op,
        value=value,
        max_ber=max_ber,
        window_s=_duration(ctx, "window", item["window"]),
        per=per,
        **_entity_scope(ctx, item, fields),
    )


def _parse_sequential(
    ctx: _Ctx,
    item: Mapping[str, Any],
    common: dict[str, Any],
    *,
    target: Target,
    field: str,
    value: float | None,
    max_ber: float | None,
) -> RateRule:
    """A rate rule with ``test: sequential``: its threshold is a budget the counts are tested
    against as they come (aggregator/rules/sequential.py), with no window."""
    if item["op"] != ">":
        ctx.fail("op", "a sequential test decides that a rate is above its budget: op must be '>'")
    if "window" in item:
        ctx.fail("window", "a sequential test has no window: it decides on the evidence so far")
    if "when" in item:
        ctx.fail("when", "a sequential test reads every report's counter; it takes no guard")
    if value is not None and not value > 0:
        ctx.fail("value", "a sequential test needs a budget above zero (for 'any increase', use a window)")
    ratio = DEFAULT_DESIGN_RATIO
    if "design_ratio" in item:
        ratio = _number(ctx, "design_ratio", item["design_ratio"])
    if not 1 < ratio <= 100:
        ctx.fail("design_ratio", f"the excess to decide quickly, above 1 (and at most 100); got {ratio}")
    arl = _number(ctx, "arl_hours", item["arl_hours"]) if "arl_hours" in item else DEFAULT_ARL_HOURS
    if not 1 <= arl <= 1e9:
        ctx.fail("arl_hours", f"hours between false decisions at the budget, 1 to 1e9; got {arl}")
    return RateRule(
        **common,
        summary=_summary(ctx, item, f"sequential:{target}"),
        target=target,
        field=field,
        op=">",
        value=value,
        max_ber=max_ber,
        window_s=0.0,
        per=_choice(ctx, item, "per", frozenset(PER_SECONDS), "second"),
        **_entity_scope(ctx, item, NIC_FIELDS if target == "nic" else GPU_FIELDS),
        test="sequential",
        design_ratio=ratio,
        arl_hours=arl,
    )


def _parse_share(ctx: _Ctx, item: Mapping[str, Any], common: dict[str, Any]) -> ShareRule:
    _choice(ctx, item, "target", frozenset({"gpu"}), "gpu")
    condition = _condition(ctx, item, GPU_FIELDS, key_prefix="")
    if condition.value_of is not None:
        ctx.fail("value_of", "a share rule compares each sample with a constant")
    if GPU_FIELDS[condition.field] == "str":
        ctx.fail("field", f"{condition.field!r} is text; a share rule samples numbers and flags")
    share = _number(ctx, "share", item.get("share")) if "share" in item else ctx.fail("share", "required")
    if not 0 < share <= 1:
        ctx.fail("share", f"a fraction of the window's samples, above 0 and at most 1; got {share}")
    if "window" not in item:
        ctx.fail("window", "required: the window the share is taken over, e.g. 10m")
    when = _when(ctx, item, GPU_FIELDS)
    if when is not None and (when.value_of is not None or GPU_FIELDS[when.field] == "str"):
        ctx.fail("when", "a share rule's guard compares each numeric sample with a constant")
    min_samples = item.get("min_samples", 3)
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        ctx.fail("min_samples", f"a whole number of samples, at least 1; got {min_samples!r}")
    return ShareRule(
        **common,
        summary=_summary(ctx, item, "share"),
        condition=condition,
        when=when,
        share=share,
        window_s=_duration(ctx, "window", item["window"]),
        min_samples=min_samples,
        gpus=_gpu_selector(ctx, item.get("gpus")),
    )


def _parse_error(ctx: _Ctx, item: Mapping[str, Any], common: dict[str, Any]) -> ErrorRule:
    collector = item.get("collector")
    if collector is not None and (not isinstance(collector, str) or not collector):
        ctx.fail("collector", "the collector's name as the report's errors give it, e.g. nvml")
    if "match" not in item and "code" not in item:
        ctx.fail("code", f"required (or match): one of {', '.join(sorted(ERROR_CODES))}, or a list")
    codes = _error_codes(ctx, item["code"]) if "code" in item else None
    pattern = _regex(ctx, "match", item["match"]) if "match" in item else None
    unknown = set(pattern.groupindex) - {"gpu"} if pattern is not None else set()
    if unknown:
        ctx.fail("match", f"the only named group allowed is 'gpu', got {sorted(unknown)}")
    return ErrorRule(
        **common, summary=_summary(ctx, item, "error"), collector=collector, codes=codes, match=pattern
    )


def _error_codes(ctx: _Ctx, value: Any) -> frozenset[str]:
    items = value if isinstance(value, list) else [value]
    if not items:
        ctx.fail("code", "at least one code")
    for entry in items:
        if not isinstance(entry, str) or entry not in ERROR_CODES:
            ctx.fail(
                "code",
                f"{entry!r} is not a collector error code{_suggest(str(entry), ERROR_CODES)};"
                f" the codes are {', '.join(sorted(ERROR_CODES))}",
            )
    return frozenset(items)


# ---------------------------------------------------------------------------------------------
# Values


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _choice(
    ctx: _Ctx, item: Mapping[str, Any], key: str, choices: frozenset[str], default: str | None
) -> Any:
    value = item.get(key, default)
    if value is None:
        ctx.fail(key, f"required, one of {', '.join(sorted(choices))}")
    if value not in choices:
        ctx.fail(key, f"{value!r} is not one of {', '.join(sorted(choices))}")
    return value


def _bool(ctx: _Ctx, item: Mapping[str, Any], key: str, default: bool) -> bool:
    value = item.get(key, default)
    if not isinstance(value, bool):
        ctx.fail(key, f"expected true or false, got {value!r}")
    return value


def _text(ctx: _Ctx, item: Mapping[str, Any], key: str, default: str) -> str:
    value = item.get(key, default)
    if not isinstance(value, str):
        ctx.fail(key, f"expected text, got {type(value).__name__}")
    return value.strip()


def _url(ctx: _Ctx, item: Mapping[str, Any]) -> str | None:
    value = item.get("runbook_url")
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^https?://\S+$", value):
        ctx.fail("runbook_url", f"expected an http(s) URL, got {value!r}")
    return value


def _number(ctx: _Ctx, key: str, value: Any) -> float:
    # YAML 1.1 reads 1e-12 (no dot) as text; accept it rather than make operators write 1.0e-12.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            ctx.fail(key, f"expected a number, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        ctx.fail(key, f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        ctx.fail(key, f"expected a finite number, got {value!r}")
    return number


def _duration(ctx: _Ctx, key: str, value: Any, *, allow_zero: bool = False) -> float:
    """Seconds from ``30s``, ``5m``, ``6h``, ``1d``, ``250ms`` or a plain number of seconds."""
    seconds: float
    if isinstance(value, bool):
        ctx.fail(key, f"expected a duration like 30s, 5m or 6h, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        ctx.fail(key, f"expected a duration like 30s, 5m or 6h, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        ctx.fail(key, f"expected a positive duration, got {value!r}")
    return seconds


def _regex(ctx: _Ctx, key: str, value: Any) -> re.Pattern[str]:
    if not isinstance(value, str) or not value:
        ctx.fail(key, f"expected a regular expression, got {value!r}")
    try:
        return re.compile(value)
    except re.error as exc:
        ctx.fail(key, f"bad regular expression {value!r}: {exc}")


def _codes(ctx: _Ctx, value: Any) -> frozenset[int]:
    if value is None:
        ctx.fail("codes", "required: a list of codes, e.g. [79] or [13, 31, '144-150']")
    items = value if isinstance(value, list) else [value]
    codes: set[int] = set()
    for entry in items:
        if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry <= _MAX_CODE:
            codes.add(entry)
        elif isinstance(entry, str) and (m := _CODE_RANGE_RE.match(entry)):
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi or hi > _MAX_CODE:
                ctx.fail("codes", f"bad range {entry!r}")
            codes.update(range(lo, hi + 1))
        else:
            ctx.fail("codes", f"{entry!r} is not a code (0-{_MAX_CODE}) or a range like '144-150'")
    if not codes:
        ctx.fail("codes", "at least one code")
    return frozenset(codes)


def _repeat(ctx: _Ctx, value: Any) -> Repeat:
    if not isinstance(value, dict):
        ctx.fail("repeat", "expected a mapping with count, within, apart and alone")
    for key in value:
        if key not in ("count", "within", "apart", "alone"):
            ctx.fail(
                f"repeat.{key}", f"unknown key{_suggest(str(key), ('count', 'within', 'apart', 'alone'))}"
            )
    count = value.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 2:
        ctx.fail("repeat.count", f"a whole number, at least 2; got {count!r}")
    if "within" not in value:
        ctx.fail("repeat.within", "required: the window the occurrences must fall in, e.g. 6h")
    within = _duration(ctx, "repeat.within", value["within"])
    apart = _duration(ctx, "repeat.apart", value.get("apart", 0), allow_zero=True)
    if apart * (count - 1) > within:
        ctx.fail("repeat.apart", f"{count} occurrences {apart:g}s apart cannot fit in {within:g}s")
    alone = value.get("alone", False)
    if not isinstance(alone, bool):
        ctx.fail("repeat.alone", f"expected true or false, got {alone!r}")
    return Repeat(count=count, within_s=within, apart_s=apart, alone=alone)


def _after(ctx: _Ctx, item: Mapping[str, Any], fields: Mapping[str, FieldType]) -> tuple[Condition, ...]:
    """``after:``: one condition (a mapping) or a list of them, any of which arms the rule."""
    if "after" not in item:
        return ()
    value = item["after"]
    if not isinstance(value, list):
        return (_guard_condition(ctx, value, fields, "after"),)
    if not value:
        ctx.fail("after", "expected a condition or a list of conditions, got an empty list")
    return tuple(_guard_condition(ctx, cond, fields, f"after[{i}]") for i, cond in enumerate(value))


def _when(ctx: _Ctx, item: Mapping[str, Any], fields: Mapping[str, FieldType]) -> Condition | None:
    return _guard_condition(ctx, item["when"], fields, "when") if "when" in item else None


def _guard_condition(ctx: _Ctx, value: Any, fields: Mapping[str, FieldType], where: str) -> Condition:
    """A condition given as its own mapping (``when:``, ``after:``), its keys checked."""
    if not isinstance(value, dict):
        ctx.fail(where, "expected a mapping with field, op and value")
    for key in value:
        if key not in _CONDITION_KEYS:
            ctx.fail(f"{where}.{key}", f"unknown key{_suggest(str(key), _CONDITION_KEYS)}")
    return _condition(ctx, value, fields, key_prefix=f"{where}.")


_NUMERIC_OPS: Final = frozenset({">", ">=", "<", "<=", "==", "!="})
_OPS_BY_TYPE: Final[Mapping[FieldType, frozenset[str]]] = types.MappingProxyType(
    {
        "int": _NUMERIC_OPS | {"any_bits"},
        "float": _NUMERIC_OPS,
        "bool": frozenset({"is_true", "is_false"}),
        "str": frozenset({"==", "!=", "in", "not_in"}),
    }
)


def _condition(
    ctx: _Ctx, item: Mapping[str, Any], fields: Mapping[str, FieldType], *, key_prefix: str
) -> Condition:
    field = item.get("field")
    if not isinstance(field, str):
        ctx.fail(f"{key_prefix}field", "required: the field to test")
    ftype = fields.get(field)
    if ftype is None:
        ctx.fail(f"{key_prefix}field", f"unknown field {field!r}{_suggest(field, fields)}")
    op = item.get("op")
    allowed = _OPS_BY_TYPE[ftype]
    if op not in allowed:
        ctx.fail(
            f"{key_prefix}op",
            f"{op!r} does not apply to {ftype} field {field!r}; use one of {sorted(allowed)}",
        )
    has_value, has_other = "value" in item, "value_of" in item
    if op in ("is_true", "is_false"):
        if has_value or has_other:
            ctx.fail(f"{key_prefix}value", f"'{op}' takes no value")
        return Condition(field=field, op=op)
    if has_value == has_other:
        ctx.fail(f"{key_prefix}value", "give exactly one of 'value' or 'value_of'")
    if has_other:
        other = item["value_of"]
        if not isinstance(other, str) or other not in fields:
            ctx.fail(f"{key_prefix}value_of", f"unknown field {other!r}{_suggest(str(other), fields)}")
        otype = fields[other]
        if op not in _NUMERIC_OPS or (ftype == "str") != (otype == "str") or otype == "bool":
            ctx.fail(f"{key_prefix}value_of", f"cannot compare {ftype} {field!r} {op} {otype} {other!r}")
        return Condition(field=field, op=op, value_of=other)
    raw = item["value"]
    key = f"{key_prefix}value"
    if op == "any_bits":
        return Condition(field=field, op=op, value=_bits(ctx, key, raw))
    if op in ("in", "not_in"):
        if not isinstance(raw, list) or not raw or not all(isinstance(v, str) for v in raw):
            ctx.fail(key, f"'{op}' takes a list of names, e.g. [ACTIVE]")
        return Condition(field=field, op=op, value=frozenset(raw))
    if ftype == "str":
        if not isinstance(raw, str):
            ctx.fail(key, f"{field!r} is text; compare it with text, got {raw!r}")
        return Condition(field=field, op=op, value=raw)
    return Condition(field=field, op=op, value=_number(ctx, key, raw))


def _bits(ctx: _Ctx, key: str, raw: Any) -> int:
    items = raw if isinstance(raw, list) else [raw]
    mask = 0
    for entry in items:
        if isinstance(entry, int) and not isinstance(entry, bool) and entry > 0:
            mask |= entry
        elif isinstance(entry, str) and entry in CLOCK_EVENT_BITS:
            mask |= CLOCK_EVENT_BITS[entry]
        else:
            ctx.fail(
                key,
                f"{entry!r} is neither a positive bit mask nor a clock event reason"
                f"{_suggest(str(entry), CLOCK_EVENT_BITS)}",
            )
    if mask == 0:
        ctx.fail(key, "at least one bit")
    return mask


def _gpu_selector(ctx: _Ctx, value: Any) -> GpuSelector | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        ctx.fail("gpus", "expected a mapping with index and/or model")
    for key in value:
        if key not in ("index", "model"):
            ctx.fail(f"gpus.{key}", f"unknown key{_suggest(str(key), ('index', 'model'))}")
    index: frozenset[int] | None = None
    if "index" in value:
        raw = value["index"]
        entries = raw if isinstance(raw, list) else [raw]
        if not entries or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= 63 for i in entries
        ):
            ctx.fail("gpus.index", f"expected GPU indices 0-63, got {raw!r}")
        index = frozenset(entries)
    model = _regex(ctx, "gpus.model", value["model"]) if "model" in value else None
    return GpuSelector(index=index, model=model)


def _nic_selector(ctx: _Ctx, value: Any) -> NicSelector | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        ctx.fail("nics", "expected a mapping with link_layer, rdma and/or device")
    keys = ("link_layer", "rdma", "device")
    for key in value:
        if key not in keys:
            ctx.fail(f"nics.{key}", f"unknown key{_suggest(str(key), keys)}")
    link_layer = value.get("link_layer")
    if link_layer is not None and link_layer not in ("InfiniBand", "Ethernet"):
        ctx.fail("nics.link_layer", f"InfiniBand or Ethernet, got {link_layer!r}")
    rdma = value.get("rdma")
    if rdma is not None and not isinstance(rdma, bool):
        ctx.fail("nics.rdma", f"expected true or false, got {rdma!r}")
    device = _regex(ctx, "nics.device", value["device"]) if "device" in value else None
    return NicSelector(link_layer=link_layer, rdma=rdma, device=device)


def _summary(ctx: _Ctx, item: Mapping[str, Any], kind_key: str) -> Template:
    text = item.get("summary", _DEFAULT_SUMMARIES[kind_key])
    if not isinstance(text, str) or not text.strip():
        ctx.fail("summary", "expected a text template, e.g. 'GPU {gpu} XID {xid}'")
    allowed = SUMMARY_KEYS[kind_key]
    parts: list[tuple[str, str | None]] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        ctx.fail("summary", f"bad template {text!r}: {exc} (write {{{{ and }}}} for literal braces)")
    for literal, key, spec, conversion in parsed:
        if key is None:
            parts.append((literal, None))
            continue
        if spec or conversion:
            ctx.fail("summary", f"placeholder {{{key}}} takes no format or conversion; values come formatted")
        if key not in allowed:
            ctx.fail(
                "summary",
                f"unknown placeholder {{{key}}}{_suggest(key, allowed)};"
                f" this rule kind has {sorted(allowed)}",
            )
        parts.append((literal, key))
    return Template(text=text, parts=tuple(parts))
