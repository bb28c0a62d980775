"""End to end with the real servers: agents, the aggregator, Prometheus and Alertmanager as processes.

Three agents (fake GPUs on the recorded H100 sysfs tree) ship to one aggregator; Prometheus
(Debian's ``prometheus``) scrapes them all every second with rules/prometheus/*.yml loaded; the
aggregator notifies a real Alertmanager (``prometheus-alertmanager``), which routes to a webhook
receiver in this process. One node starts with a lost GPU (a hard fault): it must be quarantined
at once, alerted in Alertmanager and at the receiver with its labels and runbook, and, once
"repaired" (its agent restarted with healthy GPUs after a reboot, i.e. a new boot_id), released
through probation with the alert resolved. Then every Grafana panel's query must return data from
that Prometheus, and the dcgm-exporter compatibility series must carry dcgm-exporter's units:
every panel of NVIDIA's own dcgm-exporter dashboard (Grafana 12239, tests/fixtures/grafana/) must
show data for the H100 node, its queries unchanged. One node runs a training job (GPM activity)
and had an XID at start: ``increase()`` must count that first XID.

The aggregator runs as it does in a cluster: remediation on (dry-run, against the in-process
Kubernetes API-server double of tests/kube_double.py, served from a thread) and the probe
scheduler on, so that the remediation and probe panels and rules read what it really exports.
The agents run probes too (``tcp_pair`` over loopback, small and frequent): the network
dashboard's pair-probe matrix reads the agents' own ``gpuwarden_probe_last_*`` series, so real
pair results must be in Prometheus, from both ends, before the panels are checked.

Without the binaries the test skips locally and fails in CI (CI=true), where scripts/setup
installs them. Everything listens on 127.0.0.1 on free ports and lives in a temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from asyncio import AbstractEventLoop, new_event_loop, run_coroutine_threadsafe
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.conftest import FIXTURES, REPO, missing_tool
from tests.kube_double import KubeApiDouble
from tests.ports import free_port
from tests.test_grafana import generate  # grafana/generate.py, loaded as a module

GPWD = [sys.executable, "-m", "gpuwarden"]
RULE_FILES = sorted((REPO / "rules" / "prometheus").glob("*.yml"))
SYSFS = FIXTURES / "sysfs" / "h100" / "sys"
HEALTHY = FIXTURES / "gpus" / "h100x8.json"
# Eight busy H100s (GPM values of a training job) and one application XID (13, recorded only).
TRAINING = FIXTURES / "gpus" / "h100x8_training.json"
TRAINING_XID = ("2", "13")  # (gpu, code)
GPU_LOST = FIXTURES / "gpus" / "gpu_lost.json"
# Two A10s: page retirement where H100s remap rows, so the panels of both kinds have a node to show.
A10 = FIXTURES / "gpus" / "old_driver_pcie_card.json"
KMSG_STAT = FIXTURES / "kmsg" / "proc" / "stat"

BROKEN = "gpu-b"  # starts with GPU 5 of 8 lost to NVML
GPUS = {"gpu-a": TRAINING, BROKEN: GPU_LOST, "gpu-c": A10}  # a mixed fleet, as real ones are
H100_GPU_COUNT = 8 + 8  # the GPUs with GPM (Hopper): the A10s have none
# NVIDIA's dcgm-exporter dashboard (Grafana 12239), as published (tests/fixtures/grafana/README.md).
DCGM_DASHBOARD = FIXTURES / "grafana" / "dcgm-exporter-dashboard.json"
GPU_COUNT = 8 + 8 + 2  # once gpu-b is repaired
NODES = tuple(GPUS)
POOL = "pool-e2e"
EXTERNAL_URL = "https://gpuwarden.example"

# Health periods short enough for a test, long enough that each state is seen by a 1 s scrape.
CLEAR_FOR_S = 2.0
PROBATION_S = 4.0
PROBE_KIND = "tcp_pair"  # NCCL needs GPUs; tcp_pair runs on loopback with fake ones
# Probes as a small lab would run them: a round every 2 s, each probe 1 s after it is planned.
PROBES = {
    "pair_kind": PROBE_KIND,
    "local_kind": None,
    "round_seconds": 2,
    "poll_seconds": 1,
    "start_delay_seconds": 1,
    "pair_size_bytes": 2 << 20,
}

# Panels whose series only appear after events this test does not cause; every other panel query
# must return data. (dashboard, panel title): why.
NO_DATA_EXPECTED: dict[tuple[str, str], str] = {
    # Three nodes, all healthy: no slow pair, so no link verdict here.
    ("network.json", "Link decisions (last 15 minutes)"): "the link detector needs more partners",
    # The job-data tables fill only from NCCL Inspector summaries of multi-node jobs, which this
    # fleet's agents do not run (tests/test_detect_jobs.py covers them).
    ("network.json", "Bus bandwidth per job (the slowest jobs)"): "no multi-node job reports here",
    ("network.json", "Job level (1 = like its peers)"): "no multi-node job reports here",
    ("network.json", "Slowest communicators"): "no multi-node job reports here",
    ("network.json", "Straggler ranks"): "no multi-node job reports here",
}
# The metrics those panels need, exported only after their event: a panel may lack data only for
# these, never for a metric name that nothing exports.
EVENT_SERIES: set[str] = {
    "gpuwarden_job_busbw_gigabytes_per_second",
    "gpuwarden_job_level_ratio",
    "gpuwarden_job_communicator_ratio",
    "gpuwarden_job_straggler_wait_ratio",
}
# Recording rules allowed to record nothing here, with the same reason.
RECORDING_WITHOUT_DATA: dict[str, str] = {}

T = TypeVar("T")


# --- binaries, ports, processes -------------------------------------------------------------------


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    missing_tool(names[0], names[0])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Processes:
    """Every process the test starts, so that teardown stops them all, whatever failed."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: Proc) -> None:
        if proc.popen.poll() is None:
            proc.popen.terminate()
            try:
                proc.popen.wait(10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)

    def dead(self) -> str:
        """What the processes that should be running said before they died ("" if none died)."""
        return "\n".join(
            f"--- {p.name} exited with {p.popen.returncode}:\n{p.tail()}"
            for p in self.procs
            if p.popen.poll() is not None and p.popen.returncode not in (0, -15)
        )


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def _until(what: str, probe: Callable[[], T | None], procs: Processes, timeout: float = 20.0) -> T:
    """``probe()``'s first truthy answer, polled until ``timeout``; a clear failure otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except OSError as exc:  # not listening yet, or a reset connection
            last = exc
        else:
            if last:
                found: T = last
                return found
        dead = procs.dead()
        assert not dead, f"while waiting for {what}, a process died:\n{dead}"
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; last saw {last!r}")
        time.sleep(0.2)


VIEWER = "viewer-token-of-the-e2e-test-0123456789"


def _get_json(url: str, token: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        return json.loads(r.read())


def _ready(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return bool(r.status == 200)


# --- the webhook receiver -------------------------------------------------------------------------


class Receiver:
    """Alertmanager's webhook receiver: records every notification POSTed to it."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with received._lock:
                    received.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep the test output to what failed

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def alerts(self, status: str) -> list[dict[str, Any]]:
        """Every alert of that status in any notification so far."""
        with self._lock:
            return [a for n in self.notifications for a in n["alerts"] if a["status"] == status]


class KubeServer:
    """The API-server double on its own event loop in a thread, for the aggregator process to use."""

    def __init__(self) -> None:
        self.api = KubeApiDouble()
        self.loop: AbstractEventLoop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        run_coroutine_threadsafe(self.api.start(), self.loop).result(10)

    def stop(self) -> None:
        run_coroutine_threadsafe(self.api.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    server = KubeServer()
    server.start()
    # The cluster has the test's nodes, in the pool the agents report: the safety limits count
    # every node the cluster has in a pool.
    for node in NODES:
        server.api.add_node(node, labels={"gpuwarden.io/pool": POOL})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


# --- the stack ------------------------------------------------------------------------------------


@dataclass
class Stack:
    procs: Processes
    workdir: Path
    aggregator: str
    alertmanager: str
    prometheus: str
    decisions: Path
    agent_ports: dict[str, int]
    probe_ports: dict[str, int]
    probe_key: Path
    agents: dict[str, Proc]

    def decision_log(self) -> list[dict[str, Any]]:
        if not self.decisions.is_file():
            return []
        return [json.loads(line) for line in self.decisions.read_text().splitlines() if line.strip()]

    def am_alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = _get_json(f"{self.alertmanager}/api/v2/alerts")
        return alerts

    def query(self, expr: str) -> dict[str, Any]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body: dict[str, Any] = _get_json(url)
        except urllib.error.HTTPError as exc:  # 400: a query Prometheus cannot parse or run
            body = json.loads(exc.read())
        return body

    def query_rules(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = _get_json(f"{self.prometheus}/api/v1/rules")["data"]["groups"]
        return groups

    def query_names(self) -> list[str]:
        names: list[str] = _get_json(f"{self.prometheus}/api/v1/label/__name__/values")["data"]
        return names

    def start_agent(self, node: str, gpus: Path, boot_id: str) -> Proc:
        procfs = self.workdir / node / "proc"
        (procfs / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
        (procfs / "sys" / "kernel" / "random" / "boot_id").write_text(boot_id + "\n")
        shutil.copy(KMSG_STAT, procfs / "stat")
        kmsg = self.workdir / node / "kmsg"
        kmsg.touch()
        token = self.workdir / f"{node}.token"
        token.write_text(f"token-of-{node}-0123456789abcdef\n")
        proc = self.procs.start(
            f"agent-{node}-{boot_id[:8]}",
            [
                *GPWD,
                "agent",
                "--node",
                node,
                "--label",
                f"pool={POOL}",
                "--interval",
                "1",
                "--listen",
                f"127.0.0.1:{self.agent_ports[node]}",
                "--aggregator",
                self.aggregator,
                "--token-file",
                str(token),
                "--gpu-backend",
                f"fake:{gpus}",
                "--sysfs-root",
                str(SYSFS),
                "--procfs-root",
                str(procfs),
                "--kmsg-path",
                str(kmsg),
                "--probes",
                "auto",
                "--probe-listen",
                f"127.0.0.1:{self.probe_ports[node]}",
                "--probe-key-file",
                str(self.probe_key),
            ],
        )
        self.agents[node] = proc
        return proc


def _write_yaml(path: Path, data: Any) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def stack(tmp_path: Path, processes: Processes, receiver: Receiver, kube: KubeServer) -> Stack:
    prometheus_bin = _binary("prometheus")
    alertmanager_bin = _binary("prometheus-alertmanager", "alertmanager")
    agg_port, am_port, prom_port = free_port(), free_port(), free_port()
    s = Stack(
        procs=processes,
        workdir=tmp_path,
        aggregator=f"http://127.0.0.1:{agg_port}",
        alertmanager=f"http://127.0.0.1:{am_port}",
        prometheus=f"http://127.0.0.1:{prom_port}",
        decisions=tmp_path / "decisions.jsonl",
        agent_ports={node: free_port() for node in NODES},
        probe_ports={node: free_port() for node in NODES},
        probe_key=tmp_path / "probe-key",
        agents={},
    )

    am_config = _write_yaml(
        tmp_path / "alertmanager.yml",
        {
            "route": {
                "receiver": "hook",
                "group_by": ["alertname", "node"],
                "group_wait": "1s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [
                {"name": "hook", "webhook_configs": [{"url": receiver.url, "send_resolved": True}]}
            ],
        },
    )
    (tmp_path / "am-data").mkdir()
    processes.start(
        "alertmanager",
        [
            alertmanager_bin,
            f"--config.file={am_config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",  # no gossip port: a lone test instance
            "--log.level=warn",
        ],
    )

    s.probe_key.write_text("probe-key-of-the-e2e-test-0123456789\n")
    (tmp_path / "tokens").write_text(
        "".join(f"{node} token-of-{node}-0123456789abcdef\n" for node in NODES) + f"viewer:e2e {VIEWER}\n"
    )
    agg_config = _write_yaml(
        tmp_path / "aggregator.yml",
        {
            "fleet": {"interval_seconds": 1},  # the agents' --interval
            "probes": PROBES,
            "health": {
                "suspect_for_seconds": 10,
                "clear_for_seconds": CLEAR_FOR_S,
                "probation_seconds": PROBATION_S,
            },
            "notify": {
                "alertmanager_url": s.alertmanager,
                "external_url": EXTERNAL_URL,
                "resend_seconds": 2,
                "retry_initial_seconds": 0.2,
                "retry_max_seconds": 1,
            },
        },
    )
    processes.start(
        "aggregator",
        [
            *GPWD,
            "aggregator",
            "--listen",
            f"127.0.0.1:{agg_port}",
            "--token-file",
            str(tmp_path / "tokens"),
            "--decisions",
            str(s.decisions),
            "--config",
            str(agg_config),
            "--remediation",
            "dry-run",
            "--kubeconfig",
            str(kube.api.write_kubeconfig(tmp_path / "kubeconfig")),
            "--identity",
            "gpuwarden-aggregator-0",
            "--probe-key-file",
            str(s.probe_key),
        ],
    )

    prom_config = _write_yaml(
        tmp_path / "prometheus.yml",
        {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in RULE_FILES],
            "scrape_configs": [
                {
                    "job_name": "gpuwarden-agent",
                    "static_configs": [
                        {"targets": [f"127.0.0.1:{port}"], "labels": {"node": node}}
                        for node, port in s.agent_ports.items()
                    ],
                },
                {
                    "job_name": "gpuwarden-aggregator",
                    "static_configs": [{"targets": [f"127.0.0.1:{agg_port}"]}],
                },
            ],
        },
    )
    processes.start(
        "prometheus",
        [
            prometheus_bin,
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
    )

    _until("aggregator ready", lambda: _ready(f"{s.aggregator}/readyz"), processes, timeout=30)
    for node in NODES:
        s.start_agent(node, GPUS[node], f"{node}-boot-1".ljust(36, "0"))
    _until("alertmanager ready", lambda: _ready(f"{s.alertmanager}/-/ready"), processes, timeout=30)
    _until("prometheus ready", lambda: _ready(f"{s.prometheus}/-/ready"), processes, timeout=30)
    return s


# --- the dashboards -------------------------------------------------------------------------------


def _series_names(expr: str, known: set[str]) -> set[str]:
    """The metric names an expression reads: its identifiers that name gpuwarden series."""
    idents = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", re.sub(r'"[^"]*"', '""', expr)))
    return {i for i in idents if "gpuwarden" in i or i in known}


# --- the test -------------------------------------------------------------------------------------


def _quarantine_alerts(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        a
        for a in alerts
        if a["labels"].get("alertname") == "GpuwardenNodeQuarantined" and a["labels"].get("node") == BROKEN
    ]


def test_hard_fault_is_quarantined_alerted_released_and_every_panel_has_data(
    stack: Stack, receiver: Receiver
) -> None:
    procs = stack.procs

    # 1. The lost GPU quarantines its node at once (a hard finding), and only that node.
    first = _until("the quarantine decision", stack.decision_log, procs)
    [q] = first
    assert (q["subject"], q["node"], q["state"], q["action"]) == ("node", BROKEN, "quarantined", "taint")
    assert [r["rule"] for r in q["reasons"]][:1] == ["gpu-lost"], q["reasons"]

    # 2. Alertmanager has the alert, with the labels on-call routes on and a runbook.
    [alert] = _until("the alert in Alertmanager", lambda: _quarantine_alerts(stack.am_alerts()), procs)
    assert alert["labels"] == {
        "alertname": "GpuwardenNodeQuarantined",
        "severity": "warning",  # routine quarantines do not page by default
        "node": BROKEN,
        "pool": POOL,
        "reason": "gpu-lost",
    }
    assert alert["status"]["state"] == "active"
    ann = alert["annotations"]
    assert ann["runbook_url"].startswith("https://") and ann["runbook_url"].endswith(
        "/docs/runbooks/GpuwardenNodeQuarantined.md"
    )
    assert "GPU 5" in ann["summary"] and "lost" in ann["summary"], ann
    assert ann["node_url"] == f"{EXTERNAL_URL}/api/v1/nodes/{BROKEN}"
    # The link works: the aggregator answers that path with the node's state.
    node = _get_json(f"{stack.aggregator}/api/v1/nodes/{BROKEN}", VIEWER)
    assert node["state"] == "quarantined"

    # 3. ... and routed it to the receiver.
    [hooked, *_] = _until(
        "the alert at the receiver", lambda: _quarantine_alerts(receiver.alerts("firing")), procs
    )
    assert hooked["labels"] == alert["labels"]
    assert hooked["annotations"]["runbook_url"] == ann["runbook_url"]

    # 4. Repair: the node reboots (a new boot_id) with all its GPUs back. It goes through
    # probation to healthy, and the alert resolves.
    Processes.stop(stack.agents[BROKEN])
    stack.start_agent(BROKEN, HEALTHY, f"{BROKEN}-boot-2".ljust(36, "0"))
    log = _until(
        "the release",
        lambda: (d := stack.decision_log()) and d[-1]["state"] == "healthy" and d,
        procs,
        timeout=CLEAR_FOR_S + PROBATION_S + 20,
    )
    assert [(d["node"], d["state"]) for d in log] == [
        (BROKEN, "quarantined"),
        (BROKEN, "probation"),
        (BROKEN, "healthy"),
    ]
    assert log[1]["action"] == "none" and log[2]["action"] == "untaint", log
    assert log[2]["time"] - log[1]["time"] >= PROBATION_S
    _until("the alert gone from Alertmanager", lambda: not _quarantine_alerts(stack.am_alerts()), procs)
    [resolved, *_] = _until(
        "the resolved notification", lambda: _quarantine_alerts(receiver.alerts("resolved")), procs
    )
    assert resolved["labels"] == alert["labels"]

    # 5. Prometheus: every rule evaluates without error, ...
    def rules_evaluated() -> list[dict[str, Any]] | None:
        groups = stack.query_rules()
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None

    rules = _until("every rule evaluated", rules_evaluated, procs)
    assert {g["file"] for g in stack.query_rules()} == {str(p) for p in RULE_FILES}
    broken_rules = {r["name"]: r["lastError"] for r in rules if r["health"] != "ok"}
    assert not broken_rules, broken_rules

    # ... the targets are up with the node label the rules expect, ...
    up = stack.query('up{job=~"gpuwarden-agent|gpuwarden-aggregator"} == 1')["data"]["result"]
    assert sorted(r["metric"].get("node", "-") for r in up) == sorted(["-", *NODES]), up

    # ... every recording rule records (one over a rate needs two samples of its counter), ...
    recorded = {r["name"] for r in rules if r["type"] == "recording"}
    deadline = time.monotonic() + 15
    while True:
        empty = {n for n in recorded if not stack.query(f"count({n})")["data"]["result"]}
        if empty <= set(RECORDING_WITHOUT_DATA) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert empty == set(RECORDING_WITHOUT_DATA), f"recording rules without data: {sorted(empty)}"

    # ... the dcgm-exporter names are in dcgm-exporter's units and labels, ...
    _check_dcgm_compat(stack)

    # ... the first XID of a series counts (its counter was seen at 0 before it), ...
    _check_first_xid_counted(stack)

    # ... every panel of NVIDIA's own dcgm-exporter dashboard has data, unchanged, ...
    _check_dcgm_exporter_dashboard(stack)

    # ... remediation ran as the one leader and computed the quarantine's taint (dry-run: counted,
    # not sent; so the node never has a taint to remove), and the probe scheduler covers the
    # agents' pool, ...
    _check_remediation_and_probes(stack)

    # ... the agents measured pairs and export what they measured, ...
    _check_pair_probes(stack)

    # ... and every dashboard panel's query runs and returns data.
    _check_dashboards(stack, recorded)


def _value(stack: Stack, expr: str) -> float | None:
    result = stack.query(expr)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _check_remediation_and_probes(stack: Stack) -> None:
    assert _value(stack, "sum(gpuwarden_remediation_leader)") == 1.0
    assert _value(stack, "max(gpuwarden_remediation_breaker_open)") == 0.0
    taints = 'sum(gpuwarden_remediation_writes_total{kind="taint", result="dry_run"})'
    _until("the dry-run taint counted", lambda: (_value(stack, taints) or 0) >= 1, stack.procs)
    pools = stack.query("gpuwarden_probe_pair_coverage_ratio")["data"]["result"]
    assert {r["metric"]["pool"] for r in pools} == {POOL}, pools
    firing = _get_json(f"{stack.prometheus}/api/v1/alerts")["data"]["alerts"]
    names = {a["labels"]["alertname"] for a in firing}
    assert not names & {
        "GpuwardenRemediationNoLeader",
        "GpuwardenRemediationSplitBrain",
        "GpuwardenBreakerOpen",
        "GpuwardenRemediationWritesFailing",
    }, firing


def _check_pair_probes(stack: Stack) -> None:
    """A pair measured from both ends: each agent exports its own view, under its node label."""
    bandwidth = f'gpuwarden_probe_last_bandwidth_bytes_per_second{{kind="{PROBE_KIND}"}}'

    def both_ends() -> dict[tuple[str, str], float] | None:
        seen = {
            (r["metric"]["node"], r["metric"]["peer"]): float(r["value"][1])
            for r in stack.query(bandwidth)["data"]["result"]
        }
        return seen if any((peer, node) in seen for node, peer in seen) else None

    seen = _until("a pair probe measured from both ends", both_ends, stack.procs)
    for (node, peer), value in seen.items():
        assert node in NODES and peer in NODES and node != peer, seen
        assert 0 < value < 1e12, (node, peer, value)  # bytes per second, loopback
    stamps = stack.query(f'time() - gpuwarden_probe_last_timestamp_seconds{{kind="{PROBE_KIND}"}}')
    ages = [float(r["value"][1]) for r in stamps["data"]["result"]]
    assert ages and all(-5 < age < 120 for age in ages), ages  # unix seconds of this run's probes
    ok = _value(stack, f'sum(gpuwarden_probe_runs_total{{kind="{PROBE_KIND}", result="ok"}})')
    assert ok is not None and ok >= 2, ok


def _by_gpu(stack: Stack, expr: str) -> dict[tuple[str, str], float]:
    body = stack.query(expr)
    assert body["status"] == "success", (expr, body)
    return {
        (r["metric"].get("instance", ""), r["metric"]["gpu"]): float(r["value"][1])
        for r in body["data"]["result"]
    }


def _check_dcgm_compat(stack: Stack) -> None:
    # The fake GPUs report constant values, so the recorded and the raw series compare exactly.
    pairs = {
        "DCGM_FI_DEV_SM_CLOCK": ("gpuwarden_gpu_sm_clock_hertz", 1e-6),  # MHz
        "DCGM_FI_DEV_MAX_SM_CLOCK": ("gpuwarden_gpu_sm_clock_max_hertz", 1e-6),  # MHz
        "DCGM_FI_DEV_POWER_USAGE": ("gpuwarden_gpu_power_watts", 1.0),  # W
        "DCGM_FI_DEV_FB_USED": ("gpuwarden_gpu_memory_used_bytes", 1 / 2**20),  # MiB
        "DCGM_FI_DEV_FB_TOTAL": ("gpuwarden_gpu_memory_total_bytes", 1 / 2**20),  # MiB
        "DCGM_FI_DEV_GPU_UTIL": ("gpuwarden_gpu_utilization_ratio", 100.0),  # %
        "DCGM_FI_DEV_MEM_COPY_UTIL": ("gpuwarden_gpu_memory_utilization_ratio", 100.0),  # %
        "DCGM_FI_DEV_GPU_TEMP": ("gpuwarden_gpu_temperature_celsius", 1.0),  # C
    }
    for dcgm, (ours, factor) in pairs.items():
        got = _by_gpu(stack, dcgm)
        want = {k: v * factor for k, v in _by_gpu(stack, ours).items()}
        assert len(want) == GPU_COUNT, (ours, len(want))
        assert got.keys() == want.keys(), dcgm
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9), (dcgm, key, got[key], value)
    # Sanity of the units themselves, not only of the conversion: an H100 clocks in the GHz range.
    sm = _by_gpu(stack, "DCGM_FI_DEV_MAX_SM_CLOCK")
    assert all(500 < v < 3000 for v in sm.values()), sm

    # The profiling fields (GPM), on the GPUs that have it (the H100s; the A10s have none): ratios
    # and bytes per second, as dcgm-exporter has them; gpu-a runs a training job.
    gpm = {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("gpuwarden_gpu_graphics_engine_active_ratio", ""),
        "DCGM_FI_PROF_SM_ACTIVE": ("gpuwarden_gpu_sm_active_ratio", ""),
        "DCGM_FI_PROF_SM_OCCUPANCY": ("gpuwarden_gpu_sm_occupancy_ratio", ""),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("gpuwarden_gpu_tensor_active_ratio", ""),
        "DCGM_FI_PROF_DRAM_ACTIVE": ("gpuwarden_gpu_dram_active_ratio", ""),
        "DCGM_FI_PROF_PCIE_TX_BYTES": ("gpuwarden_gpu_pcie_throughput_bytes_per_second", "transmit"),
        "DCGM_FI_PROF_PCIE_RX_BYTES": ("gpuwarden_gpu_pcie_throughput_bytes_per_second", "receive"),
        "DCGM_FI_PROF_NVLINK_TX_BYTES": ("gpuwarden_gpu_nvlink_throughput_bytes_per_second", "transmit"),
        "DCGM_FI_PROF_NVLINK_RX_BYTES": ("gpuwarden_gpu_nvlink_throughput_bytes_per_second", "receive"),
    }

    def on_every_h100(selector: str) -> Callable[[], dict[tuple[str, str], float] | None]:
        def probe() -> dict[tuple[str, str], float] | None:
            found = _by_gpu(stack, selector)
            return found if len(found) == H100_GPU_COUNT else None

        return probe

    for dcgm, (ours, direction) in gpm.items():
        selector = f'{ours}{{direction="{direction}"}}' if direction else ours
        want = _until(f"{ours} on every H100 (GPM needs two samples)", on_every_h100(selector), stack.procs)
        got = _by_gpu(stack, dcgm)
        assert got.keys() == want.keys(), dcgm
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9), (dcgm, key, got[key], value)
    tensor = _by_gpu(stack, 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname="gpu-a"}')
    assert len(tensor) == 8 and all(v == pytest.approx(0.63) for v in tensor.values()), tensor
    pcie = _by_gpu(stack, 'DCGM_FI_PROF_PCIE_RX_BYTES{Hostname="gpu-a"}')
    assert set(pcie.values()) == {2600 * 2**20}, pcie  # NVML's MiB/s, in B/s

    [sample] = stack.query('DCGM_FI_DEV_GPU_TEMP{Hostname="gpu-a", gpu="0"}')["data"]["result"]
    labels = sample["metric"]
    assert labels["device"] == "nvidia0" and labels["job"] == "gpuwarden-agent", labels
    assert labels["UUID"].startswith("GPU-") and labels["modelName"], labels
    # hostname beside Hostname (dcgm-exporter is renaming it), and the driver as a label.
    assert labels["hostname"] == labels["Hostname"] == "gpu-a", labels
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", labels["DCGM_FI_DRIVER_VERSION"]), labels
    assert re.fullmatch(r"[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", labels["pci_bus_id"]), labels
    assert "uuid" not in labels  # dcgm-exporter's name is UUID


def _check_first_xid_counted(stack: Stack) -> None:
    gpu, code = TRAINING_XID
    # The agent on gpu-a saw the XID in its first cycles; the series was at 0 in a scrape first.
    recorded = f'node_code:gpuwarden_gpu_xid_events:increase1h{{node="gpu-a", code="{code}"}}'
    counted = _until("the first XID counted by increase()", lambda: _value(stack, recorded), stack.procs)
    # increase() extrapolates to the window's edges, so a little over 1 for one XID.
    assert 0.9 <= counted < 2.5, counted
    raw = _value(stack, f'gpuwarden_gpu_xid_events_total{{node="gpu-a", gpu="{gpu}", code="{code}"}}')
    assert raw == 1.0, raw
    last = _by_gpu(stack, 'DCGM_FI_DEV_XID_ERRORS{Hostname="gpu-a"}')
    assert {g: v for (_, g), v in last.items() if v} == {gpu: float(code)}, last
    assert len(last) == 8, last  # every GPU, 0 where no XID happened


def _grafana_regex(values: set[str]) -> str:
    """What Grafana puts in a query for a multi-value variable set to All: (v1|v2|...), each value
    regex-escaped, and the backslashes escaped again for a PromQL string."""
    escaped = (re.escape(v).replace("\\", "\\\\") for v in sorted(values))
    return "(" + "|".join(escaped) + ")"


def _check_dcgm_exporter_dashboard(stack: Stack) -> None:
    """Every panel of dashboard 12239, its queries as published, for the H100 node gpu-a.

    The dashboard's variables: instance and gpu, both label_values of DCGM_FI_DEV_GPU_TEMP. With
    instance the agent of gpu-a (H100s: every field the dashboard reads exists there) and gpu All,
    each panel must return a series per GPU, or one value for the single-stat panels (sum, avg).
    """
    dashboard = json.loads(DCGM_DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["gnetId"] == 12239
    variables: dict[str, set[str]] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["query"])
        assert match, var
        metric, label = match.groups()
        url = f"{stack.prometheus}/api/v1/series?" + urllib.parse.urlencode({"match[]": metric})
        variables[var["name"]] = {str(series[label]) for series in _get_json(url)["data"]}
    assert len(variables["gpu"]) == 8 and len(variables["instance"]) == len(NODES), variables
    instance = f"127.0.0.1:{stack.agent_ports['gpu-a']}"
    assert instance in variables["instance"]
    values = {"instance": _grafana_regex({instance}), "gpu": _grafana_regex(variables["gpu"])}

    panels = [p for p in dashboard["panels"] if p.get("targets")]
    assert len(panels) == 8, [p.get("title") for p in dashboard["panels"]]
    problems = []
    for panel in panels:
        for target in panel["targets"]:
            expr = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], target["expr"])
            body = stack.query(expr)
            result = body.get("data", {}).get("result", [])
            aggregated = not target.get("legendFormat")  # the gauges: avg(...) and sum(...)
            want = 1 if aggregated else 8
            if body["status"] != "success" or len(result) != want:
                problems.append(f"{panel['title']!r}: {expr} gave {len(result)} series, not {want}: {body}")
    assert not problems, "\n".join(problems)


def _check_dashboards(stack: Stack, recorded: set[str]) -> None:
    known = set(stack.query_names()) | recorded
    seen_allowed: set[tuple[str, str]] = set()
    problems: list[str] = []
    for file, dashboard in generate.dashboards().items():
        variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", ())}
        for name, query in generate.variable_queries(dashboard):
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
            assert match, (file, name, query)
            metric, label = match.groups()
            url = f"{stack.prometheus}/api/v1/series?" + urllib.parse.urlencode({"match[]": metric})
            found = {s.get(label) for s in _get_json(url)["data"]}
            if name == "probe_kind":
                # Grafana offers what the variable's regex keeps: the pair kind the agents ran.
                keep = re.compile(variables[name]["regex"].strip("/"))
                assert {k for k in found if keep.search(k)} == {PROBE_KIND}, (file, name, found)
            else:
                assert found == set(NODES), (file, name, query)

        for title, expr in generate.panel_queries(dashboard):
            # A panel has data when it shows some for one node: the H100s have no retired pages
            # (they remap rows), the A10s no NVLink.
            results = []
            for node in NODES if "$node" in expr else NODES[:1]:
                values = {
                    "datasource": "prometheus",
                    "node": node,
                    "aggregator_url": stack.aggregator,
                    "probe_kind": PROBE_KIND,
                }
                assert variables.keys() <= values.keys(), (file, variables.keys())
                promql = generate.expand(expr, values)
                unknown = _series_names(promql, known) - known - EVENT_SERIES
                if unknown:
                    problems.append(f"{file} {title!r}: {promql} reads {sorted(unknown)}: never exported")
                    break
                body = stack.query(promql)
                if body["status"] != "success":
                    problems.append(f"{file} {title!r}: {promql}: {body.get('error')}")
                    break
                results += body["data"]["result"]
                if results:
                    break
            else:
                if (file, title) in NO_DATA_EXPECTED:
                    seen_allowed.add((file, title))
                else:
                    problems.append(f"{file} {title!r}: {expr} returned no data for any node")
    assert not problems, "\n".join(problems)
    # The allow-list stays minimal: an entry that now has data must go.
    assert seen_allowed == set(NO_DATA_EXPECTED), set(NO_DATA_EXPECTED) - seen_allowed
