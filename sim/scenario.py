"""A scenario: the fleet, its background behaviour and its faults, read from a YAML file.

The format is documented in docs/simulator.md; ``load(path)`` and ``parse(data)`` turn it into a
``Scenario`` and refuse anything unknown or impossible with a ``ConfigError`` that names the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import yaml

from agent.errors import ConfigError
from sim.jobs import JobSpec, parse_jobs, validate_jobs
from sim.profiles import PROFILES, NodeProfile, symbol_errors_per_s

START_TIME: Final = 1_764_000_000.0  # 2025-11-24 16:00:00 UTC
APP_XIDS: Final = frozenset({13, 31, 43, 45})  # application errors: never a reason to quarantine

# kind -> (class, fields it requires besides at_s, parameters with their defaults)
FAULT_KINDS: Final[Mapping[str, tuple[str, frozenset[str], Mapping[str, float]]]] = {
    "xid79": ("hard", frozenset({"node", "gpu"}), {}),
    "dbe": ("hard", frozenset({"node", "gpu"}), {}),
    "remap_failure": ("hard", frozenset({"node", "gpu"}), {}),
    "ib_port_down": ("hard", frozenset({"node", "port"}), {}),
    "thermal": ("soft", frozenset({"node", "gpu"}), {"temperature_c": 82.0, "clock_ratio": 0.85}),
    "power_brake": ("soft", frozenset({"node"}), {"clock_ratio": 0.6}),
    "slow_gpu": ("soft", frozenset({"node", "gpu"}), {"ratio": 0.85, "busbw_ratio": 0.9}),
    "pcie_downtrain": ("soft", frozenset({"node", "gpu"}), {"width": 8}),
    "nvlink_crc": ("soft", frozenset({"node", "gpu"}), {"link": 0, "rate_per_s": 2.0}),
    "symbol_storm": ("soft", frozenset({"node", "port"}), {"rate_per_s": 50.0}),
    "slow_nic": ("soft", frozenset({"node"}), {"ratio": 0.7}),
    "degraded_link": ("link", frozenset({"node", "peer"}), {"ratio": 0.65}),
    "silent_rack": ("silent", frozenset({"rack"}), {}),
    "silent_node": ("silent", frozenset({"node"}), {}),
    "app_xid": ("lookalike", frozenset({"node", "gpu"}), {"code": 13}),
    "reboot": ("lookalike", frozenset({"node"}), {"down_s": 180.0}),
    "clock_skew": ("lookalike", frozenset({"node"}), {"seconds": 30.0}),
    # A multi-node job slow everywhere (its workload, not the hardware): sim.jobs.
    "slow_job": ("lookalike", frozenset({"job"}), {"ratio": 0.6}),
}
_FAULT_FIELDS: Final = frozenset(
    {"kind", "node", "peer", "gpu", "port", "rack", "leaf", "job", "at_s", "until_s"}
)
# Kinds that may name a leaf switch instead of their nodes: the simulator then places the fault on
# a pair of that leaf that the probes measure (``sim.fleet.place``).
_BY_LEAF: Final = frozenset({"degraded_link"})


# The low end of the soft faults' magnitudes, for robustness runs (``vary``; bench/othergen.py uses
# the same): a GPU 10 % slow under load, a port at twice its [i] BER budget (sim.profiles), a NIC
# whose pair probes run 25 % slow.
LOW_SLOW_GPU_RATIO: Final = 0.90
LOW_SYMBOL_BER_BUDGETS: Final = 2.0
LOW_SLOW_NIC_RATIO: Final = 0.75
# Faults that ``vary(faults_at_start=True)`` moves to the first report: the detectable ones. The
# silent rack and the look-alikes keep their times (they are not what is being detected early).
_STARTABLE: Final = frozenset({"hard", "soft", "link"})


@dataclass(frozen=True)
class Pool:
    name: str
    profile: NodeProfile
    nodes: int


@dataclass(frozen=True)
class FaultSpec:
    """One fault or look-alike; times are seconds after the scenario's start, in true time."""

    kind: str
    at_s: float
    node: str | None = None
    peer: str | None = None
    gpu: int | None = None
    port: int | None = None
    rack: str | None = None
    until_s: float | None = None
    params: Mapping[str, float] = field(default_factory=dict)
    # A degraded link given by its leaf alone: placed per seed on two healthy nodes of the leaf
    # (one pool) that the probe plan measures after the onset; ``node``/``peer`` stay None until then.
    leaf: str | None = None
    job: str | None = None  # a multinode_jobs name, for slow_job

    @property
    def fault_class(self) -> str:
        return FAULT_KINDS[self.kind][0]

    def active(self, rel: float) -> bool:
        return self.at_s <= rel and (self.until_s is None or rel < self.until_s)

    def param(self, name: str) -> float:
        return float(self.params.get(name, FAULT_KINDS[self.kind][2][name]))


@dataclass(frozen=True)
class Scenario:
    seed: int = 1
    start: float = START_TIME
    duration_s: float = 3600.0
    interval_s: float = 30.0
    pools: tuple[Pool, ...] = ()
    nodes_per_rack: int = 4
    racks_per_leaf: int = 2
    busy_mean_s: float = 1800.0
    idle_mean_s: float = 900.0
    ambient_base_c: float = 24.0
    ambient_amplitude_c: float = 2.0
    ambient_period_s: float = 86_400.0
    ambient_drift_c_per_hour: float = 0.1
    lost_fraction: float = 0.01
    duplicate_fraction: float = 0.005
    jitter_s: float = 2.0
    local_every_s: float = 300.0
    pair_every_s: float = 600.0
    probe_size_bytes: int = 1 << 30
    faults: tuple[FaultSpec, ...] = ()
    multinode_jobs: tuple[JobSpec, ...] = ()  # sim.jobs: jobs spanning nodes, and their collectives
    # Healthy noise multiplier: every healthy random spread (per-report jitter of utilisation,
    # power, the power-capped clock and temperature; probe bandwidth noise) is widened this many
    # times around its centre. 1 is the calibrated fleet (docs/simulator.md, "Noise").
    noise: float = 1.0

    @property
    def node_count(self) -> int:
        return sum(p.nodes for p in self.pools)

    def with_overrides(self, *, seed: int | None, nodes: int | None, minutes: float | None) -> Scenario:
        """The scenario with the command line's overrides; faults past the new end are dropped."""
        s = self
        if seed is not None:
            s = replace(s, seed=seed)
        if minutes is not None:
            if not (math.isfinite(minutes) and minutes > 0):
                raise ConfigError(f"--minutes must be > 0, got {minutes!r}")
            s = replace(
                s, duration_s=minutes * 60.0, faults=tuple(f for f in s.faults if f.at_s <= minutes * 60.0)
            )
        if nodes is not None:
            if nodes < 1:
                raise ConfigError(f"--nodes must be >= 1, got {nodes}")
            s = replace(s, pools=_rescale(s.pools, nodes))
        s.validate()
        return s

    def validate(self) -> None:
        if not self.pools or any(p.nodes < 1 for p in self.pools):
            raise ConfigError("pools: at least one pool with nodes >= 1")
        if len({p.name for p in self.pools}) != len(self.pools):
            raise ConfigError("pools: names must be unique")
        for name in (
            "duration_s",
            "interval_s",
            "local_every_s",
            "pair_every_s",
            "busy_mean_s",
            "idle_mean_s",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be > 0, got {v!r}")
        if not (math.isfinite(self.noise) and self.noise > 0):
            raise ConfigError(f"noise must be > 0, got {self.noise!r}")
        if self.nodes_per_rack < 1 or self.racks_per_leaf < 1:
            raise ConfigError("nodes_per_rack and racks_per_leaf must be >= 1")
        for name in ("lost_fraction", "duplicate_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"delivery.{name} must be in [0, 1)")
        names = set(self.node_names())
        racks = {self.rack_of(i) for i in range(self.node_count)}
        validate_jobs(self.multinode_jobs, self.node_count, lambda i: self.pool_of(i).name)
        for i, f in enumerate(self.faults):
            _validate_fault(f, f"faults[{i}] ({f.kind})", self, names, racks)

    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(self.node_count)]

    def pool_of(self, index: int) -> Pool:
        for p in self.pools:
            if index < p.nodes:
                return p
            index -= p.nodes
        raise IndexError(index)

    def rack_of(self, index: int) -> str:
        return f"rack-{index // self.nodes_per_rack:03d}"

    def leaf_of(self, index: int) -> str:
        return f"leaf-{index // (self.nodes_per_rack * self.racks_per_leaf):02d}"

    def labels_of(self, index: int) -> dict[str, str]:
        return {"pool": self.pool_of(index).name, "rack": self.rack_of(index), "leaf": self.leaf_of(index)}


def vary(
    s: Scenario,
    *,
    noise: float | None = None,
    job_median_s: float | None = None,
    busy_share: float | None = None,
    lost_fraction: float | None = None,
    faults_at_start: bool = False,
    low_magnitudes: bool = False,
    healthy: bool = False,
) -> Scenario:
    """The scenario with robustness knobs applied (None / False: left as the file says).

    ``job_median_s`` and ``busy_share`` set the job timeline: a node's busy and idle stretches are
    exponential (``sim.fleet``), so the median busy stretch is ``busy_mean_s x ln 2`` and the busy
    share ``busy_mean_s / (busy_mean_s + idle_mean_s)``. ``faults_at_start`` moves every hard,
    soft and link fault to the first report; ``low_magnitudes`` sets the low end above
    (``symbol_storm`` at twice the budget of its own port's rate); ``healthy`` drops every hard,
    soft and link fault (look-alikes and silences stay).
    """
    if busy_share is not None and not 0.0 < busy_share < 1.0:
        raise ConfigError(f"busy_share must be in (0, 1), got {busy_share!r}")
    if job_median_s is not None and not (math.isfinite(job_median_s) and job_median_s > 0):
        raise ConfigError(f"job_median_s must be > 0, got {job_median_s!r}")
    out = s
    if noise is not None:
        out = replace(out, noise=noise)
    if lost_fraction is not None:
        out = replace(out, lost_fraction=lost_fraction)
    if job_median_s is not None or busy_share is not None:
        busy_mean = out.busy_mean_s if job_median_s is None else job_median_s / math.log(2.0)
        share = out.busy_mean_s / (out.busy_mean_s + out.idle_mean_s) if busy_share is None else busy_share
        out = replace(out, busy_mean_s=busy_mean, idle_mean_s=busy_mean * (1.0 - share) / share)
    faults = list(out.faults)
    if healthy:
        faults = [f for f in faults if f.fault_class not in _STARTABLE]
    if faults_at_start:
        faults = [replace(f, at_s=0.0) if f.fault_class in _STARTABLE else f for f in faults]
    if low_magnitudes:
        faults = [_low(out, f) for f in faults]
    out = replace(out, faults=tuple(faults))
    out.validate()
    return out


def _low(s: Scenario, f: FaultSpec) -> FaultSpec:
    if f.kind == "slow_gpu":
        return replace(f, params={**f.params, "ratio": LOW_SLOW_GPU_RATIO})
    if f.kind == "slow_nic":
        return replace(f, params={**f.params, "ratio": LOW_SLOW_NIC_RATIO})
    if f.kind == "symbol_storm" and f.node is not None:
        rate = s.pool_of(int(f.node[4:])).profile.nic_rate_bytes_per_second
        return replace(
            f, params={**f.params, "rate_per_s": symbol_errors_per_s(LOW_SYMBOL_BER_BUDGETS, rate)}
        )
    return f


def node_name(index: int) -> str:
    return f"gpu-{index:04d}"


def silenced_nodes(s: Scenario, f: FaultSpec) -> list[str]:
    """The nodes a silence cuts off: its rack's (``silent_rack``) or its one node (``silent_node``)."""
    if f.kind == "silent_node":
        return [f.node] if f.node is not None else []
    return [name for i, name in enumerate(s.node_names()) if s.rack_of(i) == f.rack]


def _rescale(pools: tuple[Pool, ...], total: int) -> tuple[Pool, ...]:
    """The pools resized to ``total`` nodes in their proportions (largest remainder, at least one each)."""
    if total < len(pools):
        raise ConfigError(f"--nodes {total} is fewer than the scenario's {len(pools)} pools")
    old = sum(p.nodes for p in pools)
    shares = [p.nodes * total / old for p in pools]
    counts = [max(1, math.floor(s)) for s in shares]
    order = sorted(range(len(pools)), key=lambda i: shares[i] - math.floor(shares[i]), reverse=True)
    k = 0
    while sum(counts) < total:
        counts[order[k % len(order)]] += 1
        k += 1
    while sum(counts) > total:
        i = max(range(len(counts)), key=lambda j: counts[j])
        counts[i] -= 1
    return tuple(replace(p, nodes=n) for p, n in zip(pools, counts, strict=True))


def _validate_fault(f: FaultSpec, where: str, s: Scenario, names: set[str], racks: set[str]) -> None:
    if not (math.isfinite(f.at_s) and 0 <= f.at_s <= s.duration_s):
        raise ConfigError(f"{where}: at_s must be within 0..{s.duration_s:g}, got {f.at_s!r}")
    if f.until_s is not None and not f.until_s > f.at_s:
        raise ConfigError(f"{where}: until_s must come after at_s, got {f.until_s!r}")
    for end in (f.node, f.peer):
        if end is not None and end not in names:
            raise ConfigError(
                f"{where}: unknown node {end!r} (nodes are gpu-0000..{node_name(len(names) - 1)})"
            )
    if f.peer is not None and f.peer == f.node:
        raise ConfigError(f"{where}: peer must differ from node")
    if f.job is not None and f.job not in {j.name for j in s.multinode_jobs}:
        raise ConfigError(f"{where}: unknown job {f.job!r} (not in multinode_jobs)")
    if f.rack is not None and f.rack not in racks:
        raise ConfigError(f"{where}: unknown rack {f.rack!r}")
    if f.leaf is not None:
        leaves = sorted({s.leaf_of(i) for i in range(len(names))})
        if f.leaf not in leaves:
            raise ConfigError(f"{where}: unknown leaf {f.leaf!r} (leaves are {leaves[0]}..{leaves[-1]})")
    index = int(f.node[4:]) if f.node else 0
    profile = s.pool_of(index).profile
    if f.gpu is not None and not 0 <= f.gpu < profile.gpus:
        raise ConfigError(f"{where}: GPU {f.gpu} is not one of the node's {profile.gpus}")
    if f.port is not None and not 0 <= f.port < profile.nics:
        raise ConfigError(f"{where}: port mlx5_{f.port} is not one of the node's {profile.nics}")
    if f.kind == "app_xid" and int(f.param("code")) not in APP_XIDS:
        raise ConfigError(f"{where}: XID {f.param('code'):g} is not an application XID {sorted(APP_XIDS)}")
    if f.kind == "nvlink_crc" and not 0 <= int(f.param("link")) < profile.nvlinks:
        raise ConfigError(f"{where}: NVLink {f.param('link'):g} is not one of the GPU's {profile.nvlinks}")
    for name in ("ratio", "busbw_ratio", "clock_ratio"):
        if name in FAULT_KINDS[f.kind][2] and not 0 < f.param(name) <= 1:
            raise ConfigError(f"{where}: {name} must be in (0, 1], got {f.param(name)!r}")
    if f.kind == "thermal" and not f.param("temperature_c") < 85.0:
        raise ConfigError(
            f"{where}: temperature_c must stay under the 85 C alert (a soft fault), "
            f"got {f.param('temperature_c')!r}"
        )
    if f.kind == "degraded_link" and f.peer is not None and f.node is not None:
        a, b = int(f.node[4:]), int(f.peer[4:])
        if (s.leaf_of(a), s.pool_of(a).name) != (s.leaf_of(b), s.pool_of(b).name):
            raise ConfigError(
                f"{where}: {f.node} and {f.peer} are not in the same leaf and pool, so never probed as a pair"
            )


def _number(data: Mapping[str, Any], key: str, where: str, default: float) -> float:
    v = data.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{where}{key}: expected a number, got {v!r}")
    return float(v)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = data.get(key, {})
    if not isinstance(v, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {type(v).__name__}")
    return v


def _check_keys(data: Mapping[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")


def _parse_fault(raw: Any, where: str) -> FaultSpec:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(sorted(FAULT_KINDS))}, got {kind!r}")
    _, required, defaults = FAULT_KINDS[kind]
    _check_keys(raw, _FAULT_FIELDS | set(defaults), where)
    if kind in _BY_LEAF and raw.get("leaf") is not None:
        if any(k in raw for k in required):
            raise ConfigError(
                f"{where} ({kind}): give either leaf or {' and '.join(sorted(required))}, not both"
            )
        required = frozenset({"leaf"})
    missing = sorted(k for k in required if raw.get(k) is None)
    if missing:
        raise ConfigError(f"{where} ({kind}): missing {', '.join(missing)}")
    stray = sorted(
        k for k in ("node", "peer", "gpu", "port", "rack", "leaf", "job") if k in raw and k not in required
    )
    if stray:
        raise ConfigError(f"{where} ({kind}): {', '.join(stray)} does not apply to this kind")
    for k in ("node", "peer", "rack", "leaf", "job"):
        if k in raw and not isinstance(raw[k], str):
            raise ConfigError(f"{where}: {k} must be a string")
    for k in ("gpu", "port"):
        if k in raw and (isinstance(raw[k], bool) or not isinstance(raw[k], int)):
            raise ConfigError(f"{where}: {k} must be an integer")
    until = raw.get("until_s")
    return FaultSpec(
        kind=kind,
        at_s=_number(raw, "at_s", f"{where}.", 0.0 if kind == "clock_skew" else math.nan),
        until_s=None if until is None else _number(raw, "until_s", f"{where}.", 0.0),
        node=raw.get("node"),
        peer=raw.get("peer"),
        gpu=raw.get("gpu"),
        port=raw.get("port"),
        rack=raw.get("rack"),
        leaf=raw.get("leaf"),
        job=raw.get("job"),
        params={k: _number(raw, k, f"{where}.", v) for k, v in defaults.items()},
    )


def parse(data: Any) -> Scenario:
    """A validated scenario from the YAML document's data."""
    if not isinstance(data, Mapping):
        raise ConfigError("a scenario is a mapping at the top level")
    top = {
        "seed",
        "start",
        "minutes",
        "interval_s",
        "pools",
        "nodes_per_rack",
        "racks_per_leaf",
        "jobs",
        "ambient",
        "delivery",
        "probes",
        "faults",
        "multinode_jobs",
        "noise",
    }
    _check_keys(data, top, "scenario")
    raw_pools = data.get("pools")
    if not isinstance(raw_pools, list) or not raw_pools:
        raise ConfigError("pools: expected a non-empty list of {name, profile, nodes}")
    pools = []
    for i, p in enumerate(raw_pools):
        if not isinstance(p, Mapping):
            raise ConfigError(f"pools[{i}]: expected a mapping")
        _check_keys(p, {"name", "profile", "nodes"}, f"pools[{i}]")
        if p.get("profile") not in PROFILES:
            raise ConfigError(
                f"pools[{i}].profile must be one of {', '.join(PROFILES)}, got {p.get('profile')!r}"
            )
        nodes = p.get("nodes")
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise ConfigError(f"pools[{i}].nodes: expected an integer")
        pools.append(Pool(name=str(p.get("name", f"pool-{i}")), profile=PROFILES[p["profile"]], nodes=nodes))
    jobs, ambient, delivery, probes = (_section(data, k) for k in ("jobs", "ambient", "delivery", "probes"))
    _check_keys(jobs, {"busy_mean_s", "idle_mean_s"}, "jobs")
    _check_keys(ambient, {"base_c", "amplitude_c", "period_s", "drift_c_per_hour"}, "ambient")
    _check_keys(delivery, {"lost_fraction", "duplicate_fraction", "jitter_s"}, "delivery")
    _check_keys(probes, {"local_every_s", "pair_every_s", "size_bytes"}, "probes")
    raw_faults = data.get("faults") or []
    if not isinstance(raw_faults, list):
        raise ConfigError("faults: expected a list")
    d = Scenario()
    seed = data.get("seed", d.seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed: expected an integer, got {seed!r}")
    scenario = Scenario(
        seed=seed,
        start=_number(data, "start", "", d.start),
        duration_s=_number(data, "minutes", "", d.duration_s / 60.0) * 60.0,
        interval_s=_number(data, "interval_s", "", d.interval_s),
        pools=tuple(pools),
        nodes_per_rack=int(_number(data, "nodes_per_rack", "", d.nodes_per_rack)),
        racks_per_leaf=int(_number(data, "racks_per_leaf", "", d.racks_per_leaf)),
        busy_mean_s=_number(jobs, "busy_mean_s", "jobs.", d.busy_mean_s),
        idle_mean_s=_number(jobs, "idle_mean_s", "jobs.", d.idle_mean_s),
        ambient_base_c=_number(ambient, "base_c", "ambient.", d.ambient_base_c),
        ambient_amplitude_c=_number(ambient, "amplitude_c", "ambient.", d.ambient_amplitude_c),
        ambient_period_s=_number(ambient, "period_s", "ambient.", d.ambient_period_s),
        ambient_drift_c_per_hour=_number(ambient, "drift_c_per_hour", "ambient.", d.ambient_drift_c_per_hour),
        lost_fraction=_number(delivery, "lost_fraction", "delivery.", d.lost_fraction),
        duplicate_fraction=_number(delivery, "duplicate_fraction", "delivery.", d.duplicate_fraction),
        jitter_s=_number(delivery, "jitter_s", "delivery.", d.jitter_s),
        local_every_s=_number(probes, "local_every_s", "probes.", d.local_every_s),
        pair_every_s=_number(probes, "pair_every_s", "probes.", d.pair_every_s),
        probe_size_bytes=int(_number(probes, "size_bytes", "probes.", d.probe_size_bytes)),
        faults=tuple(_parse_fault(f, f"faults[{i}]") for i, f in enumerate(raw_faults)),
        multinode_jobs=parse_jobs(data.get("multinode_jobs")),
        noise=_number(data, "noise", "", d.noise),
    )
    scenario.validate()
    return scenario


def read_document(path: Path, decode: Callable[[str], Any], invalid: type[Exception], language: str) -> Any:
    """A file's text, decoded; a ``ConfigError`` names the file and why it cannot be read."""
    try:
        return decode(path.read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except invalid as exc:
        raise ConfigError(f"{path}: not valid {language}: {exc}") from exc


def load(path: Path | str) -> Scenario:
    """Read and validate a scenario file."""
    path = Path(path)
    data = read_document(path, yaml.safe_load, yaml.YAMLError, "YAML")
    try:
        return parse(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
