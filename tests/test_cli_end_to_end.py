"""The commands as operators run them: ``gpuwarden agent`` and ``gpuwarden aggregator`` as processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent.report import json_schema
from tests.conftest import FIXTURES, RECORDED_SYSFS, REPO
from tests.ports import free_port

GPWD = [sys.executable, "-m", "gpuwarden"]
NODE_TOKEN = "3b8f0c2e9d7a4f61a5c0e2d4"
VIEWER_TOKEN = "9c1d7e2a5b3f4e6d8a0c2b4d"  # reads need a viewer token
H100_SYS = str(FIXTURES / "sysfs" / "h100" / "sys")


def write_node_token(tmp_path: Path) -> None:
    """The aggregator's token file naming node-1 and a viewer, and node-1's own token file, in
    ``tmp_path``."""
    (tmp_path / "tokens").write_text(f"node-1 {NODE_TOKEN}\nviewer:test {VIEWER_TOKEN}\n")
    (tmp_path / "node-1.token").write_text(f"{NODE_TOKEN}\n")


def aggregator_args(port: int, tmp_path: Path) -> list[str]:
    """``aggregator`` on ``port`` with the token file and decision log in ``tmp_path``."""
    return [
        "aggregator",
        "--listen",
        f"127.0.0.1:{port}",
        "--token-file",
        str(tmp_path / "tokens"),
        "--decisions",
        str(tmp_path / "decisions.jsonl"),
    ]


def agent_to(aggregator: str, gpu_backend: str, token_file: Path) -> list[str]:
    """``agent --once`` for node-1 on the H100 tree, shipping to ``aggregator``."""
    return [
        "agent",
        "--once",
        "--node",
        "node-1",
        "--gpu-backend",
        gpu_backend,
        "--sysfs-root",
        H100_SYS,
        "--aggregator",
        aggregator,
        "--token-file",
        str(token_file),
    ]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPWD, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    return _run("agent", "--once", "--print", "--node", "node-1", *args)


def _report(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    jsonschema.Draft202012Validator(json_schema()).validate(report)
    return report


def _int(path: Path) -> int:
    return int(path.read_text().split()[0])


@pytest.mark.parametrize("tree", ["node_exporter", "procfs"])
def test_recorded_tree_report_validates_and_counters_equal_the_files(tree: str) -> None:
    sysfs = RECORDED_SYSFS / tree / "sys"
    report = _report(_agent("--gpu-backend", "none", "--sysfs-root", str(sysfs)))
    assert report["gpus"] == []
    ports = [n for n in report["nics"] if n["port"] is not None]
    assert ports, "no RDMA port reported"
    checked = 0
    for nic in ports:
        base = sysfs / "class" / "infiniband" / nic["device"] / "ports" / str(nic["port"])
        for name, value in nic.get("counters", {}).items():
            for sub in ("hw_counters", "counters_ext", "counters"):  # the collector's precedence
                f = base / sub / name
                if f.is_file():
                    assert value == _int(f), f"{nic['device']}/{nic['port']} {name}"
                    checked += 1
                    break
        words = base / "counters" / "port_rcv_data"
        ext = base / "counters_ext" / "port_rcv_data_64"
        src = ext if ext.is_file() else words
        if src.is_file() and src.read_text().strip().isdigit():
            assert nic["rx_bytes_total"] == 4 * _int(src)  # 4-byte words to bytes
        state = (base / "state").read_text().split(":", 1)[1].strip()
        assert nic["state"] == state
    assert checked >= 10


def test_fake_gpus_fill_every_gpu_field() -> None:
    report = _report(
        _agent(
            "--gpu-backend",
            f"fake:{FIXTURES / 'gpus' / 'h100x8.json'}",
            "--sysfs-root",
            H100_SYS,
        )
    )
    assert [g["index"] for g in report["gpus"]] == list(range(8))
    g = report["gpus"][0]
    for field in ("temperature_celsius", "power_watts", "sm_clock_max_hz", "pcie_link_width_max"):
        assert g[field] is not None, field
    assert g["sm_clock_max_hz"] == 1.98e9 and g["power_limit_watts"] == 700.0
    assert len(g["nvlink"]) == 18
    assert sum(1 for n in report["nics"] if n["link_layer"] == "InfiniBand" and n["port"]) == 8


def test_nvml_missing_is_an_error_in_the_report_and_nics_still_go_out() -> None:
    report = _report(_agent("--gpu-backend", "nvml", "--sysfs-root", H100_SYS))
    assert report["gpus"] == []
    assert any(e["collector"] == "nvml" for e in report["errors"])
    assert len(report["nics"]) >= 8


def test_bad_flags_are_clear_errors() -> None:
    out = _agent("--gpu-backend", "cuda")
    assert out.returncode == 2 and "gpu-backend" in out.stderr.lower() and "Traceback" not in out.stderr
    out = _agent("--node", "Not_A_Node")
    assert out.returncode == 2 and "node name" in out.stderr


def test_agent_to_aggregator_over_http_quarantines_a_lost_gpu(tmp_path: Path) -> None:
    port = free_port()
    write_node_token(tmp_path)
    decisions = tmp_path / "decisions.jsonl"
    server = subprocess.Popen(
        [*GPWD, *aggregator_args(port, tmp_path)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "aggregator did not become ready"
            time.sleep(0.2)

        # A wrong token: --once has no later to retry in, so the 401 is final and said at once,
        # with the aggregator's own reason (the spool would otherwise wait out its 30 s flush).
        (tmp_path / "wrong.token").write_text("0000000000000000000000000\n")
        started = time.monotonic()
        refused = _run(*agent_to(f"http://127.0.0.1:{port}", "none", tmp_path / "wrong.token"))
        assert time.monotonic() - started < 20.0
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines()[-1] == (
            f"gpuwarden agent: error: aggregator http://127.0.0.1:{port} refused the agent's token: "
            "HTTP 401: unknown bearer token (bad_token)"
        )

        out = _run(
            *agent_to(
                f"http://127.0.0.1:{port}",
                f"fake:{FIXTURES / 'gpus' / 'gpu_lost.json'}",
                tmp_path / "node-1.token",
            )
        )
        assert out.returncode == 0, out.stderr
        viewer = {"Authorization": f"Bearer {VIEWER_TOKEN}"}
        node_url = f"http://127.0.0.1:{port}/api/v1/nodes/node-1"
        with urllib.request.urlopen(urllib.request.Request(node_url, headers=viewer), timeout=5) as r:
            node = json.loads(r.read())
        assert node["state"] == "quarantined"
        [d] = [json.loads(line) for line in decisions.read_text().splitlines()]
        assert (d["node"], d["state"], d["action"]) == ("node-1", "quarantined", "taint")
        assert any(r["rule"] == "gpu-lost" for r in d["reasons"]), d["reasons"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert "gpuwarden_aggregator_reports_accepted_total 1.0" in metrics
        # The process's own figures, which the runbooks read (CPU saturation, memory).
        assert re.search(r"^process_cpu_seconds_total \d", metrics, re.M), metrics[-2000:]
        assert re.search(r"^process_resident_memory_bytes \d", metrics, re.M)
        # Every collection is timed by generation, the start-up heap's full collection first.
        full = re.search(
            r'^gpuwarden_aggregator_gc_collection_seconds_count\{generation="2"\} (\S+)', metrics, re.M
        )
        assert full and float(full.group(1)) >= 1, metrics[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=15)
    assert server.returncode == 0
    # What the service built (the imported libraries above all) is frozen out of the cycle
    # collector's full collections once, before the first report: they hold the event loop
    # for a time that grows with every tracked object.
    log = server.stderr.read() if server.stderr else ""
    frozen = re.search(r"startup heap frozen objects=(\d+)", log)
    assert frozen and int(frozen.group(1)) > 50_000, log[-2000:]


def test_an_interval_that_is_not_a_positive_number_is_refused() -> None:
    for bad in ("nan", "inf", "0", "-1"):
        out = _agent("--interval", bad, "--gpu-backend", "none")
        assert out.returncode == 2 and "--interval" in out.stderr, (bad, out.stderr)


def test_aggregator_on_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    write_node_token(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = _run(*aggregator_args(port, tmp_path))
    assert out.returncode == 2, out.stderr
    assert "cannot serve on" in out.stderr and "Traceback" not in out.stderr


def test_the_simulated_fleet_demo_runs_and_scores_itself() -> None:
    out = _run(
        "--log-level", "ERROR", "demo-sim", "--nodes", "64", "--minutes", "4", "--speed", "400", timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "healthy -> quarantined (would taint)" in out.stdout  # the XID 79 two minutes in
    assert "status page: http://127.0.0.1:" in out.stdout
    assert "app_xid" in out.stdout and "not quarantined (right)" in out.stdout
    assert "0 false" in out.stdout and "(0 refused)" in out.stdout


def test_a_sysfs_root_that_does_not_exist_is_an_error_in_the_report_and_the_log(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    out = _agent("--gpu-backend", "none", "--sysfs-root", str(missing))
    report = _report(out)
    assert report["nics"] == []
    said = f"sysfs root {missing} does not exist"
    assert {e["collector"] for e in report["errors"] if said in e["message"]} == {"infiniband", "netdev"}
    assert [line for line in out.stderr.splitlines() if "collector failed" in line and said in line]


def test_a_real_sysfs_without_rdma_devices_is_not_an_error(tmp_path: Path) -> None:
    # The procfs recording's class/net alone: a node with Ethernet and no RDMA device.
    root = tmp_path / "sys"
    shutil.copytree(RECORDED_SYSFS / "procfs" / "sys" / "class" / "net", root / "class" / "net")
    report = _report(_agent("--gpu-backend", "none", "--sysfs-root", str(root)))
    assert [n["device"] for n in report["nics"]] == ["eth0"]
    assert not [e for e in report.get("errors", []) if e["collector"] in ("infiniband", "netdev")]
