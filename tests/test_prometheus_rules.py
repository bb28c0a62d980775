"""The Prometheus rules over gpuwarden's own metrics (rules/prometheus/).

promtool checks and unit-tests them; the rest is checked here without it: every alert has a test
that fires and one that stays quiet, a runbook and complete annotations; every series a rule reads
is one the agent or the aggregator really exports, with label values they really use; and the
PrometheusRule rendered from the files carries exactly their groups.

The aggregator's families are taken from a real one: its base metrics, remediation's (built over
the Kubernetes API-server double) and the probe scheduler's. Since every aggregator replica
receives every report and exports the whole fleet's gauges, no rule may sum those over replicas.

promtool comes from $PROMTOOL or PATH (Debian: the prometheus package). Without it the promtool
tests skip, except under CI=true, where they fail: CI must run them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from agent.clock import FakeClock
from agent.metrics import CLOCK_EVENT_REASONS, INFINIBAND_COUNTERS
from aggregator.app import build_aggregator
from aggregator.config import Config, RemediationConfig
from aggregator.kube.api import KubeApi
from aggregator.kube.client import KubeClient
from aggregator.metrics import NODE_STATES
from tests.conftest import missing_tool
from tests.kube_double import KubeApiDouble

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "rules" / "prometheus"
RULE_FILES = [RULES / "gpuwarden-recording.yml", RULES / "dcgm-compat.yml", RULES / "gpuwarden-alerts.yml"]
TEST_FILES = sorted((RULES / "tests").glob("*.yml"))
RUNBOOKS = REPO / "docs" / "runbooks"
GOLDEN = REPO / "tests" / "fixtures" / "metrics" / "golden.prom"
RUNBOOK_BASE = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks/"
RUNBOOK_SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Fix", "## Escalate")

# A PromQL identifier: metric names, recorded names (with colons), function and label names.
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"\b(gpuwarden_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')

# Series every aggregator replica exports for the whole fleet (each receives every report, knows
# every node, makes every decision): summed over replicas they count everything once per replica.
FLEET_WIDE = (
    "gpuwarden_aggregator_nodes",
    "gpuwarden_aggregator_decisions_total",
    "gpuwarden_aggregator_reports_accepted_total",
    "gpuwarden_aggregator_reports_duplicate_total",
    "gpuwarden_aggregator_reports_rejected_total",
    "gpuwarden_remediation_breaker_open",
    "gpuwarden_remediation_held_nodes",
    "gpuwarden_probe_nodes_overdue",
    "gpuwarden_probe_pair_coverage_ratio",
    "gpuwarden_probe_node_untested_seconds",
    "gpuwarden_probe_results_total",
)
# A sum (or count) whose argument reads one of them, optionally through rate() or increase():
# group 1 is its `by` list, if any, group 2 the series.
_SUM_OVER = re.compile(
    r"\b(?:sum|count)\s*(?:by\s*\(([^)]*)\))?\s*\(\s*(?:(?:rate|increase|irate)\s*\(\s*)?("
    + "|".join(FLEET_WIDE)
    + r")\b"
)


def promtool() -> str:
    """promtool's path: $PROMTOOL, else PATH. Missing, the test skips, except where the run
    requires the tools scripts/setup installs (CI, and scripts/test): then it fails."""
    configured = os.environ.get("PROMTOOL")
    found = shutil.which(configured or "promtool")
    if found is None:
        if configured:
            pytest.fail(f"PROMTOOL={configured!r} is not an executable")
        missing_tool("promtool", "prometheus")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), path
    return document


def _rules(path: Path) -> Iterator[dict[str, Any]]:
    for group in _load(path)["groups"]:
        yield from group["rules"]


def _alerts() -> list[dict[str, Any]]:
    return list(_rules(RULES / "gpuwarden-alerts.yml"))


def _recorded_names() -> set[str]:
    return {rule["record"] for path in RULE_FILES for rule in _rules(path) if "record" in rule}


async def _build_aggregator_registry(workdir: Path) -> CollectorRegistry:
    (workdir / "tokens").write_text("gpu-0001 token-for-the-registry-test\n")
    config = msgspec.structs.replace(
        Config(), remediation=msgspec.convert({"mode": "dry-run"}, RemediationConfig)
    )
    async with KubeApiDouble() as kube:
        client = await KubeClient.from_kubeconfig(kube.write_kubeconfig(workdir / "kubeconfig"))

        async def connect() -> KubeApi:
            return client

        try:
            # Built as gpuwarden aggregator builds it, with remediation and probes on: building
            # registers every family; nothing is started or written.
            aggregator = await build_aggregator(
                config,
                [],
                auth=workdir / "tokens",
                clock=FakeClock(),
                kube=connect,
                identity="gpuwarden-aggregator-0",
                probe_key=b"k" * 32,
            )
        finally:
            await client.close()
    return aggregator.registry


def aggregator_registry(workdir: Path) -> CollectorRegistry:
    """A registry with every family a fully configured aggregator exports (remediation and probes on)."""
    return asyncio.run(_build_aggregator_registry(workdir))


def family_sample_names(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Sample name -> label names, for every family of ``registry``, also those with no sample yet
    (a labelled counter before its first event, the pool coverage before any pool is seen)."""
    names: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for collector in list(registry._collector_to_names):  # describe() needs no scrape
        describe = getattr(collector, "describe", None)
        for family in describe() if describe is not None else collector.collect():
            labels = set(getattr(family, "_labelnames", ()))
            for suffix in suffixes.get(family.type, ()):
                names.setdefault(family.name + suffix, set()).update(labels)
    return names


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets of its samples, over what the agent and the aggregator export.

    The agent's golden exposition holds every family a full report produces; InfiniBand families
    appear only for the counters its port has, so the rest are added from their table (no samples
    known: their label values go unchecked).
    """
    samples: dict[str, list[dict[str, str]]] = {}
    registry = aggregator_registry(tmp_path_factory.mktemp("kube"))
    texts = [GOLDEN.read_text(encoding="utf-8"), generate_latest(registry).decode()]
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(dict(sample.labels))
    for name, _help in INFINIBAND_COUNTERS.values():
        samples.setdefault(name, [])
    for name in family_sample_names(registry):
        samples.setdefault(name, [])
    return samples


def _metric_names(expr: str) -> set[str]:
    bare = _RANGE.sub("", _STRING.sub('""', expr))
    return set(_IDENT.findall(bare))


def _alert_tests() -> list[tuple[str, bool]]:
    """(alertname, whether the test expects it to fire) for every alert_rule_test."""
    found: list[tuple[str, bool]] = []
    for path in TEST_FILES:
        for test in _load(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                found.append((case["alertname"], bool(case.get("exp_alerts"))))
    return found


# promtool


def test_promtool_check_rules_is_clean() -> None:
    result = _run(promtool(), "check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    assert TEST_FILES, "no promtool unit tests under rules/prometheus/tests/"
    result = _run(promtool(), "test", "rules", *map(str, TEST_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The unit tests are not vacuous: the same tests fail against a rule with a wrong threshold."""
    tool = promtool()
    broken = (RULES / "gpuwarden-alerts.yml").read_text(encoding="utf-8")
    broken = broken.replace("gpuwarden_shipper_spool_depth > 30", "gpuwarden_shipper_spool_depth > 300")
    (tmp_path / "gpuwarden-alerts.yml").write_text(broken, encoding="utf-8")
    shutil.copy(RULES / "gpuwarden-recording.yml", tmp_path)
    (tmp_path / "tests").mkdir()
    shutil.copy(RULES / "tests" / "agent-alerts.test.yml", tmp_path / "tests")
    result = _run(tool, "test", "rules", str(tmp_path / "tests" / "agent-alerts.test.yml"))
    assert result.returncode != 0
    assert "GpuwardenAgentSpoolBacklog" in result.stdout + result.stderr


# Alerts: tests, annotations, runbooks


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    cases = _alert_tests()
    for alert in _alerts():
        name = alert["alert"]
        assert (name, True) in cases, f"{name}: no promtool test where it fires"
        assert (name, False) in cases, f"{name}: no promtool test where it stays quiet"


def test_unit_tests_only_name_alerts_that_exist() -> None:
    names = {alert["alert"] for alert in _alerts()}
    for name, _fires in _alert_tests():
        assert name in names, f"promtool test for unknown alert {name}"


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    for alert in _alerts():
        name = alert["alert"]
        assert re.fullmatch(r"Gpuwarden[A-Z][A-Za-z]+", name), name
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = alert["annotations"]
        assert annotations["summary"].strip(), name
        assert "$labels" in annotations["description"] or "$value" in annotations["description"], (
            f"{name}: the description should say which target or how much"
        )
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}{name}.md", name


def test_every_alert_has_a_runbook_with_every_section() -> None:
    for alert in _alerts():
        name = alert["alert"]
        path = RUNBOOKS / f"{name}.md"
        assert path.is_file(), f"{name}: no runbook at {path.relative_to(REPO)}"
        text = path.read_text(encoding="utf-8")
        assert text.startswith(f"# {name}\n"), f"{path.name}: the title must be the alert name"
        for section in RUNBOOK_SECTIONS:
            assert f"\n{section}" in text, f"{path.name}: no '{section}' section"
        # Every alert's runbook must say how to check it from the expression side too.
        assert "```" in text, f"{path.name}: no commands or queries to diagnose with"


def test_every_runbook_belongs_to_an_alert() -> None:
    names = {rule["alert"] for path in RULES.glob("*.yml") for rule in _rules(path) if "alert" in rule}
    from aggregator.notify.base import ALERTNAMES

    names |= set(ALERTNAMES.values())  # the aggregator's own alerts (aggregator/notify/)
    for path in RUNBOOKS.glob("*.md"):
        assert path.stem in names, f"{path.name} documents no alert in rules/prometheus/"


# Metrics and labels the rules read


def test_rules_only_read_series_that_are_exported_or_recorded(
    exposed: dict[str, list[dict[str, str]]],
) -> None:
    exported = exposed
    recorded = _recorded_names()
    for path in RULE_FILES:
        for rule in _rules(path):
            label = rule.get("alert") or rule.get("record")
            for name in _metric_names(rule["expr"]):
                if ":" in name:
                    assert name in recorded, f"{path.name} {label}: {name} is recorded nowhere"
                elif name.startswith("gpuwarden_"):
                    assert name in exported, f"{path.name} {label}: nothing exports {name}"


def test_rule_selectors_use_label_values_the_exporters_produce(
    exposed: dict[str, list[dict[str, str]]],
) -> None:
    exported = exposed
    checked = 0
    for path in RULE_FILES:
        for rule in _rules(path):
            for metric, matchers in _SELECTOR.findall(rule["expr"]):
                label_sets = exported.get(metric, [])
                if not label_sets:
                    continue  # no sample to compare with (an event counter nothing has counted)
                for label, op, value in _MATCHER.findall(matchers):
                    if op not in ("=", "=~"):
                        continue
                    seen = {labels.get(label) for labels in label_sets}
                    for wanted in value.split("|") if op == "=~" else [value]:
                        assert wanted in seen, f"{path.name}: {metric}{{{label}={wanted!r}}} never exported"
                        checked += 1
    assert checked >= 20  # the DCGM rules alone select type, scope, cause and link types


def test_the_remediation_and_probe_families_the_alerts_read_are_exported(
    exposed: dict[str, list[dict[str, str]]],
) -> None:
    read = {name for rule in _alerts() for name in _metric_names(rule["expr"])}
    for name in (
        "gpuwarden_remediation_leader",
        "gpuwarden_remediation_breaker_open",
        "gpuwarden_remediation_held_nodes",
        "gpuwarden_remediation_writes_total",
        "gpuwarden_probe_nodes_overdue",
        "gpuwarden_probe_pair_coverage_ratio",
    ):
        assert name in read, f"no alert reads {name}"
        assert name in exposed, f"the aggregator exports no {name}"
    # The write errors the alert selects are a result the actuator counts from the start.
    assert {"kind": "taint", "result": "error"} in exposed["gpuwarden_remediation_writes_total"]


def fleet_wide_sums(expr: str) -> list[str]:
    """The fleet-wide series ``expr`` sums (or counts) across aggregator replicas: those whose
    sum does not keep ``instance``."""
    found = []
    for by, series in _SUM_OVER.findall(_STRING.sub('""', expr)):
        if "instance" not in {label.strip() for label in by.split(",")}:
            found.append(series)
    return found


def test_no_rule_sums_a_fleet_wide_series_over_aggregator_replicas() -> None:
    for path in RULE_FILES:
        for rule in _rules(path):
            label = rule.get("alert") or rule.get("record")
            assert not fleet_wide_sums(rule["expr"]), (
                f"{path.name} {label}: every replica exports the whole fleet's "
                f"{fleet_wide_sums(rule['expr'])}; take max over instances, not sum"
            )


@pytest.mark.parametrize(
    ("expr", "summed"),
    [
        (
            'sum by (job) (gpuwarden_aggregator_nodes{state="quarantined"}) >= 3',
            ["gpuwarden_aggregator_nodes"],
        ),
        (
            "sum(rate(gpuwarden_aggregator_reports_accepted_total[5m]))",
            ["gpuwarden_aggregator_reports_accepted_total"],
        ),
        ("count(gpuwarden_probe_nodes_overdue > 0)", ["gpuwarden_probe_nodes_overdue"]),
        ("sum by (job, instance) (gpuwarden_aggregator_nodes)", []),
        ("max by (job) (gpuwarden_aggregator_nodes)", []),
        ("sum by (job, kind) (rate(gpuwarden_remediation_writes_total[5m]))", []),
    ],
)
def test_the_fleet_wide_sum_check_tells_a_sum_over_replicas_from_a_sum_within_one(
    expr: str, summed: list[str]
) -> None:
    assert fleet_wide_sums(expr) == summed


def test_throttle_reasons_are_nvml_reasons() -> None:
    known = {name for name, _bit in CLOCK_EVENT_REASONS}
    text = (RULES / "gpuwarden-recording.yml").read_text(encoding="utf-8")
    selectors = re.findall(r'reason=~"([^"]+)"', text)
    assert selectors
    for selector in selectors:
        assert set(selector.split("|")) <= known, selector


def test_quarantine_alerts_select_a_real_node_state() -> None:
    text = (RULES / "gpuwarden-alerts.yml").read_text(encoding="utf-8")
    for state in re.findall(r'state="([a-z]+)"', text):
        assert state in NODE_STATES


def test_every_dcgm_series_has_a_unit_test_of_its_value() -> None:
    tested: dict[str, int] = {}
    for test in _load(RULES / "tests" / "dcgm-compat.test.yml")["tests"]:
        for case in test.get("promql_expr_test", []):
            tested[case["expr"]] = len(case.get("exp_samples", []))
    for rule in _rules(RULES / "dcgm-compat.yml"):
        name = rule["record"]
        if name.startswith("DCGM_"):
            assert tested.get(name, 0) > 0, f"{name}: no promtool test of its value"


# The PrometheusRule rendering


def _render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "render_prometheusrule", REPO / "scripts" / "render_prometheusrule.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render() -> ModuleType:
    return _render_module()


def test_rendered_prometheusrule_holds_every_group_in_order(render: ModuleType) -> None:
    text = render.dump(render.render(render.load_groups(RULES), render.Options()))
    manifest = yaml.safe_load(text)
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"] == "gpuwarden"
    expected = [group for path in RULE_FILES for group in _load(path)["groups"]]
    assert manifest["spec"]["groups"] == expected


_CUSTOM = {
    "namespace": "monitoring",
    "labels": {"release": "kube-prometheus-stack"},
    "runbook_base_url": "https://wiki.example.com/runbooks",
    "agent_job": "gpuwarden/gpuwarden-agent",
    "aggregator_job": "gpuwarden/aggregator",
}


def test_rendering_applies_job_names_and_runbook_base(render: ModuleType) -> None:
    manifest = render.render(render.load_groups(RULES), render.Options(**_CUSTOM))
    assert manifest["metadata"]["namespace"] == "monitoring"
    assert manifest["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = [rule for group in manifest["spec"]["groups"] for rule in group["rules"]]
    exprs = "\n".join(rule["expr"] for rule in rules)
    assert 'job="gpuwarden-agent"' not in exprs and 'job="gpuwarden-aggregator"' not in exprs
    assert 'up{job="gpuwarden/gpuwarden-agent"}' in exprs
    assert 'absent(up{job="gpuwarden/aggregator"})' in exprs
    for rule in rules:
        if "alert" in rule:
            assert (
                rule["annotations"]["runbook_url"] == f"https://wiki.example.com/runbooks/{rule['alert']}.md"
            )


def test_rendered_rules_with_other_job_names_pass_promtool(render: ModuleType, tmp_path: Path) -> None:
    tool = promtool()
    manifest = render.render(render.load_groups(RULES), render.Options(**_CUSTOM))
    out = tmp_path / "rendered.yml"
    out.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}), encoding="utf-8")
    result = _run(tool, "check", "rules", str(out))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rendering_can_leave_out_the_dcgm_series(render: ModuleType) -> None:
    groups = render.load_groups(RULES, dcgm_compat=False)
    names = [group["name"] for group in groups]
    assert "gpuwarden-dcgm-compat" not in names
    assert "gpuwarden-aggregator" in names


def test_rendering_refuses_a_group_defined_twice(render: ModuleType, tmp_path: Path) -> None:
    group = "groups:\n  - name: same\n    rules:\n      - record: a:b:c\n        expr: vector(1)\n"
    for filename in render.RULE_FILES:
        (tmp_path / filename).write_text(group, encoding="utf-8")
    with pytest.raises(render.RenderError, match=r"'same' is also defined in gpuwarden-recording\.yml"):
        render.load_groups(tmp_path)


def test_rendering_refuses_a_file_that_is_not_a_rule_file(render: ModuleType, tmp_path: Path) -> None:
    for filename in render.RULE_FILES:
        shutil.copy(RULES / filename, tmp_path)
    (tmp_path / "dcgm-compat.yml").write_text("rules: []\n", encoding="utf-8")
    with pytest.raises(render.RenderError, match=r"dcgm-compat\.yml: not a Prometheus rule file"):
        render.load_groups(tmp_path)


def test_render_cli_writes_checks_and_refuses_bad_options(
    render: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "prometheusrule.yaml"
    assert render.main(["--namespace", "gpuwarden", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8").startswith("# Generated by scripts/render_prometheusrule.py")
    assert render.main(["--namespace", "gpuwarden", "--check", str(out)]) == 0
    # Other options render something else: the committed file is stale for them.
    assert render.main(["--namespace", "monitoring", "--check", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert render.main(["--label", "not a label=x"]) == 2
    assert "not a Kubernetes label key" in capsys.readouterr().err
    assert render.main(["--runbook-base-url", "wiki/runbooks"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


def test_the_prometheusrule_manifest_is_rendered_from_the_rule_files() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run(
        [
            sys.executable,
            "scripts/render_prometheusrule.py",
            "--namespace",
            "gpuwarden",
            "--check",
            "daemonset/base/prometheusrule.yaml",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, "daemonset/base/prometheusrule.yaml is stale: " + out.stdout + out.stderr
