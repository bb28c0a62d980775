"""The ports detector: each node's RDMA ports against the same ports on its pool's other nodes.

Driven through the pipeline with the shipped rules, as the service runs it: the cases are the ones
no rule can judge (a port dead from the node's first report, an adapter gone, a link trained at
fewer lanes) and the look-alikes it must leave alone (a second port nobody cabled, a leaf switch
taking one port of many nodes down, a pool too small to say what normal is)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from agent.report import Nic, Report
from aggregator.app import build_pipeline
from aggregator.config import Config, HealthConfig, RemediationConfig
from aggregator.detect.ports import PortsConfig
from aggregator.model import Finding
from aggregator.pipeline import Pipeline
from aggregator.remediate.model import decode_snapshot, encode_snapshot
from aggregator.rules import default_rules_dir, load_rules
from tests.rulekit import NDR_BYTES_PER_SECOND, T0, ib_port, report

RULES = load_rules([default_rules_dir()])
Edit = Callable[[str, int, Nic], Nic | None]  # (node, report number, port) -> the port, or None: gone


def dead(n: Nic) -> Nic:
    """A port that never came up: no cable seen, nothing ever received."""
    return msgspec.structs.replace(
        n, state="DOWN", phys_state="Polling", rx_packets_total=0, tx_packets_total=0
    )


def nics(node: str, i: int, edit: Edit | None) -> list[Nic]:
    out = []
    for k in range(8):
        for port in (1, 2):
            n = ib_port(f"mlx5_{k}", port)
            if port == 2:
                n = dead(n)  # every node: the adapters' second ports are not cabled
            if edit is not None:
                edited = edit(node, i, n)
                if edited is None:
                    continue
                n = edited
            out.append(n)
    return out


def feed(pipeline: Pipeline, nodes: int, reports: Iterable[int], edit: Edit | None) -> None:
    names = [f"n{k:02d}" for k in range(nodes)]
    for i in reports:
        t = T0 + 10.0 * i
        for node in names:
            r: Report = report(t, node=node, seq=i, nics=nics(node, i, edit))
            pipeline.ingest(msgspec.structs.replace(r, labels={"pool": "h100"}), t)


def run(nodes: int, reports: int, edit: Edit | None = None, config: Config | None = None) -> Pipeline:
    pipeline = build_pipeline(config or Config(health=HealthConfig(probation_seconds=600.0)), RULES)
    feed(pipeline, nodes, range(reports), edit)
    return pipeline


def active(pipeline: Pipeline, node: str) -> list[Finding]:
    health = pipeline.health.get(node)
    return [] if health is None else [t.finding for t in health.active()]


def findings(pipeline: Pipeline, node: str) -> list[Finding]:
    return [f for f in active(pipeline, node) if f.detector == "ports"]


def state(pipeline: Pipeline, node: str) -> str:
    health = pipeline.health.get(node)
    return "healthy" if health is None else health.state


def test_a_port_dead_from_the_first_report_is_quarantined_where_the_pool_has_it_up() -> None:
    # mlx5_3/1 of n04 never came up (a bad cable after maintenance). No rule can judge it: it was
    # never up and never received. Its pool has it up everywhere else.
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) else n

    pipeline = run(12, 60, edit)  # 10 minutes
    assert [f.key for f in findings(pipeline, "n04")] == ["port-down:mlx5_3/1"]
    found = findings(pipeline, "n04")[0]
    assert found.action == "quarantine" and not found.hard
    assert found.evidence["pool_share_up"] == round(11 / 12, 4)
    assert "mlx5_3/1 is not up" in found.summary
    assert state(pipeline, "n04") == "quarantined"
    assert not [f for f in active(pipeline, "n04") if f.detector == "rule"]  # only we saw it
    for other in ("n00", "n05", "n11"):
        assert findings(pipeline, other) == [] and state(pipeline, other) == "healthy"


def test_not_before_the_port_has_had_time_to_come_up() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) else n

    pipeline = run(12, 30, edit)  # 5 minutes of reports; the first run sees it at 30 s
    assert findings(pipeline, "n04") == []


def test_an_adapter_that_leaves_the_bus_is_gone_and_quarantined() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic | None:
        return None if (node, n.device) == ("n07", "mlx5_6") and i >= 10 else n

    pipeline = run(12, 70, edit)
    assert sorted(f.key for f in findings(pipeline, "n07")) == ["port-gone:mlx5_6/1"]
    assert state(pipeline, "n07") == "quarantined"


def test_a_node_built_with_fewer_adapters_is_not_broken_by_it() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic | None:
        return None if node == "n07" and n.device in ("mlx5_6", "mlx5_7") else n

    pipeline = run(12, 60, edit)
    assert findings(pipeline, "n07") == [] and state(pipeline, "n07") == "healthy"


def test_a_link_trained_at_one_lane_is_an_alert() -> None:
    one_lane = NDR_BYTES_PER_SECOND / 4  # "100 Gb/sec (1X NDR)"

    def edit(node: str, i: int, n: Nic) -> Nic:
        if (node, n.device, n.port) == ("n02", "mlx5_1", 1):
            return msgspec.structs.replace(n, rate_bytes_per_second=one_lane)
        return n

    pipeline = run(12, 60, edit)
    [found] = findings(pipeline, "n02")
    assert found.key == "port-rate:mlx5_1/1" and found.action == "alert"
    assert "up at 100 Gb/s" in found.summary and "400 Gb/s or more" in found.summary
    assert state(pipeline, "n02") == "suspect"  # on-call is told; the node stays in


def test_a_leaf_switch_down_for_a_third_of_the_pool_is_left_to_the_rules() -> None:
    # mlx5_0/1 of 4 nodes of 12 goes down: up on 8 of 12, under the quorum. Those ports were up
    # before, so ib-port-down judges them (and the safety limits bound it); we say nothing.
    def edit(node: str, i: int, n: Nic) -> Nic:
        if node in ("n00", "n01", "n02", "n03") and (n.device, n.port) == ("mlx5_0", 1) and i >= 5:
            return msgspec.structs.replace(n, state="DOWN", phys_state="Polling")
        return n

    pipeline = run(12, 60, edit)
    for node in ("n00", "n01", "n02", "n03"):
        assert findings(pipeline, node) == []
        assert [f.key for f in active(pipeline, node) if f.detector == "rule"] == ["ib-port-down:mlx5_0/1"]


def test_a_pool_too_small_to_say_what_normal_is_says_nothing() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n01", "mlx5_3", 1) else n

    pipeline = run(PortsConfig().min_pool_nodes - 1, 60, edit)
    assert findings(pipeline, "n01") == []


def test_a_port_that_comes_up_clears_its_finding() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) and i < 60 else n

    pipeline = run(12, 75, edit)
    assert findings(pipeline, "n04") == []


def test_a_quarantine_it_made_stays_across_an_aggregator_restart() -> None:
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) else n

    config = Config(
        health=HealthConfig(probation_seconds=600.0), remediation=RemediationConfig(mode="dry-run")
    )
    before = run(12, 60, edit, config)
    assert state(before, "n04") == "quarantined"
    intent = before.intent("n04")
    assert intent is not None
    snapshot = decode_snapshot(encode_snapshot(intent.snapshot))
    assert snapshot is not None
    after = build_pipeline(config, RULES)
    after.restore("n04", snapshot, intent.reason_code, T0 + 600.0)
    feed(after, 12, range(60, 180), edit)  # 20 minutes more: past the restore grace
    assert state(after, "n04") == "quarantined"
    assert [f.key for f in findings(after, "n04")] == ["port-down:mlx5_3/1"]


def test_a_port_whose_state_could_not_be_read_is_not_down() -> None:
    # A restricted sysfs view, a state file that fails to read: the agent sends no state. The
    # port still carries traffic; not knowing its state is not evidence that it is down.
    def edit(node: str, i: int, n: Nic) -> Nic:
        return (
            msgspec.structs.replace(n, state=None) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) else n
        )

    pipeline = run(12, 60, edit)
    assert findings(pipeline, "n04") == [] and state(pipeline, "n04") == "healthy"


def test_ports_renamed_on_a_node_are_not_gone() -> None:
    # A node rebooted into another naming policy (or a bond): every port comes back up under a
    # new name, and the old names' columns are empty. Nothing left the bus.
    def edit(node: str, i: int, n: Nic) -> Nic:
        if node == "n05" and i >= 10:
            return msgspec.structs.replace(n, device=n.device.replace("mlx5_", "ibp"))
        return n

    pipeline = run(12, 70, edit)
    assert findings(pipeline, "n05") == [] and state(pipeline, "n05") == "healthy"


def test_a_node_back_from_a_long_silence_waits_again() -> None:
    # The port was down for two minutes, the node went silent for ten (a reboot), and came back
    # with the port still training: its wait starts again, it does not carry the old start.
    def edit(node: str, i: int, n: Nic) -> Nic:
        return dead(n) if (node, n.device, n.port) == ("n04", "mlx5_3", 1) else n

    pipeline = build_pipeline(Config(health=HealthConfig(probation_seconds=600.0)), RULES)
    every = [f"n{k:02d}" for k in range(12)]
    for i in range(110):
        t = T0 + 10.0 * i
        for node in every:
            if node == "n04" and 12 <= i < 72:
                continue  # silent
            r: Report = report(t, node=node, seq=i, nics=nics(node, i, edit))
            pipeline.ingest(msgspec.structs.replace(r, labels={"pool": "h100"}), t)
        if i == 80:  # 80 s after it came back: the old start would already be past the wait
            assert findings(pipeline, "n04") == []
    assert [f.key for f in findings(pipeline, "n04")] == ["port-down:mlx5_3/1"]
