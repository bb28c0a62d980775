"""The pipeline side of remediation: safety limits (``held``), the breaker, per-rule shadow mode,
preflight verdicts, and the snapshot/restore that carries node health across a restart.

These run the real pipeline on real rules; the Kubernetes side is tested in test_actuator.py and
end to end in test_remediation_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from agent.errors import ConfigError
from agent.report import Report
from aggregator.app import build_pipeline
from aggregator.config import Config, HealthConfig, LimitsConfig, RemediationConfig
from aggregator.decisions import Decision
from aggregator.pipeline import Pipeline
from aggregator.remediate.model import HealthSnapshot, decode_snapshot, encode_snapshot
from aggregator.rules import default_rules_dir, load_rules
from aggregator.rules.model import Rule
from tests.rulekit import T0, edit_nic, report, xid

RULES = load_rules([default_rules_dir()])


def config(**limits: float) -> Config:
    return Config(
        health=HealthConfig(probation_seconds=600.0),
        remediation=RemediationConfig(mode="dry-run", limits=LimitsConfig(**limits)),  # type: ignore[arg-type]
    )


class Fleet:
    """A pipeline fed with reports of nodes n00..nNN in racks of ``rack_size``, every 10 s."""

    def __init__(self, cfg: Config, nodes: int = 20, rack_size: int = 4, rules: list[Rule] = RULES) -> None:
        self.pipeline = build_pipeline(cfg, rules)
        self.names = [f"n{i:02d}" for i in range(nodes)]
        self.rack = {n: f"r{i // rack_size}" for i, n in enumerate(self.names)}
        self.seq = 0
        self.boot = dict.fromkeys(self.names, "boot-1")

    def rep(self, node: str, t: float, *, events: list[int] = ()) -> Report:  # type: ignore[assignment]
        r = report(
            t, node=node, seq=self.seq, events=[xid(c, gpu=3, at=t) for c in events], boot_id=self.boot[node]
        )
        self.seq += 1
        return msgspec.structs.replace(r, labels={"pool": "h100", "rack": self.rack[node]})

    def round(self, t: float, faults: dict[str, list[int]] | None = None) -> None:
        for n in self.names:
            self.pipeline.ingest(self.rep(n, t, events=(faults or {}).get(n, [])), t)

    def decisions(self, node: str | None = None) -> list[Decision]:
        return [d for d in self.pipeline.decisions.recent() if node is None or d.node == node]


def test_quarantines_past_the_pool_share_are_held_and_the_breaker_stays_open() -> None:
    # 20 nodes, 10 %: two may be out. The third XID 79 is held, and so is every later one, even
    # after the first nodes come back: the breaker does not close by itself.
    fleet = Fleet(config(max_per_domain=10))
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n05": [79]})
    fleet.round(T0 + 20, {"n10": [79]})
    by_node = {d.node: d for d in fleet.decisions()}
    assert by_node["n00"].action == by_node["n05"].action == "taint"
    held = by_node["n10"]
    assert (held.state, held.action) == ("quarantined", "held")
    assert any(r.rule == "safety-limit" and "pool h100" in r.summary for r in held.reasons)
    assert fleet.pipeline.limits.open
    intent = fleet.pipeline.intent("n10")
    assert intent is not None and intent.held and intent.effect is None
    # A fourth node, in a pool well under the limit now that the breaker is open: held too.
    fleet.round(T0 + 30, {"n15": [79]})
    assert fleet.decisions("n15")[-1].action == "held"


def test_a_breaker_reset_applies_the_held_quarantines_that_fit_and_is_audited() -> None:
    fleet = Fleet(config(max_per_domain=10, max_pool_share=0.15))  # three of 20
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n05": [79], "n10": [79]})
    fleet.round(T0 + 20, {"n15": [79], "n16": [79]})
    assert [d.action for d in fleet.decisions() if d.node in ("n15", "n16")] == ["held", "held"]
    # A human releases n00 (its GPU was replaced: new boot) and resets the breaker.
    fleet.boot["n00"] = "boot-2"
    fleet.round(T0 + 30)
    state = fleet.pipeline.reset_breaker("alice", T0 + 31)
    assert not state.open and state.reset_by == "alice"
    # n00 is still out (probation); three are out: n15 and n16 still do not fit, the reset
    # applied none and the breaker opened again on the first.
    assert fleet.pipeline.limits.open
    assert fleet.decisions("n15")[-1].action == "held"


def test_after_a_reset_a_held_node_that_fits_is_tainted_with_a_decision() -> None:
    fleet = Fleet(config(max_per_domain=10))
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n05": [79], "n10": [79]})
    assert fleet.decisions("n10")[-1].action == "held"
    fleet.pipeline.config = fleet.pipeline.config  # same limits; make room by raising the share
    fleet.pipeline.limits.config = LimitsConfig(max_pool_share=0.2, max_per_domain=10)
    fleet.pipeline.reset_breaker("bob", T0 + 15)
    last = fleet.decisions("n10")[-1]
    assert (last.state, last.previous, last.action) == ("quarantined", "quarantined", "taint")
    intent = fleet.pipeline.intent("n10")
    assert intent is not None and intent.effect == "NoSchedule" and not intent.held


def test_too_many_nodes_out_in_one_rack_is_held_as_a_domain_problem() -> None:
    fleet = Fleet(config(max_pool_share=1.0, max_per_domain=2), rack_size=4)
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n01": [79], "n02": [79]})
    actions = [d.action for d in fleet.decisions() if d.state == "quarantined"]
    assert actions == ["taint", "taint", "held"]
    held = fleet.decisions("n02")[-1]
    assert any("rack r0" in r.summary for r in held.reasons)


def test_the_hourly_limit_counts_new_quarantines_fleet_wide() -> None:
    fleet = Fleet(config(max_pool_share=1.0, max_per_domain=10, max_per_hour=2))
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n04": [79], "n08": [79]})
    assert [d.action for d in fleet.decisions() if d.state == "quarantined"] == ["taint", "taint", "held"]


def test_a_held_node_whose_evidence_clears_is_never_tainted_or_untainted() -> None:
    fleet = Fleet(config(max_per_domain=10, max_pool_share=0.05))  # one of 20
    fleet.round(T0)
    fleet.round(T0 + 10, {"n00": [79], "n05": [79]})
    fleet.boot["n05"] = "boot-2"  # reboot clears the XID
    t = T0 + 20
    while t < T0 + 2000:
        fleet.round(t)
        t += 10
    states = [(d.state, d.action) for d in fleet.decisions("n05")]
    assert states[0] == ("quarantined", "held")
    assert ("probation", "none") in states and states[-1] == ("healthy", "none")
    assert all(a not in ("taint", "untaint") for _, a in states)


def _rules_file(tmp_path: Path, extra: str) -> list[Rule]:
    path = tmp_path / "trial.yaml"
    path.write_text(
        "rules:\n"
        "  - name: xid-79\n    kind: event\n    codes: [79]\n    severity: critical\n"
        "    action: quarantine\n    hard: true\n    summary: 'GPU {gpu} fell off the bus'\n" + extra
    )
    return load_rules([path])


def test_a_shadow_rule_is_seen_but_never_changes_a_node(tmp_path: Path) -> None:
    rules = _rules_file(tmp_path, "    shadow: true\n")
    fleet = Fleet(config(), rules=rules)
    fleet.round(T0)
    fleet.round(T0 + 10, {"n03": [79]})
    assert fleet.decisions("n03") == []
    assert [f.rule for f in fleet.pipeline.shadow_findings["n03"]] == ["xid-79"]


def test_preflight_passes_after_enough_clean_reports_and_fails_on_a_fault() -> None:
    fleet = Fleet(config())
    p = fleet.pipeline
    for i in range(3):
        fleet.round(T0 + 30 * i, {"n07": [79]} if i == 2 else None)
        if i < 2:
            intent = p.intent("n00")
            assert intent is not None and intent.preflight == "pending"
    n00 = p.intent("n00")
    assert n00 is not None and n00.preflight == "passed"  # 3 clean reports over 60 s
    n07 = p.intent("n07")
    assert n07 is not None and n07.preflight == "failed" and n07.effect == "NoSchedule"


def test_a_rule_may_ask_for_no_execute(tmp_path: Path) -> None:
    fleet = Fleet(config(), rules=_rules_file(tmp_path, "    taint_effect: NoExecute\n"))
    fleet.round(T0)
    fleet.round(T0 + 10, {"n03": [79]})
    intent = fleet.pipeline.intent("n03")
    assert intent is not None and intent.effect == "NoExecute"


def test_taint_effect_on_a_rule_that_does_not_quarantine_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "rules:\n  - name: x\n    kind: event\n    codes: [13]\n    severity: warning\n"
        "    action: alert\n    summary: s\n    taint_effect: NoExecute\n"
    )
    with pytest.raises(ConfigError, match="taint_effect: only a quarantine rule taints"):
        load_rules([path])


# -- restart ------------------------------------------------------------------------------------


def _restart(old: Pipeline, cfg: Config, now: float) -> Pipeline:
    """A new pipeline rebuilt from the snapshots the actuator wrote on the nodes."""
    new = build_pipeline(cfg, RULES)
    for node in old.intent_nodes():
        intent = old.intent(node)
        assert intent is not None
        text = encode_snapshot(intent.snapshot)
        assert len(text) < 8192
        snap = decode_snapshot(text)
        if snap is not None and (snap.tainted or snap.state != "healthy"):
            new.restore(node, snap, intent.reason_code if snap.tainted else None, now)
    return new


def test_with_remediation_off_nothing_is_ever_held() -> None:
    fleet = Fleet(Config(health=HealthConfig(probation_seconds=600.0)))
    fleet.round(T0)
    fleet.round(T0 + 10, {n: [79] for n in fleet.names[:10]})
    assert [d.action for d in fleet.decisions()] == ["taint"] * 10
    assert not fleet.pipeline.limits.open


def test_a_restart_keeps_a_hard_fault_quarantined_until_the_node_reboots() -> None:
    cfg = config(max_per_domain=10)
    fleet = Fleet(cfg)
    fleet.round(T0)
    fleet.round(T0 + 10, {"n03": [79]})
    fleet.pipeline = _restart(fleet.pipeline, cfg, T0 + 20)
    assert fleet.pipeline.intent("n03").effect == "NoSchedule"  # type: ignore[union-attr]
    t = T0 + 20
    while t < T0 + 3000:  # long past grace, clear_for and probation: same boot, stays out
        fleet.round(t)
        t += 10
    assert fleet.decisions("n03") == []
    intent = fleet.pipeline.intent("n03")
    assert intent is not None and intent.state == "quarantined" and intent.effect == "NoSchedule"
    fleet.boot["n03"] = "boot-2"
    while t < T0 + 6000:
        fleet.round(t)
        t += 10
    assert [(d.state, d.action) for d in fleet.decisions("n03")] == [
        ("probation", "none"),
        ("healthy", "untaint"),
    ]


def test_a_link_that_flapped_its_counter_to_the_top_stays_out_across_a_restart() -> None:
    # LinkDownedCounter is 8 bits: a port that flapped it to 255 can no longer count its downs.
    # The quarantine stands while it reads 255, across an aggregator restart, and ends (through
    # probation) once someone clears the counter and the link stays up.
    cfg = config(max_per_domain=10)
    fleet = Fleet(cfg)
    downs = {"value": 250}
    plain = fleet.rep

    def rep(node: str, t: float, *, events: list[int] = ()) -> Report:  # type: ignore[assignment]
        r = plain(node, t, events=events)
        return edit_nic(r, "mlx5_2", c_link_downed=downs["value"]) if node == "n07" else r

    fleet.rep = rep  # type: ignore[method-assign]
    t = T0
    for flap in range(5):  # 250 -> 255, one down every two minutes
        for _ in range(12):
            fleet.round(t)
            t += 10
        downs["value"] = 251 + flap
    assert [(d.state, d.action) for d in fleet.decisions("n07")] == [
        ("suspect", "none"),
        ("quarantined", "taint"),
    ]
    fleet.pipeline = _restart(fleet.pipeline, cfg, t)
    end = t + 7200  # two hours stuck at 255: long past the window, clear_for and probation
    while t < end:
        fleet.round(t)
        t += 10
    assert fleet.decisions("n07") == []
    intent = fleet.pipeline.intent("n07")
    assert intent is not None and intent.state == "quarantined"
    downs["value"] = 0  # cleared by hand (perfquery -R), and no link down since
    while t < end + 3600:
        fleet.round(t)
        t += 10
    assert [(d.state, d.action) for d in fleet.decisions("n07")] == [
        ("probation", "none"),
        ("healthy", "untaint"),
    ]


def test_a_restart_resumes_the_probation_clock_and_keeps_the_lemon_count() -> None:
    cfg = config(max_per_domain=10)
    fleet = Fleet(cfg)
    fleet.round(T0)
    fleet.round(T0 + 10, {"n03": [79]})
    fleet.boot["n03"] = "boot-2"
    t = T0 + 20
    while True:
        fleet.round(t)
        t += 10
        h = fleet.pipeline.health.get("n03")
        if h is not None and h.state == "probation":
            break
    probation_since = fleet.pipeline.health.get("n03").since  # type: ignore[union-attr]
    fleet.pipeline = _restart(fleet.pipeline, cfg, t)
    h = fleet.pipeline.health.get("n03")
    assert h is not None and h.state == "probation" and h.since == probation_since and h.tainted
    assert list(h.quarantines) == [T0 + 10]
    released_at = None
    while t < T0 + 4000:
        fleet.round(t)
        for d in fleet.decisions("n03"):
            if d.state == "healthy":
                released_at = d.time
        if released_at is not None:
            break
        t += 10
    assert released_at is not None
    assert probation_since + 600 <= released_at <= probation_since + 600 + 10


def test_our_taint_without_a_snapshot_is_restored_as_quarantined(tmp_path: Path) -> None:
    new = build_pipeline(config(), RULES)
    new.restore("n09", None, "xid-79", T0)
    intent = new.intent("n09")
    assert intent is not None and intent.state == "quarantined" and intent.effect == "NoSchedule"
    assert intent.reason_code == "xid-79"
    # A node with neither is not invented.
    new.restore("n10", None, None, T0)
    assert new.intent("n10") is None


@pytest.mark.parametrize(
    "text", ["", "{", '{"v": 99, "state": "healthy", "since": 0}', '{"state": "on fire"}']
)
def test_an_unreadable_snapshot_is_none_not_a_crash(text: str) -> None:
    assert decode_snapshot(text) is None


def test_snapshot_round_trips() -> None:
    snap = HealthSnapshot(state="probation", since=T0, tainted=True, quarantines=[T0 - 5], boot_id="b")
    assert decode_snapshot(encode_snapshot(snap)) == snap


def test_quarantines_restored_from_the_last_hour_count_toward_the_hourly_limit() -> None:
    cfg = config(max_pool_share=1.0, max_per_domain=10, max_per_hour=2)
    fleet = Fleet(cfg)
    for node in ("n00", "n04"):
        snap = HealthSnapshot(state="quarantined", since=T0 - 600, tainted=True, quarantines=[T0 - 600])
        fleet.pipeline.restore(node, snap, "xid-79", T0)
    fleet.round(T0)
    fleet.round(T0 + 10, {"n08": [79]})
    assert fleet.decisions("n08")[-1].action == "held"


def test_a_node_we_cannot_hear_is_left_alone() -> None:
    fleet = Fleet(config())
    fleet.round(T0)
    t = T0 + 10
    while t < T0 + 200:  # n03 stops reporting; the others go on
        for n in fleet.names:
            if n != "n03":
                fleet.pipeline.ingest(fleet.rep(n, t), t)
        t += 10
    h = fleet.pipeline.health.get("n03")
    assert h is not None and h.state == "suspect"
    assert fleet.pipeline.intent("n03") is None  # no condition, no event, no taint about our outage
