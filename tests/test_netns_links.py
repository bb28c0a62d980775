"""A real degraded-link test: agents in network namespaces, real TCP probes, ``tc`` throttling.

Six node namespaces hang off one bridge in a hub namespace (``tests/netns.py``); the real
``gpuwarden aggregator`` runs in the hub, and a real ``gpuwarden agent`` runs in each node
namespace with ``tcp_pair`` probes on, fake idle GPUs and an empty sysfs (the host's NICs are
none of its business). The aggregator's scheduler pairs the nodes, the agents move bytes over
the veths, and the link localizer reads the results. Two faults at once, in one flowing scenario
(one lab, one aggregator: the faults are in disjoint places, and the localizer's verdicts are
per node and per pair, so each is judged as if alone; running them together halves the time):

- ``SLOW_NODE``: its veth is throttled both ways, so every pair with it is slow: it must be
  quarantined by the ``link`` detector, and no other node may be;
- ``PATH``: only the traffic between its two ends is throttled (htb, a u32 filter on the other
  end's address): a degraded link decision for that pair, with neither end quarantined;

then both are un-throttled: the link returns to healthy and the node goes through probation to
healthy with its taint lifted. The decision log (docs/spec.md section 2) is the evidence.

Every node's veth is shaped to ``BASE_RATE`` and a throttled path to ``SLOW_RATE``, a tenth of
it. The baseline cap is what makes the test stable on a small CI machine: unshaped, a 16 MiB
transfer between namespaces takes ~10 ms and its measured rate follows CPU scheduling (seven
Python processes on two cores), while paced by tbf every healthy pair measures the same rate to a
few per cent; a tenfold drop is then unmistakable for both the scheduler and the localizer.

The tests need root, ``ip`` and ``tc``. Where they are missing the tests fail, saying so (CI runs
as root), unless ``GPUWARDEN_SKIP_NETNS=1`` asks to skip them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import pytest

from aggregator.decisions import Decision, read_decisions
from tests import netns
from tests.conftest import REPO

pytestmark = pytest.mark.root

SKIP_ENV: Final = "GPUWARDEN_SKIP_NETNS"
GPUWARDEN: Final = str(Path(sys.executable).with_name("gpuwarden"))
NODES: Final = 6
BASE_RATE: Final = "1gbit"
SLOW_RATE: Final = "100mbit"
SLOW_NODE: Final = "node2"
PATH: Final = ("node0", "node5")
PORT: Final = 8080  # the hub namespace is ours alone: any port is free there
PROBE_PORT: Final = 9402
TOKEN_PREFIX: Final = "netns-test-token-"
PROBE_KEY: Final = "netns-test-probe-key-0123456789abcdef"

# Fleet-scale timings (10-minute rounds, half-hour half-lives) cut to seconds so the whole story
# (detect, act, un-throttle, probation, release) fits in about a minute and a half.
CONFIG: Final = """\
fleet:
  interval_seconds: 2.0          # agents report every 1 s; stale after 2 intervals (4 s)
health:
  suspect_for_seconds: 6.0       # a finding must hold over 3 localizer runs to act
  clear_for_seconds: 3.0
  probation_seconds: 6.0
detectors:
  link:
    every_seconds: 2.0
    half_life_seconds: 60.0      # longer than max_age: every partner weighs about the same
    max_age_seconds: 40.0        # two rotations of a pair; what the healing waits for
    dedupe_seconds: 1.0          # both ends' copies of one probe land within ~0.1 s
    judge_after_seconds: 4.0     # one round: a fresh end is judged on the partners that follow
    min_partners: 3
links:
  link_clear_for_seconds: 6.0
remediation:
  mode: "off"
probes:
  pair_kind: tcp_pair
  local_kind: null
  pair_size_bytes: 16777216      # 16 MiB: 0.13 s at 1 Gbit/s, 1.3 s at 100 Mbit/s
  round_seconds: 4.0             # one pair per node per round; 6 nodes meet all in 5 rounds
  cross_group_every: 0
  poll_seconds: 1.0
  start_delay_seconds: 1.5       # both ends poll (every 1 s) before the probe starts
  pair_deadline_seconds: 10.0
  pair_again_after_seconds: 3.0  # confirm re-probes of a pair, kept apart from dedupe_seconds
  expected_min_results: 3        # confirms start after the first round's results
"""
DETECT_WITHIN_S: Final = 90.0
# detectors.link.max_age_seconds + links.link_clear_for_seconds + detectors.link.every_seconds
SETTLE_S: Final = 40.0 + 6.0 + 2.0
HEAL_WITHIN_S: Final = 90.0


def _lab_or_fail() -> netns.Lab:
    why = netns.unavailable()
    if why is None:
        netns.sweep_leftovers()
        try:
            return netns.Lab.create(NODES, tag="links", node_rate=BASE_RATE)
        except netns.NetnsError as exc:
            why = f"cannot build the namespace lab: {exc}"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(why)
    pytest.fail(f"{why} (set {SKIP_ENV}=1 to skip these tests where that is expected)")


@pytest.fixture
def lab() -> Iterator[netns.Lab]:
    built = _lab_or_fail()
    try:
        yield built
    finally:
        built.destroy()


@dataclass
class Cluster:
    """The aggregator and the agents as processes inside the lab, with their logs."""

    lab: netns.Lab
    workdir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)

    @property
    def decision_log(self) -> Path:
        return self.workdir / "decisions.jsonl"

    def start(self) -> None:
        w = self.workdir
        (w / "config.yaml").write_text(CONFIG)
        (w / "probe.key").write_text(PROBE_KEY)
        (w / "gpus.json").write_text('{"count": 1}')
        (w / "sys").mkdir()
        tokens = [f"{n.name} {TOKEN_PREFIX}{n.index}" for n in self.lab.nodes]
        (w / "tokens").write_text("\n".join(tokens) + "\n")
        self._spawn(
            "aggregator",
            self.lab.hub,
            "aggregator",
            "--listen", f"{netns.HUB_ADDRESS}:{PORT}",
            "--token-file", str(w / "tokens"),
            "--decisions", str(self.decision_log),
            "--config", str(w / "config.yaml"),
            "--probe-key-file", str(w / "probe.key"),
        )  # fmt: skip
        # An agent that finds no aggregator polls again only after 30 s: start them once it serves.
        self._wait_serving()
        for n in self.lab.nodes:
            token = w / f"{n.name}.token"
            token.write_text(f"{TOKEN_PREFIX}{n.index}\n")
            self._spawn(
                n.name,
                n.ns,
                "agent",
                "--node", n.name,
                "--aggregator", f"http://{netns.HUB_ADDRESS}:{PORT}",
                "--token-file", str(token),
                "--interval", "1",
                "--probes", "auto",
                "--probe-listen", f"{n.address}:{PROBE_PORT}",
                "--probe-key-file", str(w / "probe.key"),
                "--gpu-backend", f"fake:{w / 'gpus.json'}",
                "--sysfs-root", str(w / "sys"),
                "--kmsg-path", str(w / "no-kmsg"),
            )  # fmt: skip

    def _wait_serving(self, timeout_s: float = 30.0) -> None:
        connect = f"import socket; socket.create_connection(('{netns.HUB_ADDRESS}', {PORT}), 1).close()"
        began = time.monotonic()
        while True:
            probe = [*self.lab.exec_argv(self.lab.hub), sys.executable, "-c", connect]
            if subprocess.run(probe, capture_output=True, timeout=30, check=False).returncode == 0:
                return
            if self.procs["aggregator"].poll() is not None or time.monotonic() - began > timeout_s:
                pytest.fail(
                    f"the aggregator does not serve on {netns.HUB_ADDRESS}:{PORT}\n{self.diagnosis()}"
                )
            time.sleep(0.2)

    def _spawn(self, name: str, ns: str, *args: str) -> None:
        out = (self.workdir / f"{name}.log").open("wb")
        self._logs.append(out)
        self.procs[name] = subprocess.Popen(
            [*self.lab.exec_argv(ns), GPUWARDEN, *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for f in self._logs:
            f.close()

    def decisions(self) -> list[Decision]:
        return list(read_decisions(self.decision_log)) if self.decision_log.exists() else []

    def diagnosis(self) -> str:
        """What to look at when a wait times out: the decisions and each process's last lines."""
        lines = [f"decisions: {[(d.subject, d.node, d.peer, d.state, d.action) for d in self.decisions()]}"]
        for name in self.procs:
            text = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
            lines.append(f"--- {name} (exit {self.procs[name].poll()}):")
            lines.extend(text[-15:])
        return "\n".join(lines)

    def wait_for(self, what: str, timeout_s: float, done: Callable[[list[Decision]], bool]) -> float:
        """Polls the decision log until ``done`` holds; returns the seconds it took."""
        began = time.monotonic()
        while True:
            if done(self.decisions()):
                return time.monotonic() - began
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() - began > timeout_s:
                why = f"processes exited: {dead}" if dead else f"not within {timeout_s:.0f} s"
                pytest.fail(f"{what}: {why}\n{self.diagnosis()}")
            time.sleep(0.5)


@pytest.fixture
def cluster(lab: netns.Lab, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(lab, tmp_path)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _node(decisions: list[Decision], node: str) -> list[Decision]:
    return [d for d in decisions if d.subject == "node" and d.node == node]


def _link(decisions: list[Decision], pair: tuple[str, str]) -> list[Decision]:
    a, b = sorted(pair)
    return [d for d in decisions if d.subject == "link" and (d.node, d.peer) == (a, b)]


def _quarantined(d: Decision) -> bool:
    return d.state == "quarantined" and d.action == "taint"


def test_a_slow_node_is_quarantined_a_slow_path_is_a_link_and_both_heal(
    lab: netns.Lab, cluster: Cluster
) -> None:
    by_name = {n.name: n for n in lab.nodes}
    lab.throttle_node(by_name[SLOW_NODE], SLOW_RATE)
    lab.throttle_path(by_name[PATH[0]], by_name[PATH[1]], SLOW_RATE, base_rate=BASE_RATE)

    def faults_found(ds: list[Decision]) -> bool:
        return any(_quarantined(d) for d in _node(ds, SLOW_NODE)) and any(
            d.state == "degraded" for d in _link(ds, PATH)
        )

    cluster.wait_for("the slow node quarantined and the slow path degraded", DETECT_WITHIN_S, faults_found)
    found = cluster.decisions()

    quarantine = next(d for d in _node(found, SLOW_NODE) if _quarantined(d))
    assert quarantine.reasons and {r.detector for r in quarantine.reasons} == {"link"}, quarantine
    evidence = quarantine.reasons[0].evidence
    # Real measurements: at least three partners, every one of them about ten times too slow.
    assert evidence["partners"] >= 3 and evidence["effect_ratio"] < 0.3, evidence

    degraded = next(d for d in _link(found, PATH) if d.state == "degraded")
    assert degraded.action == "none" and degraded.reasons[0].detector == "link", degraded
    assert degraded.reasons[0].evidence["residual_ratio"] < 0.3, degraded.reasons[0].evidence

    lab.restore(by_name[SLOW_NODE], BASE_RATE)
    lab.restore(by_name[PATH[0]], BASE_RATE)
    fixed = time.monotonic()

    def healed(ds: list[Decision]) -> bool:
        # Past SETTLE_S every probe from before the fix has aged out of the localizer, so what
        # the log says then is final, not a pause between two verdicts on stale evidence.
        node, link = _node(ds, SLOW_NODE), _link(ds, PATH)
        settled = time.monotonic() - fixed >= SETTLE_S
        return settled and node[-1].state == "healthy" and bool(link) and link[-1].state == "healthy"

    cluster.wait_for("the node released and the link healthy after un-throttling", HEAL_WITHIN_S, healed)
    final = cluster.decisions()

    after = _node(final, SLOW_NODE)
    after = after[after.index(quarantine) + 1 :]
    assert [d.state for d in after][-2:] == ["probation", "healthy"], after
    assert after[-1].action == "untaint", after[-1]

    others = {d.node for d in final if d.subject == "node" and d.state == "quarantined"} - {SLOW_NODE}
    assert not others, f"only {SLOW_NODE} may be quarantined: {others}"
    # Neither the slow node's pairs (its fault, not theirs) nor, after the fix, its stale slow
    # probes may make a degraded link: only the throttled path is one.
    links = {(d.node, d.peer) for d in final if d.subject == "link" and d.state == "degraded"}
    assert links == {tuple(sorted(PATH))}, f"only {PATH} is a slow path: {links}"
    last = {(d.node, d.peer): d.state for d in final if d.subject == "link"}
    assert set(last.values()) <= {"healthy"}, f"links not healthy once every slow probe aged out: {last}"
