"""Rule files: a good file parses into typed rules; every bad one is refused at load, naming the
file, the rule and the key, before the aggregator evaluates anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.errors import ConfigError
from aggregator.rules import (
    ErrorRule,
    EventRule,
    FieldRule,
    GpuMissingRule,
    RateRule,
    RuleError,
    ShareRule,
    default_rules_dir,
    load_rules,
)
from aggregator.rules.model import CLOCK_EVENT_BITS
from tests.rulekit import rules_from_yaml

GOOD = """
rules:
  - name: xid-79
    kind: event
    codes: [79, "144-146"]
    match: "fallen"
    gpus: {index: [0, 3], model: "H100"}
    severity: critical
    action: quarantine
    hard: true
    summary: "GPU {gpu} ({uuid}) XID {xid} at {time}"
    runbook_url: https://example.com/xid
    description: fell off the bus
  - name: app-repeat
    kind: event
    events: xid
    codes: 13
    severity: warning
    action: alert
    clears: condition
    repeat: {count: 3, within: 6h, apart: 10m, alone: true}
  - name: hot
    kind: field
    target: gpu
    field: temperature_celsius
    op: ">="
    value: 85
    for: 5m
    when: {field: utilization_ratio, op: ">=", value: 0.5}
    severity: warning
    action: alert
  - name: narrow
    kind: field
    target: gpu
    field: pcie_link_width
    op: "<"
    value_of: pcie_link_width_max
    severity: warning
    action: quarantine
    enabled: false
  - name: port-down
    kind: field
    target: nic
    nics: {rdma: true, link_layer: InfiniBand, device: "^mlx5_"}
    field: state
    op: not_in
    value: [ACTIVE]
    for: 30s
    severity: critical
    action: quarantine
  - name: symbols
    kind: rate
    target: nic
    field: symbol_error
    per: hour
    window: 30m
    op: ">"
    max_ber: 1e-12
    severity: warning
    action: quarantine
  - name: vendor-counter
    kind: rate
    target: nic
    field: "driver:np_cnp_sent_v2"
    window: 90
    op: ">="
    value: 5
    severity: info
    action: none
  - name: crc
    kind: rate
    target: nvlink
    field: crc_flit_errors_total
    window: 5m
    op: ">="
    value: 100
    severity: critical
    action: quarantine
  - name: slow
    kind: share
    field: clock_event_reasons
    op: any_bits
    value: [hw_slowdown, 0x40]
    when: {field: utilization_ratio, op: ">=", value: 0.5}
    share: 0.5
    window: 10m
    severity: warning
    action: quarantine
  - name: missing
    kind: gpu_missing
    severity: critical
    action: quarantine
    hard: true
  - name: lost
    kind: error
    collector: nvml
    match: "GPU (?P<gpu>\\\\d+).*GPU is lost"
    severity: critical
    action: quarantine
"""


def test_good_file_parses_into_typed_rules(tmp_path: Path) -> None:
    rules = {r.name: r for r in rules_from_yaml(GOOD, tmp_path)}
    assert list(rules) == [
        "xid-79",
        "app-repeat",
        "hot",
        "narrow",
        "port-down",
        "symbols",
        "vendor-counter",
        "crc",
        "slow",
        "missing",
        "lost",
    ]
    xid = rules["xid-79"]
    assert isinstance(xid, EventRule)
    assert xid.codes == frozenset({79, 144, 145, 146})
    assert xid.clears == "reboot" and xid.hard and xid.action == "quarantine"
    assert xid.gpus is not None and xid.gpus.index == frozenset({0, 3})
    assert xid.summary.keys == {"gpu", "uuid", "xid", "time"}
    assert xid.source == tmp_path / "test.yaml"

    repeat = rules["app-repeat"]
    assert isinstance(repeat, EventRule) and repeat.repeat is not None
    assert (repeat.repeat.count, repeat.repeat.within_s, repeat.repeat.apart_s) == (3, 21600.0, 600.0)
    assert repeat.clears == "condition"

    hot = rules["hot"]
    assert isinstance(hot, FieldRule)
    assert (hot.condition.field, hot.condition.op, hot.condition.value, hot.for_s) == (
        "temperature_celsius",
        ">=",
        85.0,
        300.0,
    )
    assert hot.when is not None and hot.when.field == "utilization_ratio"
    assert hot.clears == "condition", "only event rules clear on reboot by default"

    narrow = rules["narrow"]
    assert isinstance(narrow, FieldRule) and narrow.condition.value_of == "pcie_link_width_max"
    assert narrow.enabled is False

    port = rules["port-down"]
    assert isinstance(port, FieldRule) and port.target == "nic"
    assert port.condition.value == frozenset({"ACTIVE"}) and port.for_s == 30.0
    assert port.nics is not None and port.nics.rdma is True

    symbols = rules["symbols"]
    assert isinstance(symbols, RateRule)
    assert symbols.max_ber == 1e-12 and symbols.value is None, "YAML's text '1e-12' is read as a number"
    assert (symbols.per_s, symbols.window_s) == (3600.0, 1800.0)

    vendor = rules["vendor-counter"]
    assert isinstance(vendor, RateRule) and vendor.field == "np_cnp_sent_v2" and vendor.window_s == 90.0
    assert vendor.per == "second"

    slow = rules["slow"]
    assert isinstance(slow, ShareRule) and slow.condition.value == 0x48 and slow.share == 0.5

    assert isinstance(rules["missing"], GpuMissingRule)
    lost = rules["lost"]
    assert isinstance(lost, ErrorRule) and lost.match.groupindex == {"gpu": 1}


def test_directory_loads_its_yaml_files_in_name_order(tmp_path: Path) -> None:
    rule = "rules:\n  - {{name: {n}, kind: gpu_missing, severity: info, action: none}}\n"
    (tmp_path / "b.yaml").write_text(rule.format(n="second"))
    (tmp_path / "a.yml").write_text(rule.format(n="first"))
    (tmp_path / "notes.txt").write_text("not rules")
    assert [r.name for r in load_rules([tmp_path])] == ["first", "second"]


def test_shipped_rules_load() -> None:
    rules = load_rules([default_rules_dir()])
    assert default_rules_dir() == Path(__file__).resolve().parents[1] / "rules"
    names = [r.name for r in rules]
    assert len(names) == len(set(names)) >= 30
    assert all(r.enabled and r.description for r in rules), "every shipped rule says why it exists"


def test_clock_event_bit_names_are_nvml_values() -> None:
    pynvml = pytest.importorskip("pynvml")
    for name, bit in CLOCK_EVENT_BITS.items():
        camel = "".join(part.capitalize() for part in name.split("_"))
        assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, name


def test_rule_error_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        rules_from_yaml("rules: [{name: x, kind: nope}]", tmp_path)


# (case id, YAML of one rule, the key the message must name, a phrase it must contain)
BASE = "severity: warning\n    action: alert"
BAD: list[tuple[str, str, str | None, str]] = [
    (
        "unknown key",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    treshold: 3",
        "treshold",
        "unknown key",
    ),
    (
        "unknown key suggests",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '>'\n"
        f"    value: 1\n    {BASE}\n    fro: 5m",
        "fro",
        "did you mean 'for'",
    ),
    (
        "bad comparator",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '=>'\n"
        f"    value: 1\n    {BASE}",
        "op",
        "does not apply",
    ),
    (
        "unknown gpu field",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temprature_celsius\n    op: '>'\n"
        f"    value: 1\n    {BASE}",
        "field",
        "did you mean 'temperature_celsius'",
    ),
    (
        "dunder field",
        f"name: r1\n    kind: field\n    target: gpu\n    field: __class__\n    op: '>'\n"
        f"    value: 1\n    {BASE}",
        "field",
        "unknown field",
    ),
    (
        "unknown nic counter",
        f"name: r1\n    kind: rate\n    target: nic\n    field: symbol_errors\n    window: 5m\n    op: '>'\n"
        f"    value: 0\n    {BASE}",
        "field",
        "did you mean 'symbol_error'",
    ),
    (
        "rate of a gauge",
        f"name: r1\n    kind: rate\n    target: gpu\n    field: temperature_celsius\n    window: 5m\n"
        f"    op: '>'\n    value: 0\n    {BASE}",
        "field",
        "gauge, not a counter",
    ),
    (
        "bad regex",
        f"name: r1\n    kind: event\n    codes: [79]\n    match: '(['\n    {BASE}",
        "match",
        "bad regular expression",
    ),
    (
        "bad regex in selector",
        f"name: r1\n    kind: event\n    codes: [79]\n    gpus: {{model: '*H100'}}\n    {BASE}",
        "gpus.model",
        "bad regular expression",
    ),
    (
        "error rule group",
        f"name: r1\n    kind: error\n    match: '(?P<idx>\\d+)'\n    {BASE}",
        "match",
        "only named group",
    ),
    (
        "error rule without code or match",
        f"name: r1\n    kind: error\n    collector: nvml\n    {BASE}",
        "code",
        "required",
    ),
    (
        "unknown error code",
        f"name: r1\n    kind: error\n    code: gpu_lots\n    {BASE}",
        "code",
        "did you mean 'gpu_lost'",
    ),
    (
        "bad severity",
        "name: r1\n    kind: gpu_missing\n    severity: fatal\n    action: alert",
        "severity",
        "fatal",
    ),
    (
        "bad action",
        "name: r1\n    kind: gpu_missing\n    severity: info\n    action: drain",
        "action",
        "drain",
    ),
    (
        "hard needs quarantine",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    hard: true",
        "hard",
        "only a quarantine rule",
    ),
    ("unknown kind", f"name: r1\n    kind: threshold\n    {BASE}", "kind", "one of event"),
    ("missing kind", f"name: r1\n    {BASE}", "kind", "required"),
    ("bad name", f"name: Xid79\n    kind: gpu_missing\n    {BASE}", "name", "lowercase"),
    (
        "unknown placeholder",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    summary: 'GPU {{gpu}} at {{temp}}'",
        "summary",
        "unknown placeholder {temp}",
    ),
    (
        "attribute placeholder",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    summary: 'GPU {{gpu.__class__}}'",
        "summary",
        "unknown placeholder",
    ),
    (
        "placeholder of another kind",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    summary: 'XID {{xid}}'",
        "summary",
        "unknown placeholder {xid}",
    ),
    (
        "format spec",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    summary: 'value {{value:.1f}}'",
        "summary",
        "takes no format",
    ),
    (
        "unbalanced brace",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    summary: 'GPU {{gpu'",
        "summary",
        "bad template",
    ),
    (
        "bad duration",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '>'\n"
        f"    value: 1\n    for: 5 minutes\n    {BASE}",
        "for",
        "duration",
    ),
    ("bad code", f"name: r1\n    kind: event\n    codes: [79, seventy]\n    {BASE}", "codes", "seventy"),
    (
        "bad code range",
        f"name: r1\n    kind: event\n    codes: ['150-144']\n    {BASE}",
        "codes",
        "bad range",
    ),
    (
        "max_ber off nic",
        f"name: r1\n    kind: rate\n    target: nvlink\n    field: crc_flit_errors_total\n    window: 5m\n"
        f"    op: '>'\n    max_ber: 1e-12\n    {BASE}",
        "max_ber",
        "only applies to target: nic",
    ),
    (
        "value and max_ber",
        f"name: r1\n    kind: rate\n    target: nic\n    field: symbol_error\n    window: 5m\n    op: '>'\n"
        f"    max_ber: 1e-12\n    value: 3\n    {BASE}",
        "max_ber",
        "not both",
    ),
    (
        "rate without window",
        f"name: r1\n    kind: rate\n    target: nic\n    field: symbol_error\n    op: '>'\n"
        f"    value: 3\n    {BASE}",
        "window",
        "required",
    ),
    (
        "share above one",
        f"name: r1\n    kind: share\n    field: clock_event_reasons\n    op: any_bits\n"
        f"    value: [hw_slowdown]\n    share: 1.5\n    window: 10m\n    {BASE}",
        "share",
        "at most 1",
    ),
    (
        "unknown clock reason",
        f"name: r1\n    kind: share\n    field: clock_event_reasons\n    op: any_bits\n"
        f"    value: [hw_slowdwn]\n    share: 0.5\n    window: 10m\n    {BASE}",
        "value",
        "did you mean 'hw_slowdown'",
    ),
    (
        "in on a number",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: in\n"
        f"    value: [85]\n    {BASE}",
        "op",
        "does not apply",
    ),
    (
        "text value for a number",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '>'\n"
        f"    value: hot\n    {BASE}",
        "value",
        "expected a number",
    ),
    (
        "value_of unknown",
        f"name: r1\n    kind: field\n    target: gpu\n    field: pcie_link_width\n    op: '<'\n"
        f"    value_of: pcie_width_max\n    {BASE}",
        "value_of",
        "did you mean 'pcie_link_width_max'",
    ),
    (
        "value and value_of",
        f"name: r1\n    kind: field\n    target: gpu\n    field: pcie_link_width\n    op: '<'\n"
        f"    value: 16\n    value_of: pcie_link_width_max\n    {BASE}",
        "value",
        "exactly one",
    ),
    (
        "unknown key in when",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '>'\n"
        f"    value: 80\n    when: {{field: utilization_ratio, op: '>', value: 0.5, for: 5m}}\n    {BASE}",
        "when.for",
        "unknown key",
    ),
    (
        "unknown key in after",
        f"name: r1\n    kind: field\n    target: nic\n    field: state\n    op: in\n    value: [DOWN]\n"
        f"    after: [{{field: state, op: in, value: [ACTIVE]}},\n"
        f"            {{field: state, op: in, valeu: [X]}}]\n    {BASE}",
        "after[1].valeu",
        "unknown key",
    ),
    (
        "an empty after",
        f"name: r1\n    kind: field\n    target: nic\n    field: state\n    op: in\n    value: [DOWN]\n"
        f"    after: []\n    {BASE}",
        "after",
        "empty list",
    ),
    (
        "after on a rate rule",
        f"name: r1\n    kind: rate\n    target: nic\n    field: symbol_error\n    op: '>'\n    value: 1\n"
        f"    window: 5m\n    after: {{field: state, op: in, value: [ACTIVE]}}\n    {BASE}",
        "after",
        "unknown key",
    ),
    (
        "nics on a gpu rule",
        f"name: r1\n    kind: field\n    target: gpu\n    field: temperature_celsius\n    op: '>'\n"
        f"    value: 80\n    nics: {{rdma: true}}\n    {BASE}",
        "nics",
        "only applies to target: nic",
    ),
    (
        "yaml boolean key",
        f"name: r1\n    kind: field\n    on: gpu\n    field: temperature_celsius\n    op: '>'\n    value: 1\n"
        f"    {BASE}",
        None,
        "YAML reads on/off/yes/no as booleans",
    ),
    (
        "repeat count",
        f"name: r1\n    kind: event\n    codes: [13]\n    clears: condition\n"
        f"    repeat: {{count: 1, within: 6h}}\n    {BASE}",
        "repeat.count",
        "at least 2",
    ),
    (
        "repeat cannot fit",
        f"name: r1\n    kind: event\n    codes: [13]\n    clears: condition\n"
        f"    repeat: {{count: 3, within: 1h, apart: 45m}}\n    {BASE}",
        "repeat.apart",
        "cannot fit",
    ),
    (
        "hold on a latched event",
        f"name: r1\n    kind: event\n    codes: [13]\n    hold: 5m\n    {BASE}",
        "hold",
        "clears on 'condition'",
    ),
    (
        "runbook not a url",
        f"name: r1\n    kind: gpu_missing\n    {BASE}\n    runbook_url: see wiki",
        "runbook_url",
        "http(s) URL",
    ),
    (
        "share of a text field",
        f"name: r1\n    kind: share\n    field: model\n    op: '=='\n    value: H100\n    share: 0.5\n"
        f"    window: 10m\n    {BASE}",
        "field",
        "is text",
    ),
]


@pytest.mark.parametrize(("case", "body", "key", "phrase"), BAD, ids=[case for case, *_ in BAD])
def test_bad_rule_is_refused_naming_file_rule_and_key(
    tmp_path: Path, case: str, body: str, key: str | None, phrase: str
) -> None:
    text = f"rules:\n  - name: fine\n    kind: gpu_missing\n    {BASE}\n  - {body}\n"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RuleError) as caught:
        load_rules([path])
    err = caught.value
    message = str(err)
    assert str(path) in message and err.path == path
    name = re.search(r"name: (\S+)", body)
    assert name is not None
    if name.group(1) == "r1":
        assert "'r1'" in message and err.rule == "r1"
    else:
        assert "rule #2" in message, "a rule without a usable name is named by its position"
    assert "line 6" in message, "the rule's line in the file"
    if key is not None:
        assert f"{key}: " in message and err.key == key
    assert phrase in message


def test_duplicate_names_in_one_file(tmp_path: Path) -> None:
    rule = "  - {name: twice, kind: gpu_missing, severity: info, action: none}\n"
    with pytest.raises(
        RuleError, match=r"dup\.yaml: rule 'twice': name: duplicate rule name \(also defined earlier"
    ):
        rules_from_yaml("rules:\n" + rule + rule, tmp_path, "dup.yaml")


def test_duplicate_names_across_files_name_both(tmp_path: Path) -> None:
    rule = "rules:\n  - {name: twice, kind: gpu_missing, severity: info, action: none}\n"
    (tmp_path / "a.yaml").write_text(rule)
    (tmp_path / "b.yaml").write_text(rule)
    with pytest.raises(RuleError) as caught:
        load_rules([tmp_path / "a.yaml", tmp_path / "b.yaml"])
    assert str(tmp_path / "b.yaml") in str(caught.value) and str(tmp_path / "a.yaml") in str(caught.value)
    assert caught.value.rule == "twice"


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("rules: [\n", "not valid YAML"),
        ("- name: x\n", "expected a mapping with a 'rules:' list"),
        ("rule: []\n", "unknown top-level key 'rule'"),
        ("rules: {name: x}\n", "'rules' must be a list"),
        ("rules:\n  - just a string\n", "rule #1: expected a mapping"),
        ("rules:\n  - {name: a, name: b, kind: gpu_missing}\n", "duplicate key 'name'"),
        ("rules: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    ],
)
def test_bad_file_is_refused_naming_the_file(tmp_path: Path, text: str, phrase: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(RuleError) as caught:
        load_rules([path])
    assert str(path) in str(caught.value) and phrase in str(caught.value)


def test_missing_file_is_a_rule_error(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match="cannot read rule file"):
        load_rules([tmp_path / "absent.yaml"])
