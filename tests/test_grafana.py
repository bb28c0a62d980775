"""The Grafana dashboards (grafana/): generated, never hand-edited, and querying only what we export.

Every panel's PromQL is tokenized here: brackets balance, strings close, matchers are well formed,
every function is a PromQL function, and every series name is one the agent exports (the golden
exposition, plus the InfiniBand families a port may add), the aggregator exports (its registry
with remediation and probes on, rendered), or a recording rule records. promtool, where installed,
parses each expression for real. No panel sums a fleet-wide series over the aggregator replicas
(each exports the whole fleet's).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from agent.metrics import INFINIBAND_COUNTERS
from tests.test_prometheus_rules import aggregator_registry, family_sample_names, fleet_wide_sums, promtool

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "grafana"
GOLDEN = REPO / "tests" / "fixtures" / "metrics" / "golden.prom"
RECORDING_FILES = [
    REPO / "rules" / "prometheus" / "gpuwarden-recording.yml",
    REPO / "rules" / "prometheus" / "dcgm-compat.yml",
]
# Labels Prometheus attaches to every series of a target (the PodMonitor adds node).
TARGET_LABELS = {"job", "instance", "node", "namespace", "pod", "container", "endpoint", "service"}
VALUES = {
    "datasource": "prometheus",
    "node": "gpu-node-1",
    "aggregator_url": "http://localhost:8080",
    "probe_kind": "nccl_allreduce_pair",
}

PROMQL_FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_quantile", "histogram_count", "histogram_sum", "histogram_fraction", "holt_winters",
    "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10",
    "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort",
    "sort_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time",
}  # fmt: skip
AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
PROMQL_FUNCTIONS |= AGGREGATIONS
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]\[]*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>,(){}])
    """,
    re.VERBOSE,
)
_DURATION = re.compile(r"\[\s*(?:\d+(?:ms|[smhdwy]))+\s*(?::\s*(?:(?:\d+(?:ms|[smhdwy]))+)?\s*)?\]")
_PAIRS = {")": "(", "}": "{"}


def _load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpuwarden_grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing resolve the module by name
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


class PromQLError(ValueError):
    pass


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(series name, label names matched) of every selector in ``expr``; PromQLError if malformed."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected {expr[pos : pos + 10]!r} at {pos} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind == "range" and not _DURATION.fullmatch(m.group()):
            raise PromQLError(f"bad range {m.group()!r} in {expr!r}")
        if kind != "ws":
            tokens.append((kind, m.group()))
    found: list[tuple[str, list[str]]] = []
    stack: list[str] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text in ("(", "{"):
            stack.append(text)
        elif text in _PAIRS:
            if not stack or stack.pop() != _PAIRS[text]:
                raise PromQLError(f"unbalanced {text!r} in {expr!r}")
        elif kind == "ident":
            if text in GROUPING:
                if nxt == "(":
                    j = i + 2
                    while j < len(tokens) and tokens[j][1] != ")":
                        if tokens[j][0] != "ident" and tokens[j][1] != ",":
                            raise PromQLError(f"bad label list after {text} in {expr!r}")
                        j += 1
                    if j == len(tokens):
                        raise PromQLError(f"unclosed label list after {text} in {expr!r}")
                    i = j + 1
                    continue
            elif nxt == "(" or (text in AGGREGATIONS and nxt in ("by", "without")):
                if text not in PROMQL_FUNCTIONS:
                    raise PromQLError(f"unknown function {text!r} in {expr!r}")
            elif text not in KEYWORDS:
                labels: list[str] = []
                if nxt == "{":
                    i, labels = _matchers(tokens, i + 2, expr)
                else:
                    i += 1
                found.append((text, labels))
                continue
        elif text == "{":
            raise PromQLError(f"a selector without a metric name in {expr!r}")
        i += 1
    if stack:
        raise PromQLError(f"unclosed {stack[-1]!r} in {expr!r}")
    return found


def _matchers(tokens: list[tuple[str, str]], i: int, expr: str) -> tuple[int, list[str]]:
    """Parse ``label op "value", ...}`` from ``tokens[i]``; the index after ``}`` and the labels."""
    labels: list[str] = []
    while True:
        if tokens[i][1] == "}":
            return i + 1, labels
        if i + 2 >= len(tokens):
            raise PromQLError(f"unclosed selector in {expr!r}")
        (k1, name), (_, op), (k3, value) = tokens[i : i + 3]
        if k1 != "ident" or op not in ("=", "!=", "=~", "!~") or k3 != "string":
            raise PromQLError(f"bad matcher {name} {op} {value} in {expr!r}")
        if op in ("=~", "!~"):
            re.compile(value[1:-1])
        labels.append(name)
        i += 3
        if i == len(tokens):
            raise PromQLError(f"unclosed selector in {expr!r}")
        if tokens[i][1] == ",":
            i += 1
        elif tokens[i][1] != "}":
            raise PromQLError(f"expected , or }} after a matcher in {expr!r}")


def _exposition_labels(text: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Series name -> its label names, for everything the agent and the aggregator export."""
    series = _exposition_labels(GOLDEN.read_text(encoding="utf-8"))
    for name, _help in INFINIBAND_COUNTERS.values():
        series.setdefault(name, {"device", "port"})
    registry: CollectorRegistry = aggregator_registry(tmp_path_factory.mktemp("kube"))
    for name, labels in _exposition_labels(generate_latest(registry).decode()).items():
        series.setdefault(name, set()).update(labels)
    # Labelled families without a sample yet (decisions before the first, pools before any node).
    for name, labels in family_sample_names(registry).items():
        series.setdefault(name, set()).update(labels)
    return series


@pytest.fixture(scope="module")
def recorded() -> set[str]:
    names: set[str] = set()
    for path in RECORDING_FILES:
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            names.update(rule["record"] for rule in group["rules"] if "record" in rule)
    return names


def _all_queries() -> list[tuple[str, str, str]]:
    return [
        (name, title, expr)
        for name, dashboard in generate.dashboards().items()
        for title, expr in generate.panel_queries(dashboard)
    ]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return list(generate._panels(dashboard["panels"]))


# --- generated, committed ---------------------------------------------------------------------------


def test_committed_dashboards_are_what_generate_py_writes() -> None:
    assert generate.stale() == [], "run: .venv/bin/python grafana/generate.py"
    committed = {p.name for p in (GRAFANA / "dashboards").glob("*.json")}
    assert committed == set(generate.dashboards()), "a dashboard JSON that generate.py does not write"


def test_check_mode_reports_a_hand_edited_dashboard(tmp_path: Path) -> None:
    generate.write(tmp_path)
    assert generate.stale(tmp_path) == []
    path = tmp_path / "node.json"
    edited = json.loads(path.read_text(encoding="utf-8"))
    edited["title"] = "edited by hand"
    path.write_text(json.dumps(edited, indent=2) + "\n", encoding="utf-8")
    assert generate.stale(tmp_path) == ["node.json"]


# --- queries --------------------------------------------------------------------------------------


def test_every_dashboard_has_queries() -> None:
    for name, dashboard in generate.dashboards().items():
        assert len(generate.panel_queries(dashboard)) >= 5, name


@pytest.mark.parametrize(("dashboard", "title", "expr"), _all_queries())
def test_query_reads_only_series_we_export_or_record(
    dashboard: str, title: str, expr: str, exported: dict[str, set[str]], recorded: set[str]
) -> None:
    found = selectors(generate.expand(expr, VALUES))
    assert found, f"{dashboard} / {title}: no series in {expr!r}"
    for name, labels in found:
        assert name in exported or name in recorded, f"{dashboard} / {title}: {name} is not exported"
        if name in exported:
            unknown = set(labels) - exported[name] - TARGET_LABELS
            assert not unknown, f"{dashboard} / {title}: {name} has no label {sorted(unknown)}"


@pytest.mark.parametrize(("dashboard", "title", "expr"), _all_queries())
def test_query_never_sums_a_fleet_wide_series_over_aggregator_replicas(
    dashboard: str, title: str, expr: str
) -> None:
    summed = fleet_wide_sums(generate.expand(expr, VALUES))
    assert not summed, f"{dashboard} / {title}: every replica exports the whole fleet's {summed}; use max"


def test_remediation_and_probe_panels_are_on_the_fleet_dashboard(exported: dict[str, set[str]]) -> None:
    fleet = generate.fleet_overview()
    rows = [p["title"] for p in fleet["panels"] if p["type"] == "row"]
    assert {"Remediation", "Probes"} <= set(rows), rows
    read = {
        name
        for _title, expr in generate.panel_queries(fleet)
        for name, _ in selectors(generate.expand(expr, VALUES))
    }
    for name in (
        "gpuwarden_remediation_leader",
        "gpuwarden_remediation_breaker_open",
        "gpuwarden_remediation_held_nodes",
        "gpuwarden_remediation_writes_total",
        "gpuwarden_remediation_queue_depth",
        "gpuwarden_remediation_reconcile_seconds_bucket",
        "gpuwarden_probe_pair_coverage_ratio",
        "gpuwarden_probe_nodes_overdue",
        "gpuwarden_probe_node_untested_seconds",
        "gpuwarden_probe_results_total",
        "gpuwarden_probe_in_flight",
    ):
        assert name in read, f"no fleet panel shows {name}"
        assert name in exported, f"the aggregator exports no {name}"


def test_variable_queries_read_series_we_export(exported: dict[str, set[str]]) -> None:
    seen = 0
    for name, dashboard in generate.dashboards().items():
        for var, query in generate.variable_queries(dashboard):
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert m, f"{name}: ${var} query {query!r}"
            assert m.group(1) in exported, f"{name}: ${var} reads {m.group(1)}"
            assert m.group(2) in exported[m.group(1)] | TARGET_LABELS, f"{name}: ${var}"
            seen += 1
    assert seen >= 2


def test_node_drilldown_filters_every_query_by_the_node_variable() -> None:
    for title, expr in generate.panel_queries(generate.node_drilldown()):
        for name, labels in selectors(generate.expand(expr, VALUES)):
            assert "node" in labels, f"{title}: {name} is not filtered by $node"


@pytest.mark.parametrize(
    "expr",
    [
        "sum(rate(gpuwarden_gpu_bogus_total[5m]))",
        "sum(rate(gpuwarden_gpu_xid_events_total[5m])",
        'gpuwarden_gpu_power_watts{node="a"',
        "gpuwarden_gpu_power_watts{node=a}",
        "rate(gpuwarden_gpu_pcie_replay_total[5 minutes])",
        "sum by (gpu (gpuwarden_gpu_power_watts)",
        "frobnicate(gpuwarden_gpu_power_watts)",
        'gpuwarden_gpu_power_watts{nodename="a"}',
        '{node="a"}',
    ],
)
def test_the_query_check_catches_bad_queries(
    expr: str, exported: dict[str, set[str]], recorded: set[str]
) -> None:
    with pytest.raises((PromQLError, AssertionError)):
        for name, labels in selectors(expr):
            assert name in exported or name in recorded
            assert not set(labels) - exported.get(name, set()) - TARGET_LABELS


def test_selectors_reads_names_labels_and_skips_functions_and_grouping() -> None:
    expr = (
        'sum by (node, le) (rate(a_total{node="x", le=~"0.1|1"}[5m:1m])) / on (node) group_left () '
        "b:c:rate5m * 2 > bool 1"
    )
    assert selectors(expr) == [("a_total", ["node", "le"]), ("b:c:rate5m", [])]


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    rules = [
        {"record": f"grafana:query_{i}", "expr": generate.expand(expr, VALUES)}
        for i, (_, _, expr) in enumerate(_all_queries())
    ]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}), encoding="utf-8")
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_expand_substitutes_variables_and_refuses_unknown_ones() -> None:
    expr = 'rate(x{node="$node", a="${aggregator_url}"}[$__rate_interval])'
    assert generate.expand(expr, VALUES) == 'rate(x{node="gpu-node-1", a="http://localhost:8080"}[5m])'
    with pytest.raises(KeyError, match="pool"):
        generate.expand('x{pool="$pool"}', VALUES)


def test_panel_queries_reads_panels_inside_collapsed_rows() -> None:
    dashboard = {
        "panels": [
            {"type": "row", "title": "r", "panels": [{"title": "inner", "targets": [{"expr": "up"}]}]},
            {"title": "outer", "targets": [{"expr": "a"}, {"refId": "no expr"}]},
        ]
    }
    assert generate.panel_queries(dashboard) == [("inner", "up"), ("outer", "a")]


# --- dashboard model --------------------------------------------------------------------------------


def test_dashboards_have_unique_uids_and_the_pinned_schema_version() -> None:
    boards = generate.dashboards().values()
    uids = [d["uid"] for d in boards]
    assert len(set(uids)) == len(uids)
    for d in boards:
        assert re.fullmatch(r"[a-z0-9-]{1,40}", d["uid"]), d["uid"]
        assert d["schemaVersion"] == generate.SCHEMA_VERSION == 39


def test_every_query_uses_the_datasource_variable() -> None:
    for name, dashboard in generate.dashboards().items():
        first = dashboard["templating"]["list"][0]
        assert (first["name"], first["type"], first["query"]) == ("datasource", "datasource", "prometheus")
        for var in dashboard["templating"]["list"][1:]:
            if var["type"] == "query":
                assert var["datasource"]["uid"] == "${datasource}", (name, var["name"])
        for panel in _panels(dashboard):
            for target in panel.get("targets", ()):
                assert panel["datasource"]["uid"] == target["datasource"]["uid"] == "${datasource}"


def test_panels_fit_the_grid_and_have_unique_ids() -> None:
    for name, dashboard in generate.dashboards().items():
        panels = _panels(dashboard)
        assert len({p["id"] for p in panels}) == len(panels), name
        cells: set[tuple[int, int]] = set()
        for p in panels:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not mine & cells, f"{name}: {p['title']} overlaps another panel"
            cells |= mine


def test_panels_without_a_query_are_text_and_say_why() -> None:
    texts = 0
    for name, dashboard in generate.dashboards().items():
        for p in _panels(dashboard):
            if p["type"] in ("row", "text"):
                assert "targets" not in p, (name, p["title"])
                texts += p["type"] == "text"
            else:
                assert p["targets"], (name, p["title"])
    # the node's decisions: a link to the aggregator's API, which Prometheus does not have
    assert texts == 1


def test_node_dashboard_links_to_the_nodes_decisions_in_the_aggregator_api() -> None:
    node = generate.node_drilldown()
    names = [v["name"] for v in node["templating"]["list"]]
    assert names == ["datasource", "node", "aggregator_url"]
    urls = [link["url"] for p in _panels(node) for link in p.get("links", ())]
    assert "${aggregator_url}/api/v1/nodes/${node}" in urls


def test_network_dashboard_shows_the_pair_probe_matrix_per_kind_for_the_selected_nodes(
    exported: dict[str, set[str]],
) -> None:
    network = generate.network()
    variables = {v["name"]: v for v in network["templating"]["list"]}
    kind = variables["probe_kind"]
    assert kind["definition"] == "label_values(gpuwarden_probe_last_bandwidth_bytes_per_second, kind)"
    # Only pair kinds: the local probe has no peer, so no column of a matrix.
    pattern = re.compile(kind["regex"].strip("/"))
    assert [k for k in ("nccl_allreduce_local", "nccl_allreduce_pair", "tcp_pair") if pattern.search(k)] == [
        "nccl_allreduce_pair",
        "tcp_pair",
    ]
    assert {"kind", "peer"} <= exported["gpuwarden_probe_last_bandwidth_bytes_per_second"]

    panels = {p["title"]: p for p in _panels(network)}
    matrix = panels["Pair-probe bandwidth matrix"]
    assert matrix["type"] == "table"
    [target] = matrix["targets"]
    assert target["instant"] and target["format"] == "table"
    [(name, labels)] = selectors(generate.expand(target["expr"], VALUES))
    assert name == "gpuwarden_probe_last_bandwidth_bytes_per_second"
    assert {"kind", "node"} <= set(labels)
    assert "by (node, peer)" in target["expr"]  # the only labels left: the matrix's rows and columns
    [grouping] = matrix["transformations"]
    assert grouping == {
        "id": "groupingToMatrix",
        "options": {"rowField": "node", "columnField": "peer", "valueField": "Value", "emptyValue": "null"},
    }
    defaults = matrix["fieldConfig"]["defaults"]
    assert defaults["unit"] == "Bps" and defaults["custom"]["cellOptions"]["type"] == "color-background"
    # Colours relative to the fastest pair of the whole matrix (from 0), not per column.
    assert defaults["thresholds"]["mode"] == "percentage"
    assert defaults["min"] == 0 and defaults["fieldMinMax"] is False and "max" not in defaults
    assert "groupingToMatrix" in matrix["description"]

    slowest = panels["Slowest pairs now"]
    assert [t["refId"] for t in slowest["targets"]] == ["A", "B"]
    assert all(t["expr"].startswith("bottomk(20, ") for t in slowest["targets"])
    named = {o["matcher"]["options"] for o in slowest["fieldConfig"]["overrides"]}
    assert named == {"Value #A", "Value #B"}


# --- provisioning -----------------------------------------------------------------------------------


def test_dashboard_provisioning_loads_the_dashboards_folder_as_mounted_in_the_readme() -> None:
    config = yaml.safe_load((GRAFANA / "provisioning" / "dashboards.yaml").read_text(encoding="utf-8"))
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert path.startswith("/")
    readme = (GRAFANA / "README.md").read_text(encoding="utf-8")
    assert f"grafana/dashboards:{path}" in readme, "the README must show grafana/dashboards mounted there"


def test_datasource_provisioning_is_a_prometheus() -> None:
    config = yaml.safe_load((GRAFANA / "provisioning" / "datasources.yaml").read_text(encoding="utf-8"))
    assert config["apiVersion"] == 1
    (source,) = config["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"].startswith("http")


def test_nic_legends_name_a_netdev_without_a_trailing_slash(tmp_path: Path) -> None:
    # "{{device}}/{{port}}" rendered "eth0/" for a netdev (port ""): the panels name ports by nic.
    legends = [
        str(target.get("legendFormat", ""))
        for dashboard in generate.dashboards().values()
        for panel in generate._panels(dashboard.get("panels", ()))
        for target in panel.get("targets", ())
    ]
    assert not [legend for legend in legends if "{{port}}" in legend], legends
    assert any("{{nic}}" in legend for legend in legends)
    # What the nic label is, on a real PromQL engine.
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'gpuwarden_nic_up{device="eth0", port=""}', "values": "1x2"},
                    {"series": 'gpuwarden_nic_up{device="mlx5_0", port="1"}', "values": "1x2"},
                ],
                "promql_expr_test": [
                    {
                        "expr": generate._port("gpuwarden_nic_up"),
                        "eval_time": "1m",
                        "exp_samples": [
                            {"labels": 'gpuwarden_nic_up{device="eth0", nic="eth0"}', "value": 1},
                            {
                                "labels": 'gpuwarden_nic_up{device="mlx5_0", port="1", nic="mlx5_0/1"}',
                                "value": 1,
                            },
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "nic.test.yml"
    path.write_text(yaml.safe_dump(test))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- sharded: the fleet panels count each shard once ------------------------------------------------

# Two shards under one job, each a pair of replicas that knows only its own pools; shard 1's .2.6
# started late (fewer nodes, fewer reports, every probe overdue to it). Per replica, at minute 10.
_SHARDS = {"10.0.1.5": "0", "10.0.1.6": "0", "10.0.2.5": "1", "10.0.2.6": "1"}
_SHARDED_SERIES = {
    "gpuwarden_aggregator_nodes": {
        '{state="healthy"}': {"10.0.1.5": "54", "10.0.1.6": "54", "10.0.2.5": "38", "10.0.2.6": "20"},
        '{state="quarantined"}': {"10.0.1.5": "6", "10.0.1.6": "6", "10.0.2.5": "2", "10.0.2.6": "0"},
    },
    "gpuwarden_aggregator_reports_accepted_total": {  # per minute: 3/s, 3/s, 2/s, 0.5/s
        "": {"10.0.1.5": "0+180", "10.0.1.6": "0+180", "10.0.2.5": "0+120", "10.0.2.6": "0+30"},
    },
    "gpuwarden_remediation_breaker_open": {
        "": {"10.0.1.5": "0", "10.0.1.6": "0", "10.0.2.5": "1", "10.0.2.6": "1"}
    },
    "gpuwarden_remediation_held_nodes": {
        "": {"10.0.1.5": "3", "10.0.1.6": "3", "10.0.2.5": "2", "10.0.2.6": "0"}
    },
    "gpuwarden_probe_nodes_overdue": {
        "": {"10.0.1.5": "0", "10.0.1.6": "0", "10.0.2.5": "5", "10.0.2.6": "40"}
    },
}
# (panel title, legend) -> the fleet's figure: each shard once, from the replica that stands for it.
_SHARDED_EXPECTED = {
    ("Nodes by state", "{{state}}"): {'{state="healthy"}': 92.0, '{state="quarantined"}': 8.0},
    ("Reports per second", "accepted"): {"{}": 5.0},
    ("Held nodes", "held"): {"{}": 5.0},
    ("Breaker open", "shard {{shard}}"): {'{shard="0"}': 0.0, '{shard="1"}': 1.0},
    ("Nodes overdue, and the longest untested", "nodes overdue"): {"{}": 5.0},
}


def _with(labels: str, extra: str) -> str:
    inner = ", ".join(part for part in (extra, labels.strip("{}")) if part)
    return "{" + inner + "}"


def test_fleet_panels_count_each_shard_once_and_sum_the_shards(tmp_path: Path) -> None:
    """The fleet dashboard against two shards in a real PromQL engine (promtool's, with the
    recording rules loaded): every replica of a shard knows only the shard's nodes, so the fleet
    is the sum over shards, each counted once. Taking the max over every replica (as before
    sharding) shows the largest shard's share."""
    series = []
    for instance, shard in _SHARDS.items():
        target = f'job="gpuwarden-aggregator", instance="{instance}:8080"'
        series.append(
            {"series": f'gpuwarden_shard_info{{{target}, shard="{shard}", shards="2"}}', "values": "1x10"}
        )
        for name, by_labels in _SHARDED_SERIES.items():
            for labels, values in by_labels.items():
                series.append(
                    {"series": f"{name}{_with(labels, target)}", "values": f"{values[instance]}x10"}
                )
    queries = {
        (title, str(target["legendFormat"])): str(target["expr"])
        for panel in generate._panels(generate.fleet_overview()["panels"])
        for title in [str(panel.get("title", ""))]
        for target in panel.get("targets", ())
        if "expr" in target
    }
    tests = []
    for key, samples in _SHARDED_EXPECTED.items():
        assert key in queries, f"no fleet panel {key}"
        expr = generate.expand(queries[key], VALUES)
        tests.append(
            {
                "expr": expr,
                "eval_time": "10m",
                "exp_samples": [{"labels": labels, "value": value} for labels, value in samples.items()],
            }
        )
    spec = {
        "rule_files": [str(path) for path in RECORDING_FILES],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
    }
    path = tmp_path / "sharded.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    done = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
