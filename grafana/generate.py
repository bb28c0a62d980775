"""gpuwarden's Grafana dashboards, as code: ``python grafana/generate.py`` writes grafana/dashboards/.

Plain dicts in Grafana's dashboard JSON model (no SDK dependency), pinned to one schemaVersion so
that Grafana does not migrate them on load. The committed JSON is this script's output;
tests/test_grafana.py fails when they differ, so edit this file and regenerate, never the JSON.

Every query reads a metric the agent or the aggregator exports, or a recording rule of
rules/prometheus/gpuwarden-recording.yml (the test checks this). Where the metric a panel needs does
not exist yet, the panel is a text panel (``_text``) that says so, rather than a query that shows
"No data".

High availability: every aggregator replica receives every report, so each exports the whole
fleet's figures (nodes by state, report rates, decisions, breaker, held nodes, probe coverage). A
panel shows one replica's figure (``max`` over them, or ``min`` where less is better informed),
never their sum, which would count everything once per replica; the test checks this. Remediation
writes come from the leader alone and are summed.

Queries use ``$__rate_interval`` (Grafana's recommended window for rate(), at least four scrape
intervals) and the template variables ``$datasource``, ``$node``, ``$aggregator_url`` and
``$probe_kind`` (network: one pair probe kind at a time);
``expand`` substitutes them for running a query outside Grafana (the end-to-end test does).

Usage: ``python grafana/generate.py`` (write), ``python grafana/generate.py --check`` (exit 1 when
the committed files are stale).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Grafana 10.4 and 11.x write schemaVersion 39; a dashboard at the version Grafana writes is loaded
# as is, without migration.
SCHEMA_VERSION = 39
GRAFANA_MIN_VERSION = "10.4.0"
DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"
TAGS = ["gpuwarden"]

# What ``expand`` puts for Grafana's built-in variables: the rules' 5m windows assume a scrape
# interval of 75 s or less, and $__rate_interval is at least four scrape intervals.
BUILTIN_DEFAULTS: Mapping[str, str] = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}

Json = dict[str, Any]

_DS: Json = {"type": "prometheus", "uid": "${datasource}"}
_NODE = 'node="$node"'
_NODES = 'node=~"$node"'
_RI = "$__rate_interval"
_GPU_LEGEND = "GPU {{gpu}}"


# --- template variables ---------------------------------------------------------------------------


def _datasource_var() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
        "options": [],
    }


def _query_var(name: str, label: str, query: str, *, multi: bool = False, regex: str = "") -> Json:
    var: Json = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": _DS,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-variable"},
        "current": {},
        "hide": 0,
        "refresh": 2,  # on time range change: nodes come and go
        "regex": regex,
        "sort": 1,
        "multi": multi,
        "includeAll": multi,
        "options": [],
    }
    if multi:
        var["allValue"] = ".+"
    return var


def _aggregator_url_var() -> Json:
    # A browser opens the link, so the default is where `kubectl port-forward` puts the Service;
    # sites with an ingress set their URL here or in the provisioned copy.
    return {
        "name": "aggregator_url",
        "label": "Aggregator URL",
        "type": "textbox",
        "query": "http://localhost:8080",
        "current": {"text": "http://localhost:8080", "value": "http://localhost:8080"},
        "hide": 0,
        "options": [],
    }


# --- panels ---------------------------------------------------------------------------------------


def _port(expr: str) -> str:
    """``expr`` with a ``nic`` label for legends: "mlx5_0/1" for an RDMA port, "eth0" for a netdev
    (whose ``port`` is empty: "{{device}}/{{port}}" would read "eth0/")."""
    joined = f'label_join({expr}, "nic", "/", "device", "port")'
    return f'label_replace({joined}, "nic", "$1", "nic", "(.*)/")'


# Carries a replica's shard label over to a per-replica series (``_fleet``).
_SHARD_OF = "* on (job, instance) group_left (shard) instance_shard:gpuwarden_aggregator_nodes:sum ^ 0"


def _fleet(per_replica: str, by: str = "", *, within: str = "max", across: str = "sum") -> str:
    """The fleet's figure from ``per_replica`` (one series per aggregator replica and ``by``).

    Every replica of a shard receives its shard's whole share of the fleet, so a shard's figure
    is one replica's (``within``: the busiest, or the best-informed) and the fleet's is
    ``across`` the shards (unsharded: the one shard). A replica's shard comes from the recorded
    ``instance_shard:gpuwarden_aggregator_nodes:sum`` (its ``gpuwarden_shard_info``, "0" without
    one), as the recording rules take it; ``x ^ 0`` is 1 with x's labels."""
    keep = f", {by}" if by else ""
    outer = f"{across} by ({by})" if by else across
    return f"{outer} ({within} by (shard{keep}) ({per_replica} {_SHARD_OF}))"


def _target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "time_series") -> Json:
    return {
        "datasource": _DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": not instant,
        "instant": instant,
        "format": fmt,
    }


def _timeseries(
    title: str,
    targets: Sequence[Json],
    *,
    unit: str = "short",
    description: str = "",
    stack: bool = False,
    w: int = 12,
    h: int = 8,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Json:
    defaults: Json = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": _DS,
        "targets": list(targets),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "_size": (w, h),
    }


def _stat(
    title: str, targets: Sequence[Json], *, unit: str = "short", description: str = "", w: int = 6
) -> Json:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": _DS,
        "targets": list(targets),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "value_and_name",
        },
        "_size": (w, 4),
    }


def _heatmap(title: str, expr: str, *, description: str = "", w: int = 12, h: int = 8) -> Json:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": _DS,
        "targets": [_target(expr, "{{le}}", fmt="heatmap")],
        "options": {
            "calculate": False,
            "yAxis": {"unit": "s"},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
        },
        "fieldConfig": {"defaults": {}, "overrides": []},
        "_size": (w, h),
    }


def _table(
    title: str,
    targets: Sequence[Json],
    *,
    description: str = "",
    w: int = 12,
    h: int = 8,
    overrides: Sequence[Json] = (),
    transformations: Sequence[Json] = (),
) -> Json:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": _DS,
        "targets": list(targets),
        "fieldConfig": {"defaults": {}, "overrides": list(overrides)},
        "options": {"showHeader": True},
        "transformations": [{"id": "merge", "options": {}}, *transformations],
        "_size": (w, h),
    }


def _override(matcher: str, options: str, properties: Mapping[str, Any]) -> Json:
    """A field override: ``properties`` (Grafana's ids, e.g. ``custom.cellOptions``) on matched fields."""
    return {
        "matcher": {"id": matcher, "options": options},
        "properties": [{"id": key, "value": value} for key, value in properties.items()],
    }


def _without_time_sorted_by(field: str) -> list[Json]:
    """A table's transformations that drop the Time column of instant queries and sort by ``field``."""
    return [
        {"id": "organize", "options": {"excludeByName": {"Time": True}}},
        {"id": "sortBy", "options": {"sort": [{"field": field}]}},
    ]


def _text(title: str, markdown: str, *, w: int = 12, h: int = 4, links: Sequence[Json] = ()) -> Json:
    panel: Json = {
        "type": "text",
        "title": title,
        "options": {"mode": "markdown", "content": markdown.strip() + "\n"},
        "_size": (w, h),
    }
    if links:
        panel["links"] = list(links)
    return panel


def _row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_size": (24, 1)}


def _layout(panels: Sequence[Json]) -> list[Json]:
    """Give each panel an id and a gridPos, left to right, wrapping at Grafana's 24 columns."""
    out: list[Json] = []
    x = y = row_h = 0
    for pid, panel in enumerate(panels, start=1):
        p = dict(panel)
        w, h = p.pop("_size")
        if x + w > 24 or p["type"] == "row":
            x, y, row_h = 0, y + row_h, 0
        p["id"] = pid
        p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        out.append(p)
        x += w
        row_h = max(row_h, h)
        if p["type"] == "row":
            x, y, row_h = 0, y + h, 0
    return out


def _dashboard(
    uid: str,
    title: str,
    description: str,
    variables: Sequence[Json],
    panels: Sequence[Json],
    *,
    links: Sequence[Json] = (),
) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: line up a clock drop with an XID on the same node
        "timezone": "browser",
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "gpuwarden dashboards",
                "type": "dashboards",
                "tags": TAGS,
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            },
            *links,
        ],
        "templating": {"list": [_datasource_var(), *variables]},
        "panels": _layout(panels),
    }


# --- the dashboards -------------------------------------------------------------------------------


def fleet_overview() -> Json:
    decisions15m = "job_detector_state:gpuwarden_aggregator_decisions:increase15m"
    panels = [
        _row("Nodes"),
        _stat(
            "Nodes by state",
            [_target("sum by (state) (job_state:gpuwarden_aggregator_nodes:sum)", "{{state}}", instant=True)],
            description="Nodes by health state. Every aggregator replica of a shard knows every "
            "node of the shard: each shard is counted once, from its replica that knows the most, "
            "and the shards are summed (rules/prometheus/gpuwarden-recording.yml).",
            w=8,
        ),
        _stat(
            "Agents reporting to Prometheus",
            [_target("count(gpuwarden_agent_info)", "agents", instant=True)],
            description="Agents Prometheus scrapes now (gpuwarden_agent_info is 1 on each).",
            w=8,
        ),
        _stat(
            "Scrape targets up",
            [_target("job:up:avg", "{{job}}", instant=True)],
            unit="percentunit",
            description="Share of gpuwarden's scrape targets that answer, per job.",
            w=8,
        ),
        _timeseries(
            "Nodes by state",
            [_target("sum by (state) (job_state:gpuwarden_aggregator_nodes:sum)", "{{state}}")],
            stack=True,
            minimum=0,
        ),
        _timeseries(
            "Quarantines and releases (last 15 minutes)",
            [
                _target(
                    f'sum by (detector) ({decisions15m}{{state="quarantined"}})',
                    "quarantined by {{detector}}",
                ),
                _target(
                    f'sum by (state) ({decisions15m}{{state=~"probation|healthy"}})',
                    "entered {{state}}",
                ),
            ],
            description="Decisions in the 15 minutes before each point: nodes quarantined, by the "
            "detector that caused it; nodes let out on probation and back to healthy. A node's "
            "decisions with their evidence are in the aggregator's API (node drill-down dashboard).",
            minimum=0,
        ),
        *_remediation_panels(),
        *_probe_panels(),
        _row("Ingest health"),
        _timeseries(
            "Reports per second",
            [
                _target(
                    _fleet(
                        f"sum by (job, instance) (rate(gpuwarden_aggregator_reports_accepted_total[{_RI}]))"
                    ),
                    "accepted",
                ),
                _target(
                    _fleet(
                        f"sum by (job, instance) (rate(gpuwarden_aggregator_reports_duplicate_total[{_RI}]))"
                    ),
                    "duplicate",
                ),
                _target(
                    _fleet(
                        "sum by (job, instance, reason) "
                        f"(rate(gpuwarden_aggregator_reports_rejected_total[{_RI}]))",
                        "reason",
                    ),
                    "rejected: {{reason}}",
                ),
            ],
            unit="reqps",
            description="Reports the aggregator answered: accepted, duplicates (a retry of a report "
            "already processed) and rejections by reason code (see aggregator/service.py). Every "
            "replica of a shard receives every report of the shard: each shard's busiest replica, "
            "summed over the shards.",
            minimum=0,
        ),
        _timeseries(
            "Rejected share of reports",
            [
                _target("job:gpuwarden_aggregator_reports_rejected:ratio_rate5m", "all reasons"),
                _target("job_reason:gpuwarden_aggregator_reports_rejected:ratio_rate5m", "{{reason}}"),
            ],
            unit="percentunit",
            minimum=0,
        ),
        _heatmap(
            "Ingest latency",
            f"sum by (le) (rate(gpuwarden_aggregator_ingest_seconds_bucket[{_RI}]))",
            description="Time to process one report once its body arrived. Sub-millisecond when healthy.",
        ),
        _timeseries(
            "Ingest latency quantiles",
            [
                _target(
                    "instance:gpuwarden_aggregator_ingest_seconds:quantile_rate5m",
                    "{{instance}} p{{quantile}}",
                )
            ],
            unit="s",
            minimum=0,
        ),
        _timeseries(
            "Detection cycle duration",
            [
                _target(
                    "instance:gpuwarden_aggregator_detection_cycle_seconds:quantile_rate5m",
                    "{{instance}} p{{quantile}}",
                )
            ],
            unit="s",
            description="One periodic detection cycle (silence and fleet-wide detectors) runs every "
            "second: near 1 s means detection is falling behind.",
            minimum=0,
        ),
        _timeseries(
            "Detection cycle failures",
            [_target("instance:gpuwarden_aggregator_detection_cycle_failures:ratio_rate5m", "{{instance}}")],
            unit="percentunit",
            minimum=0,
        ),
        _timeseries(
            "Event loop: worst lag",
            [_target("max by (instance) (gpuwarden_aggregator_event_loop_lag_max_seconds)", "{{instance}}")],
            unit="s",
            description="The longest a short sleep on each aggregator's event loop overslept in the last "
            "60 s: how long a report or a Lease renewal may have waited behind other work.",
            minimum=0,
        ),
        _timeseries(
            "Cycle collector: mean pause by generation",
            [
                _target(
                    "sum by (instance, generation) "
                    f"(rate(gpuwarden_aggregator_gc_collection_seconds_sum[{_RI}]))"
                    " / sum by (instance, generation) "
                    f"(rate(gpuwarden_aggregator_gc_collection_seconds_count[{_RI}]))",
                    "{{instance}} generation {{generation}}",
                )
            ],
            unit="s",
            description="CPython's cycle collections in each aggregator, by generation (0: youngest, "
            "2: full); the event loop waits each one out. A full collection walks only what is newer "
            "than the heap frozen once the fleet is warm (aggregator/heap.py).",
            minimum=0,
        ),
        _row("Agents"),
        _timeseries(
            "Shipper",
            [
                _target(f"sum(rate(gpuwarden_shipper_failed_attempts_total[{_RI}]))", "failed attempts/s"),
                _target(f"sum(rate(gpuwarden_shipper_reports_dropped_total[{_RI}]))", "dropped/s"),
                _target("max(gpuwarden_shipper_spool_depth)", "largest spool"),
            ],
            description="Deliveries from the agents that failed (and are retried), reports dropped "
            "from a full spool, and the deepest spool in the fleet.",
            minimum=0,
        ),
        _timeseries(
            "Nodes with a failing collector",
            [
                _target(
                    "sum by (collector) (gpuwarden_collector_supported - gpuwarden_collector_success)",
                    "{{collector}}",
                )
            ],
            description="Nodes where the collector is supported but failed in the agent's last cycle.",
            minimum=0,
        ),
    ]
    return _dashboard(
        "gpuwarden-fleet",
        "gpuwarden / Fleet overview",
        "Health states of the fleet, the aggregator's decisions, remediation, active probe coverage and "
        "the health of report ingestion.",
        [],
        panels,
    )


def _remediation_panels() -> list[Json]:
    """Taints by the leader (aggregator/remediate/); the series exist where remediation runs."""
    return [
        _row("Remediation"),
        _stat(
            "Leader",
            [_target("gpuwarden_remediation_leader", "{{instance}}", instant=True)],
            description="1 on the replica that holds the Lease and writes to nodes. Exactly one should: "
            "none is GpuwardenRemediationNoLeader, two GpuwardenRemediationSplitBrain.",
        ),
        _stat(
            "Breaker open",
            [
                _target(
                    f"max by (shard) (gpuwarden_remediation_breaker_open {_SHARD_OF})",
                    "shard {{shard}}",
                    instant=True,
                )
            ],
            description="1 while the safety breaker is open: new quarantines are held, not tainted, "
            "until a human runs `gpuwarden breaker reset` (runbook GpuwardenBreakerOpen). One value "
            "per shard (0 unsharded): each shard has its own breaker.",
        ),
        _stat(
            "Held nodes",
            [_target(_fleet("gpuwarden_remediation_held_nodes"), "held", instant=True)],
            description="Quarantined nodes whose taint a safety limit held. Which ones and why: "
            "`GET /api/v1/remediation`.",
        ),
        _stat(
            "Since the last full resync",
            [
                _target(
                    "time() - " + _fleet("gpuwarden_remediation_last_resync_timestamp_seconds", across="min"),
                    "age",
                    instant=True,
                )
            ],
            unit="s",
            description="The leader compares every node with its decided state every "
            "remediation.resync_seconds (300 s by default) and when it takes the Lease. Sharded, "
            "the shard whose leader did so longest ago.",
        ),
        _timeseries(
            "Writes to Kubernetes per second",
            [
                _target(
                    f"sum by (kind, result) (rate(gpuwarden_remediation_writes_total[{_RI}]))",
                    "{{kind}} {{result}}",
                )
            ],
            description="Taints, untaints, conditions, events and annotations, by result: ok, "
            "conflict (retried), error, dry_run (computed and logged, not sent). Only the leader "
            "writes, so the sum is the fleet's.",
            minimum=0,
        ),
        _timeseries(
            "Work queue",
            [
                _target("gpuwarden_remediation_queue_depth", "{{instance}} waiting"),
                _target(
                    f"sum(rate(gpuwarden_remediation_queue_dropped_total[{_RI}]))", "dropped/s (queue full)"
                ),
                _target(
                    f"sum(rate(gpuwarden_remediation_overrides_total[{_RI}]))", "taints removed by hand/s"
                ),
            ],
            description="Nodes waiting for a write, per replica. Drops are caught up by the next full "
            "resync; a taint removed by hand is respected for override_cooldown_seconds.",
            minimum=0,
        ),
        _timeseries(
            "Reconcile time per node",
            [
                _target(
                    "histogram_quantile(0.99, sum by (instance, le) "
                    f"(rate(gpuwarden_remediation_reconcile_seconds_bucket[{_RI}])))",
                    "{{instance}} p99",
                ),
                _target(
                    "histogram_quantile(0.5, sum by (instance, le) "
                    f"(rate(gpuwarden_remediation_reconcile_seconds_bucket[{_RI}])))",
                    "{{instance}} p50",
                ),
            ],
            unit="s",
            description="Time to reconcile one node, rate-limit waits included (remediation.qps).",
            minimum=0,
            w=24,
        ),
    ]


def _probe_panels() -> list[Json]:
    """Active probes (aggregator/probes/). Every replica of a shard sees every result of its shard
    in the reports; the best informed one (most covered, least overdue) stands for the shard."""
    return [
        _row("Probes"),
        _timeseries(
            "Pair coverage per pool",
            [_target("max by (pool) (gpuwarden_probe_pair_coverage_ratio)", "{{pool}}")],
            unit="percentunit",
            description="Share of the node pairs within each leaf (else rack) group tested ok within "
            "the coverage bound (probes.coverage_bound_seconds). Under 1 for 30 minutes is "
            "GpuwardenProbeCoverageBehind.",
            minimum=0,
            maximum=1,
        ),
        _timeseries(
            "Nodes overdue, and the longest untested",
            [
                _target(_fleet("gpuwarden_probe_nodes_overdue", within="min"), "nodes overdue"),
                _target(
                    _fleet(
                        'gpuwarden_probe_node_untested_seconds{quantile=~"1|0.99"}',
                        "quantile",
                        within="min",
                        across="max",
                    ),
                    "untested, q{{quantile}} (s)",
                ),
                _target("max(gpuwarden_probe_coverage_bound_seconds)", "coverage bound (s)"),
            ],
            description="Nodes not tested ok within the coverage bound, and the seconds since the "
            "longest-untested node (q1) and the 99th percentile were last tested ok. Each shard's "
            "best-informed replica; the overdue nodes summed over shards, the ages the worst "
            "shard's.",
            minimum=0,
        ),
        _timeseries(
            "Probe results per second",
            [
                _target(
                    _fleet(
                        f"sum by (job, instance, kind, ok) (rate(gpuwarden_probe_results_total[{_RI}]))",
                        "kind, ok",
                    ),
                    "{{kind}} ok={{ok}}",
                )
            ],
            description="Results received, each measurement once (both ends of a pair report it). "
            "A failed probe is retried with fresh partners before a link or node is judged.",
            minimum=0,
        ),
        _timeseries(
            "Probes planned and in flight",
            [
                _target(
                    _fleet(
                        "sum by (job, instance, kind, reason) "
                        f"(rate(gpuwarden_probe_assignments_total[{_RI}]))",
                        "kind, reason",
                    ),
                    "{{kind}} {{reason}}/s",
                ),
                _target(_fleet("gpuwarden_probe_in_flight"), "in flight"),
            ],
            description="Probes planned by the leader's scheduler (rotation, confirm re-probes, "
            "preflight, local), and those started and not yet over (capped by probes.max_concurrent).",
            minimum=0,
        ),
    ]


# Cell colours of the matrix, in percent of the fastest pair shown: under 70 % is where the
# aggregator's scheduler re-probes a pair (probes.suspicious_ratio), from 90 % a node counts as a
# known-good partner (probes.known_good_ratio).
_PAIR_THRESHOLDS: Json = {
    "mode": "percentage",
    "steps": [
        {"color": "red", "value": None},
        {"color": "orange", "value": 70},
        {"color": "green", "value": 90},
    ],
}
_PAIR_BANDWIDTH = f'gpuwarden_probe_last_bandwidth_bytes_per_second{{kind="$probe_kind", {_NODES}}}'
_PAIR_ABOUT = (
    "Each agent exports the last result of its own probes per peer "
    "(gpuwarden_probe_last_bandwidth_bytes_per_second{kind, peer}, at most 32 peers per kind, "
    "forgotten after an hour without a probe). Both ends of a pair report it, so a pair appears "
    "as node A with peer B and as node B with peer A."
)


def _pair_probe_panels() -> list[Json]:
    """The agents' own view of their pair probes (agent/metrics.py, ProbeLedger)."""
    matrix: Json = {
        "type": "table",
        "title": "Pair-probe bandwidth matrix",
        "description": "Last bandwidth of the selected pair probe kind between each node (row) and "
        "each peer it probed (column). " + _PAIR_ABOUT + " Colour: relative to the fastest pair "
        "shown (red under 70 %, where the aggregator re-probes a pair; green from 90 %), so select "
        "one pool's nodes in *Node* to compare a pool with itself. An empty cell is a pair not "
        "probed in the last hour, or whose last probe failed (see *Pairs whose last probe failed*). "
        "A table with Grafana's groupingToMatrix transformation (Grafana 10.4 or later): one row "
        "per node, one column per peer, readable where a heatmap of node names is not.",
        "datasource": _DS,
        "targets": [_target(f"max by (node, peer) ({_PAIR_BANDWIDTH})", instant=True, fmt="table")],
        "fieldConfig": {
            "defaults": {
                "unit": "Bps",
                "decimals": 1,
                # min 0 and max computed over every column (fieldMinMax off): a cell's percentage
                # is its share of the fastest pair in the whole matrix, not of its own column.
                "min": 0,
                "fieldMinMax": False,
                "thresholds": _PAIR_THRESHOLDS,
                "color": {"mode": "thresholds"},
                "custom": {"align": "center", "cellOptions": {"type": "color-background", "mode": "basic"}},
            },
            "overrides": [
                # The row names: plain text, not coloured by a threshold.
                _override(
                    "byType",
                    "string",
                    {"custom.cellOptions": {"type": "auto"}, "custom.align": "left"},
                )
            ],
        },
        "options": {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
        "transformations": [
            {
                "id": "groupingToMatrix",
                "options": {
                    "rowField": "node",
                    "columnField": "peer",
                    "valueField": "Value",
                    "emptyValue": "null",
                },
            }
        ],
        "_size": (24, 12),
    }
    slowest = f"bottomk(20, max by (node, peer) ({_PAIR_BANDWIDTH}))"
    return [
        _row("Pair probes"),
        matrix,
        _table(
            "Slowest pairs now",
            [
                # refIds spelled out: the overrides below name the columns "Value #<refId>".
                {**_target(slowest, instant=True, fmt="table"), "refId": "A"},
                {
                    **_target(
                        f"{slowest} / scalar(quantile(0.5, max by (node, peer) ({_PAIR_BANDWIDTH})))",
                        instant=True,
                        fmt="table",
                    ),
                    "refId": "B",
                },
            ],
            description="The 20 pairs with the lowest last bandwidth of the selected kind, and each as "
            "a share of the median pair of the selected nodes. " + _PAIR_ABOUT,
            overrides=[
                _override("byName", "Value #A", {"displayName": "bandwidth", "unit": "Bps", "decimals": 1}),
                _override(
                    "byName",
                    "Value #B",
                    {
                        "displayName": "share of the median pair",
                        "unit": "percentunit",
                        "thresholds": {
                            "mode": "absolute",
                            "steps": [
                                {"color": "red", "value": None},
                                {"color": "orange", "value": 0.7},
                                {"color": "green", "value": 0.9},
                            ],
                        },
                        "custom.cellOptions": {"type": "color-text"},
                    },
                ),
            ],
            transformations=_without_time_sorted_by("Value #A"),
        ),
        _table(
            "Pairs by last result, failed first",
            [
                _target(
                    f'bottomk(20, max by (node, kind, peer) (gpuwarden_probe_last_ok{{{_NODES}, peer!=""}}))',
                    instant=True,
                    fmt="table",
                )
            ],
            description="Pairs (any kind) whose last probe did not complete come first: a refused "
            "connection, a timeout, an NCCL error; probes skipped because the node was busy do not "
            "count. The error itself is in the node's reports, the link detector's verdict in the "
            "aggregator's API (GET /api/v1/decisions).",
            overrides=[
                _override(
                    "byName",
                    "Value",
                    {
                        "displayName": "last result",
                        "mappings": [
                            {
                                "type": "value",
                                "options": {
                                    "0": {"text": "failed", "color": "red", "index": 0},
                                    "1": {"text": "ok", "color": "green", "index": 1},
                                },
                            }
                        ],
                        "custom.cellOptions": {"type": "color-text"},
                    },
                )
            ],
            transformations=_without_time_sorted_by("Value"),
        ),
        _stat(
            "Pairs whose last probe failed",
            [
                _target(
                    "sum by (kind) "
                    f'(1 - max by (node, kind, peer) (gpuwarden_probe_last_ok{{{_NODES}, peer!=""}}))',
                    "{{kind}}",
                    instant=True,
                )
            ],
            description="Node and peer pairs of the selected nodes whose last probe failed, as their "
            "agents see them (a pair counts once per end that reported it). 0 when all passed.",
            w=6,
        ),
        _timeseries(
            "Probe runs per second, by result",
            [
                _target(
                    f"sum by (kind, result) (rate(gpuwarden_probe_runs_total{{{_NODES}}}[{_RI}]))",
                    "{{kind}} {{result}}",
                )
            ],
            description="Results the selected nodes' agents reported: ok, failed, or skipped (not run "
            "or stopped because a job had the GPUs).",
            minimum=0,
            w=18,
        ),
    ]


def node_drilldown() -> Json:
    panels = [
        _row("Node"),
        _stat("GPUs", [_target(f"count(gpuwarden_gpu_info{{{_NODE}}})", "GPUs", instant=True)], w=6),
        _stat(
            "Last report",
            [
                _target(
                    f"time() - gpuwarden_agent_last_report_timestamp_seconds{{{_NODE}}}", "age", instant=True
                )
            ],
            unit="s",
            w=6,
        ),
        _stat(
            "Collector errors",
            [_target(f"gpuwarden_agent_errors{{{_NODE}}}", "errors", instant=True)],
            description="Collector errors in the agent's last report.",
            w=6,
        ),
        _stat(
            "GPUs throttled",
            [_target(f"node:gpuwarden_gpu_throttled:avg5m{{{_NODE}}}", "share", instant=True)],
            unit="percentunit",
            description="Share of the last 5 minutes the node's GPUs were throttled (power, thermal or "
            "hardware slowdown), averaged over the GPUs.",
            w=6,
        ),
        _text(
            "Decisions",
            "The aggregator keeps this node's state, its reasons with the evidence (GPU UUID, XID, "
            "counters) and its recent decisions; Prometheus only counts them. Open "
            "[${aggregator_url}/api/v1/nodes/${node}](${aggregator_url}/api/v1/nodes/${node}) "
            "(set the *Aggregator URL* variable to an address your browser reaches, e.g. after "
            "`kubectl -n gpuwarden port-forward svc/gpuwarden-aggregator 8080`).",
            w=24,
            h=3,
            links=[
                {
                    "title": "Node in the aggregator API",
                    "url": "${aggregator_url}/api/v1/nodes/${node}",
                    "targetBlank": True,
                }
            ],
        ),
        _row("Clocks, temperature, power"),
        _timeseries(
            "SM clock / max SM clock",
            [
                _target(
                    f"gpuwarden_gpu_sm_clock_hertz{{{_NODE}}} / gpuwarden_gpu_sm_clock_max_hertz{{{_NODE}}}",
                    _GPU_LEGEND,
                )
            ],
            unit="percentunit",
            description="Each GPU's SM clock as a share of its maximum: a GPU well below its peers "
            "under the same load is throttled or degraded.",
            minimum=0,
        ),
        _timeseries(
            "SM clock",
            [
                _target(f"gpuwarden_gpu_sm_clock_hertz{{{_NODE}}}", _GPU_LEGEND),
                _target(f"max(gpuwarden_gpu_sm_clock_max_hertz{{{_NODE}}})", "max"),
            ],
            unit="hertz",
            minimum=0,
        ),
        _timeseries(
            "GPU temperature",
            [_target(f"gpuwarden_gpu_temperature_celsius{{{_NODE}}}", _GPU_LEGEND)],
            unit="celsius",
        ),
        _timeseries(
            "Memory (HBM) temperature",
            [_target(f"gpuwarden_gpu_memory_temperature_celsius{{{_NODE}}}", _GPU_LEGEND)],
            unit="celsius",
        ),
        _timeseries(
            "Power vs limit",
            [
                _target(f"gpuwarden_gpu_power_watts{{{_NODE}}}", _GPU_LEGEND),
                _target(f"gpuwarden_gpu_power_limit_watts{{{_NODE}}}", "GPU {{gpu}} limit"),
            ],
            unit="watt",
            minimum=0,
        ),
        _timeseries(
            "Clock event reasons (share of last 5 minutes)",
            [
                _target(
                    f"gpu_reason:gpuwarden_gpu_clock_event_reason_active:avg5m{{{_NODE}}}",
                    "GPU {{gpu}} {{reason}}",
                )
            ],
            unit="percentunit",
            description="Throttle reasons that lower the clocks under load (power cap, thermal and "
            "hardware slowdown, power brake), as the share of samples they were active.",
            minimum=0,
            maximum=1,
        ),
        _row("Activity (GPM: Hopper and later)"),
        _timeseries(
            "SM and tensor core activity",
            [
                _target(f"gpuwarden_gpu_sm_active_ratio{{{_NODE}}}", "GPU {{gpu}} SM"),
                _target(f"gpuwarden_gpu_tensor_active_ratio{{{_NODE}}}", "GPU {{gpu}} tensor"),
            ],
            unit="percentunit",
            description="NVML GPU Performance Monitoring over the agent's interval: SMs with a warp "
            "active, tensor pipes active. Empty on GPUs without GPM (Ampere and older).",
            minimum=0,
            maximum=1,
        ),
        _timeseries(
            "PCIe and NVLink throughput",
            [
                _target(
                    f"gpuwarden_gpu_pcie_throughput_bytes_per_second{{{_NODE}}}",
                    "GPU {{gpu}} PCIe {{direction}}",
                ),
                _target(
                    f"gpuwarden_gpu_nvlink_throughput_bytes_per_second{{{_NODE}}}",
                    "GPU {{gpu}} NVLink {{direction}}",
                ),
            ],
            unit="Bps",
            description="Bytes per second over the agent's interval, headers included (GPM).",
            minimum=0,
        ),
        _row("Memory errors"),
        _timeseries(
            "ECC errors (volatile) per second",
            [_target(f"gpu:gpuwarden_gpu_ecc_errors:rate5m{{{_NODE}}}", "GPU {{gpu}} {{type}}")],
            description="sbe: corrected single-bit; dbe: uncorrected double-bit. Since the driver loaded.",
            minimum=0,
        ),
        _timeseries(
            "Remapped rows and retired pages",
            [
                _target(f"gpuwarden_gpu_remapped_rows{{{_NODE}}}", "GPU {{gpu}} remapped {{type}}"),
                _target(f"gpuwarden_gpu_remapped_rows_pending{{{_NODE}}}", "GPU {{gpu}} remap pending"),
                _target(f"gpuwarden_gpu_remapped_rows_failure{{{_NODE}}}", "GPU {{gpu}} remap failed"),
                _target(f"gpuwarden_gpu_retired_pages{{{_NODE}}}", "GPU {{gpu}} retired {{cause}}"),
            ],
            description="Row remapping (A100 and later) or page retirement (earlier GPUs): a pending "
            "remap needs a GPU reset, a failed one means no spare row is left.",
            minimum=0,
        ),
        _row("XIDs and interconnect"),
        _timeseries(
            "XID events",
            [
                _target(
                    f"sum by (gpu, code) (increase(gpuwarden_gpu_xid_events_total{{{_NODE}}}[{_RI}]))",
                    "GPU {{gpu}} XID {{code}}",
                )
            ],
            description="XID errors the driver logged, by GPU and code. The series appears with the "
            "node's first XID.",
            minimum=0,
        ),
        _table(
            "XIDs in the last hour",
            [
                _target(
                    f"node_code:gpuwarden_gpu_xid_events:increase1h{{{_NODE}}}",
                    "XID {{code}}",
                    instant=True,
                    fmt="table",
                )
            ],
        ),
        _timeseries(
            "NVLink errors per second",
            [_target(f"gpu:gpuwarden_gpu_nvlink_errors:rate5m{{{_NODE}}}", "GPU {{gpu}} {{type}}")],
            description="CRC flit/data, replay and recovery errors, summed over each GPU's links.",
            minimum=0,
        ),
        _timeseries(
            "NVLink links down",
            [_target(f"sum by (gpu) (1 - gpuwarden_gpu_nvlink_active{{{_NODE}}})", _GPU_LEGEND)],
            minimum=0,
        ),
        _timeseries(
            "PCIe replays per second",
            [_target(f"gpu:gpuwarden_gpu_pcie_replay:rate5m{{{_NODE}}}", _GPU_LEGEND)],
            minimum=0,
        ),
        _timeseries(
            "InfiniBand errors per second, per port",
            [
                _target(
                    _port(f"port:gpuwarden_infiniband_errors:rate5m{{{_NODE}}}"),
                    "{{nic}} {{error}}",
                )
            ],
            minimum=0,
        ),
        _timeseries(
            "NIC link state",
            [
                _target(_port(f"gpuwarden_nic_up{{{_NODE}}}"), "{{nic}} up"),
                _target(_port(f"gpuwarden_nic_physical_link_up{{{_NODE}}}"), "{{nic}} physical"),
            ],
            minimum=0,
            maximum=1,
        ),
    ]
    return _dashboard(
        "gpuwarden-node",
        "gpuwarden / Node",
        "One node's GPUs and NICs as its agent reports them, and where to find its decisions.",
        [
            _query_var("node", "Node", "label_values(gpuwarden_agent_info, node)"),
            _aggregator_url_var(),
        ],
        panels,
        links=[
            {
                "title": "Node in the aggregator API",
                "type": "link",
                "url": "${aggregator_url}/api/v1/nodes/${node}",
                "targetBlank": True,
                "icon": "external link",
            }
        ],
    )


def _job_panels() -> list[Json]:
    """The jobs' own collectives (NCCL Inspector), as the aggregator's job localizer last saw them.

    Its tables are top-N lists (detectors.jobs.top_n): the slowest jobs, communicators and the
    ranks others wait for, not one series per communicator. Every aggregator replica exports the
    whole fleet's, so panels take the max over replicas, never a sum."""
    return [
        _row("Jobs (NCCL Inspector)"),
        _timeseries(
            "Bus bandwidth per job (the slowest jobs)",
            [_target("max by (workload) (gpuwarden_job_busbw_gigabytes_per_second)", "{{workload}}")],
            unit="GBs",
            description="Median bus bandwidth of each job's inter-node communicators (data-parallel rings, "
            "pipeline pairs) over the job localizer's window, for the jobs whose level is lowest.",
            minimum=0,
        ),
        _timeseries(
            "Job level (1 = like its peers)",
            [_target("max by (workload) (gpuwarden_job_level_ratio)", "{{workload}}")],
            description="A job's single-node (NVLink) communicators' bandwidth over the fleet's for the same "
            "collective and size. Under 1 everywhere is the job's workload: nothing is blamed for it.",
            minimum=0,
        ),
        _table(
            "Slowest communicators",
            [
                _target(
                    "bottomk(10, max by (workload, communicator, collective, nnodes) "
                    "(gpuwarden_job_communicator_ratio))",
                    "",
                    instant=True,
                    fmt="table",
                )
            ],
            description="Inter-node communicators whose bandwidth is lowest against their job's level "
            "(under 0.85: low; a NIC or a link is blamed only where they agree on one).",
            transformations=_without_time_sorted_by("Value"),
        ),
        _table(
            "Straggler ranks",
            [
                _target(
                    "topk(10, max by (workload, host, communicator, rank) "
                    "(gpuwarden_job_straggler_wait_ratio))",
                    "",
                    instant=True,
                    fmt="table",
                )
            ],
            description="Ranks the others wait for: with GPU kernel timing their own kernel is the shortest; "
            "the value is how much longer the others' kernels took (0.5 = 50 %).",
            transformations=_without_time_sorted_by("Value"),
        ),
    ]


def network() -> Json:
    panels = [
        _row("Degraded links"),
        _timeseries(
            "Link decisions (last 15 minutes)",
            [
                _target(
                    "sum by (state) "
                    '(job_detector_state:gpuwarden_aggregator_decisions:increase15m{detector="link"})',
                    "{{state}}",
                )
            ],
            description="Decisions of the link detector (a port or link degraded, or recovered) in the "
            "15 minutes before each point. Which links: the aggregator's API (GET /api/v1/decisions).",
            minimum=0,
        ),
        _stat(
            "Ports down",
            [_target(f"sum(1 - gpuwarden_nic_up{{{_NODES}}})", "ports", instant=True)],
            description="NIC ports whose state is not active/up on the selected nodes.",
            w=6,
        ),
        _stat(
            "Ports physically down",
            [_target(f"sum(1 - gpuwarden_nic_physical_link_up{{{_NODES}}})", "ports", instant=True)],
            w=6,
        ),
        _row("InfiniBand"),
        _timeseries(
            "InfiniBand errors per second, per port",
            [
                _target(
                    _port(f"port:gpuwarden_infiniband_errors:rate5m{{{_NODES}}}"),
                    "{{node}} {{nic}} {{error}}",
                )
            ],
            description="Link error counters only (symbol errors, link downed and recovery, receive "
            "errors, integrity, buffer overruns, transmit discards); congestion is not an error.",
            minimum=0,
        ),
        _table(
            "Worst ports now",
            [
                _target(
                    "topk(20, sum by (node, device, port) "
                    f"(port:gpuwarden_infiniband_errors:rate5m{{{_NODES}}}))",
                    "",
                    instant=True,
                    fmt="table",
                )
            ],
            description="The 20 ports with the highest error rate over the last 5 minutes.",
        ),
        _timeseries(
            "NIC link state",
            [_target(_port(f"gpuwarden_nic_up{{{_NODES}}}"), "{{node}} {{nic}}")],
            minimum=0,
            maximum=1,
        ),
        _timeseries(
            "Link speed",
            [_target(_port(f"gpuwarden_nic_link_speed_bytes{{{_NODES}}}"), "{{node}} {{nic}}")],
            unit="Bps",
            description="A port that trained at a lower speed than its peers is degraded.",
            minimum=0,
        ),
        _timeseries(
            "Receive and transmit",
            [
                _target(
                    f"sum by (node) (port:gpuwarden_nic_receive_bytes:rate5m{{{_NODES}}})", "{{node}} rx"
                ),
                _target(
                    f"sum by (node) (port:gpuwarden_nic_transmit_bytes:rate5m{{{_NODES}}})", "{{node}} tx"
                ),
            ],
            unit="Bps",
            minimum=0,
        ),
        _timeseries(
            "Transmit wait (congestion) per second",
            [
                _target(
                    _port(f"rate(gpuwarden_infiniband_port_transmit_wait_total{{{_NODES}}}[{_RI}])"),
                    "{{node}} {{nic}}",
                )
            ],
            description="Ticks data waited for flow-control credits: congestion, not a broken link.",
            minimum=0,
        ),
        *_pair_probe_panels(),
        *_job_panels(),
        _row("NVLink"),
        _timeseries(
            "NVLink errors per second",
            [
                _target(
                    f"sum by (node, gpu) (gpu:gpuwarden_gpu_nvlink_errors:rate5m{{{_NODES}}})",
                    "{{node}} GPU {{gpu}}",
                )
            ],
            minimum=0,
            w=24,
        ),
    ]
    return _dashboard(
        "gpuwarden-network",
        "gpuwarden / Network",
        "InfiniBand and NIC ports across the fleet, the pair-probe bandwidth between nodes, NVLink "
        "errors, and the link detector's decisions.",
        [
            _query_var("node", "Node", "label_values(gpuwarden_nic_info, node)", multi=True),
            # Bus bandwidth of an NCCL all-reduce and TCP throughput are different measures: one
            # pair kind at a time. Sorted, so nccl_allreduce_pair comes first where NCCL runs.
            _query_var(
                "probe_kind",
                "Pair probe",
                "label_values(gpuwarden_probe_last_bandwidth_bytes_per_second, kind)",
                regex="/_pair$/",
            ),
        ],
        panels,
    )


def dashboards() -> dict[str, Json]:
    """File name under grafana/dashboards/ -> dashboard."""
    return {
        "fleet-overview.json": fleet_overview(),
        "node.json": node_drilldown(),
        "network.json": network(),
    }


def render(dashboard: Json) -> str:
    """The committed text of a dashboard: stable key order, two-space indent, final newline."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


# --- for tests and the end-to-end run ----------------------------------------------------------------


def _panels(panels: Sequence[Json]) -> Iterator[Json]:
    for panel in panels:
        yield panel
        # A collapsed row keeps its panels inside it.
        yield from _panels(panel.get("panels", ()))


def panel_queries(dashboard: Json) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel, in dashboard order."""
    return [
        (str(panel.get("title", "")), str(target["expr"]))
        for panel in _panels(dashboard.get("panels", ()))
        for target in panel.get("targets", ())
        if "expr" in target
    ]


def variable_queries(dashboard: Json) -> list[tuple[str, str]]:
    """(variable name, query) of every query variable, e.g. ``label_values(metric, label)``."""
    return [
        (str(var["name"]), str(var["definition"]))
        for var in dashboard.get("templating", {}).get("list", ())
        if var.get("type") == "query"
    ]


# A variable name starts with a letter or _: "$1" is label_replace's capture group, which Grafana
# leaves alone as well (it has no variable of that name).
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)")


def expand(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with Grafana's variables replaced: ``values`` first, then ``BUILTIN_DEFAULTS``.

    Raises ``KeyError`` naming a variable that has no value, so a query is never sent half-expanded.
    """

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name in BUILTIN_DEFAULTS:
            return BUILTIN_DEFAULTS[name]
        raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")

    return _VARIABLE.sub(sub, expr)


def write(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, dashboard in dashboards().items():
        path = directory / name
        path.write_text(render(dashboard), encoding="utf-8")
        written.append(path)
    return written


def stale(directory: Path = DASHBOARDS_DIR) -> list[str]:
    """Names of committed dashboards that differ from what this script generates (or are missing)."""
    out = []
    for name, dashboard in dashboards().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render(dashboard):
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if grafana/dashboards/ is stale")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"grafana/dashboards/{name} is stale: run python grafana/generate.py", file=sys.stderr)
        return 1 if names else 0
    for path in write():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
