"""Multi-node jobs, their NCCL communicators, and the Inspector records their collectives leave.

A job (``multinode_jobs:`` in a scenario) holds whole nodes of one pool, contiguous from ``first``,
for ``at_s``..``until_s``, laid out the way Megatron-style 3-D parallel training places ranks
(tensor-parallel fastest, then data-parallel, then pipeline):

- **tensor parallel (TP)**: one communicator per node, its 8 GPUs, over NVLink/NVSwitch
  (``AllReduce`` of activations);
- **data parallel (DP)**: the nodes are split into ``pp`` pipeline stages of ``nodes / pp``
  contiguous nodes; per stage and local GPU index ``g`` one ring with one rank per node (GPU ``g``
  of each node of the stage, over that GPU's own NIC: rail-optimized), ``nnodes`` = the stage's
  nodes (all the job's nodes when ``pp`` is 1) (``AllReduce`` of gradient buckets);
- **pipeline parallel (PP)**: per pair of consecutive stages, per DP replica and local GPU, a
  two-rank communicator between the two nodes (``Send`` and ``Recv`` of activations and their
  gradients).

Physics, per collective (all ranks of a communicator see the same transfer, set by its slowest
element; the straggler arrives late and, with ``kernel_gpu`` timing, its own kernel is the
shortest while the others' kernels wait for it, as the Inspector's README says):

- the transfer time is ``size x factor / busbw`` with NCCL's bus-bandwidth factor (all-reduce
  ``2(n-1)/n``; ``Send``/``Recv`` 1) and ``busbw`` the hardware's (``sim.profiles``: the local
  all-reduce figure for TP, the pair figure per NIC for DP and PP) times the **smallest** ratio of
  the elements it crosses: a ring runs at the pace of its slowest link. ``slow_nic`` on a node:
  every inter-node communicator with a rank there; ``degraded_link`` between A and B: only the
  communicators whose ring (ranks in order, cyclic) or pair has the A-B hop; ``ib_port_down``:
  the rail of that port (its traffic shares another NIC, half the bandwidth); ``slow_gpu``'s
  ``busbw_ratio``, ``power_brake`` and ``nvlink_crc`` on the node's TP ring as in the local probe;
  ``slow_job`` multiplies every communicator of its job (a workload that is slow everywhere);
- a rank's arrival is late by ``COMPUTE_PER_TRANSFER x transfer x (1/clock ratio - 1)`` when its
  GPU computes slowly (``slow_gpu`` ratio, ``thermal`` and ``power_brake`` clock ratio); at TP
  the GPU's own lateness, at DP and PP the node's slowest GPU's (the node's TP collectives hold
  all its GPUs to its slowest one before they reach the inter-node ones);
- a rank's kernel time is the transfer plus the wait for the last rank to arrive; small noise on
  both (``TRANSFER_NOISE``, ``ARRIVAL_JITTER``).

The Inspector writes each dump interval (``DUMP_INTERVAL_S``) the latest completed operation per
communicator and rank; the node's records for a cycle are the dumps in it, run through the
agent's own ``agent.inspector`` parser and ``Summarizer`` into ``Report.jobs``. Every collective
of one dump is drawn at once from a generator seeded by the seed and the dump, so every node of a
communicator reports the same collective whatever order the nodes ask in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from agent.errors import ConfigError
from agent.inspector import Stream, Summarizer
from agent.report import Jobs

if TYPE_CHECKING:
    from sim.scenario import Scenario

CommKind = Literal["tp", "dp", "pp"]
Pair = tuple[str, str]

# Inspector dump interval (NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS=5000000): two dumps
# per 10-s agent cycle, each with the latest completed operation per communicator and rank.
DUMP_INTERVAL_S: Final = 5.0
# Message sizes: a TP all-reduce of one layer's activations (batch x sequence x hidden x 2 bytes,
# e.g. 4 x 4096 x 2048 x 2), a DP gradient bucket (Megatron's default 40 M parameters in fp32
# is ~160 MB; a power of two here), a PP activation transfer like the TP one.
TP_BYTES: Final = 64 << 20
DP_BYTES: Final = 256 << 20
PP_BYTES: Final = 32 << 20
# How often each communicator completes an operation (only the sequence number uses it).
OP_PERIOD_S: Final[Mapping[CommKind, float]] = {"tp": 0.01, "dp": 0.25, "pp": 0.05}
# Compute between two collectives of a communicator, in units of its transfer time: training
# spends roughly three quarters of a step computing (communication ~25 %, partly overlapped).
COMPUTE_PER_TRANSFER: Final = 3.0
TRANSFER_NOISE: Final = 0.02  # one standard deviation of a collective's transfer time, relative
ARRIVAL_JITTER: Final = 0.01  # a healthy rank's arrival spread, in transfer times
RAIL_DOWN_RATIO: Final = 0.5  # a rail whose port is down shares a neighbour's NIC
NVLINK_CRC_RATIO: Final = 0.97  # replays cost a little bandwidth (as the local probe model)
_JOB_FIELDS: Final = frozenset({"name", "first", "nodes", "pp", "at_s", "until_s"})


@dataclass(frozen=True)
class JobSpec:
    """One multi-node job: ``nodes`` whole nodes from index ``first``, ``pp`` pipeline stages."""

    name: str
    first: int
    nodes: int
    pp: int = 1
    at_s: float = 0.0
    until_s: float | None = None

    def node_names(self) -> list[str]:
        return [f"gpu-{i:04d}" for i in range(self.first, self.first + self.nodes)]

    def active(self, rel: float) -> bool:
        return self.at_s <= rel and (self.until_s is None or rel < self.until_s)


def parse_jobs(raw: Any) -> tuple[JobSpec, ...]:
    """The ``multinode_jobs:`` list: ``{name, first: gpu-NNNN, nodes, pp, at_s, until_s}`` each."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("multinode_jobs: expected a list")
    out = []
    for i, j in enumerate(raw):
        where = f"multinode_jobs[{i}]"
        if not isinstance(j, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        unknown = sorted(set(j) - _JOB_FIELDS)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
        name, first = j.get("name"), j.get("first")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string")
        if not isinstance(first, str) or not first.startswith("gpu-") or not first[4:].isdigit():
            raise ConfigError(f"{where}.first: expected a node name (gpu-NNNN), got {first!r}")
        ints = {}
        for key, default in (("nodes", None), ("pp", 1)):
            v = j.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{where}.{key}: expected an integer, got {v!r}")
            ints[key] = v
        times: dict[str, float | None] = {}
        for key, dflt in (("at_s", 0.0), ("until_s", None)):
            v = j.get(key, dflt)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ConfigError(f"{where}.{key}: expected a number, got {v!r}")
            times[key] = None if v is None else float(v)
        out.append(
            JobSpec(
                name=name,
                first=int(first[4:]),
                nodes=ints["nodes"],
                pp=ints["pp"],
                at_s=times["at_s"] or 0.0,
                until_s=times["until_s"],
            )
        )
    return tuple(out)


def validate_jobs(jobs: Sequence[JobSpec], node_count: int, pool_of: Callable[[int], str]) -> None:
    """Refuse a job that spans nodes the fleet lacks or two pools, shares a node, or whose nodes
    do not split into its pipeline stages of two nodes or more (or one node each)."""
    names: set[str] = set()
    taken: dict[int, str] = {}
    for i, j in enumerate(jobs):
        where = f"multinode_jobs[{i}] ({j.name})"
        if j.name in names:
            raise ConfigError(f"{where}: job names must be unique")
        names.add(j.name)
        if j.nodes < 2:
            raise ConfigError(f"{where}: a multi-node job needs nodes >= 2, got {j.nodes}")
        if j.first < 0 or j.first + j.nodes > node_count:
            raise ConfigError(f"{where}: nodes gpu-{j.first:04d} + {j.nodes} exceed the fleet's {node_count}")
        if j.pp < 1 or j.nodes % j.pp:
            raise ConfigError(f"{where}: pp must divide nodes ({j.nodes}), got {j.pp}")
        if j.until_s is not None and not j.until_s > j.at_s:
            raise ConfigError(f"{where}: until_s must come after at_s")
        if len({pool_of(k) for k in range(j.first, j.first + j.nodes)}) != 1:
            raise ConfigError(f"{where}: its nodes span two pools")
        for k in range(j.first, j.first + j.nodes):
            if k in taken:
                raise ConfigError(f"{where}: gpu-{k:04d} is already in job {taken[k]}")
            taken[k] = j.name


# ---------------------------------------------------------------------------------------------
# Communicators


@dataclass(frozen=True)
class Comm:
    """One NCCL communicator: its ranks in rank order as (node, local GPU)."""

    id: str  # Inspector header.id
    job: str
    kind: CommKind
    collectives: tuple[str, ...]  # what each rank runs on it (a PP pair: Send and Recv)
    size_bytes: int
    members: tuple[tuple[str, int], ...]
    nnodes: int
    hops: tuple[Pair, ...]  # inter-node hops its ring or pair crosses, each sorted

    @property
    def n_ranks(self) -> int:
        return len(self.members)


def comm_id(seed: int, job: str, name: str) -> str:
    """A communicator id as the Inspector writes it: 0x and 14 hex digits (a 56-bit hash)."""
    digest = hashlib.blake2b(f"{seed}:{job}:{name}".encode(), digest_size=7).hexdigest()
    return "0x" + digest


def ring_hops(nodes: Sequence[str]) -> tuple[Pair, ...]:
    """The inter-node hops of a ring over ``nodes`` in rank order (cyclic, each hop sorted, once)."""
    distinct = [n for i, n in enumerate(nodes) if i == 0 or n != nodes[i - 1]]
    if len(distinct) > 1 and distinct[0] == distinct[-1]:
        distinct.pop()
    if len(distinct) < 2:
        return ()
    hops = {
        (min(a, b), max(a, b)) for a, b in zip(distinct, distinct[1:] + distinct[:1], strict=True) if a != b
    }
    return tuple(sorted(hops))


def communicators(seed: int, job: JobSpec, gpus: int) -> list[Comm]:
    """Every communicator of a job (module docstring: TP per node, DP rings per stage, PP pairs)."""
    nodes = job.node_names()
    stage = job.nodes // job.pp
    out: list[Comm] = []
    for n in nodes:
        out.append(
            Comm(
                comm_id(seed, job.name, f"tp:{n}"),
                job.name,
                "tp",
                ("AllReduce",),
                TP_BYTES,
                tuple((n, g) for g in range(gpus)),
                1,
                (),
            )
        )
    for s in range(job.pp):
        ring = nodes[s * stage : (s + 1) * stage]
        if len(ring) < 2:
            continue
        for g in range(gpus):
            out.append(
                Comm(
                    comm_id(seed, job.name, f"dp:{s}:{g}"),
                    job.name,
                    "dp",
                    ("AllReduce",),
                    DP_BYTES,
                    tuple((n, g) for n in ring),
                    len(ring),
                    ring_hops(ring),
                )
            )
    for s in range(job.pp - 1):
        for k in range(stage):
            a, b = nodes[s * stage + k], nodes[(s + 1) * stage + k]
            for g in range(gpus):
                out.append(
                    Comm(
                        comm_id(seed, job.name, f"pp:{s}:{k}:{g}"),
                        job.name,
                        "pp",
                        ("Send", "Recv"),
                        PP_BYTES,
                        ((a, g), (b, g)),
                        2,
                        ((min(a, b), max(a, b)),),
                    )
                )
    return out


def bus_factor(collective: str, n_ranks: int) -> float:
    """NCCL's bus-bandwidth factor (nccl-tests' PERFORMANCE.md): busbw = algbw x factor."""
    if n_ranks < 2 or collective in ("Send", "Recv", "Broadcast", "Reduce"):
        return 1.0
    if collective == "AllReduce":
        return 2.0 * (n_ranks - 1) / n_ranks
    return (n_ranks - 1) / n_ranks  # AllGather, ReduceScatter


# ---------------------------------------------------------------------------------------------
# Physics: what hardware state a collective meets (plain data, so tests can build it directly)


@dataclass(frozen=True)
class Conditions:
    """The fleet's state at one moment, as the collectives meet it (ratios in (0, 1])."""

    nic: Mapping[str, float]  # node -> its NICs' bandwidth ratio (slow_nic)
    link: Mapping[Pair, float]  # sorted pair -> the path's ratio (degraded_link)
    rail_down: frozenset[tuple[str, int]]  # (node, port) whose port is down
    nvlink: Mapping[str, float]  # node -> its NVLink/NVSwitch ring's ratio (slow GPU, brake, CRC)
    clock: Mapping[tuple[str, int], float]  # (node, gpu) -> its compute clock ratio
    job: Mapping[str, float]  # job -> workload ratio (slow_job)

    @staticmethod
    def healthy() -> Conditions:
        return Conditions({}, {}, frozenset(), {}, {}, {})


def transfer_ratio(comm: Comm, c: Conditions) -> float:
    """The communicator's bandwidth over its healthy figure: its slowest element, times its job's
    workload ratio."""
    ratio = 1.0
    if comm.kind == "tp":
        ratio = c.nvlink.get(comm.members[0][0], 1.0)
    else:
        for node, gpu in comm.members:
            ratio = min(ratio, c.nic.get(node, 1.0))
            if (node, gpu) in c.rail_down:
                ratio = min(ratio, RAIL_DOWN_RATIO)
        for hop in comm.hops:
            ratio = min(ratio, c.link.get(hop, 1.0))
    return ratio * c.job.get(comm.job, 1.0)


def lateness(comm: Comm, c: Conditions, gpus: int) -> list[float]:
    """Each rank's arrival delay in transfer times (before jitter): its own compute at TP, its
    node's slowest GPU's at DP and PP."""

    def late(node: str, gpu: int) -> float:
        return COMPUTE_PER_TRANSFER * (1.0 / c.clock.get((node, gpu), 1.0) - 1.0)

    if comm.kind == "tp":
        return [late(n, g) for n, g in comm.members]
    return [max(late(n, g) for g in range(gpus)) for n, _ in comm.members]


def record(
    comm: Comm,
    *,
    rank: int,
    collective: str,
    sn: int,
    exec_s: float,
    dump_time: float,
    hostname: str,
    pid: int,
) -> dict[str, Any]:
    """One Inspector v4.0 record (the layout of tests/fixtures/nccl-inspector/v4.0-examples.jsonl)."""
    exec_us = max(1.0, round(exec_s * 1e6, 0))
    algbw = comm.size_bytes / (exec_us * 1e-6) / 1e9
    busbw = round(algbw * bus_factor(collective, comm.n_ranks), 6)
    out: dict[str, Any] = {
        "header": {"id": comm.id, "rank": rank, "n_ranks": comm.n_ranks, "nnodes": comm.nnodes},
        "metadata": {
            "inspector_output_format_version": "v4.0",
            "git_rev": "",
            "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": round(dump_time * 1e6),
            "hostname": hostname,
            "pid": pid,
        },
    }
    if collective in ("Send", "Recv"):
        # Point-to-point operations are written as p2p_perf, with the same fields prefixed p2p_.
        out["p2p_perf"] = {
            "p2p": collective,
            "p2p_sn": sn,
            "p2p_msg_size_bytes": comm.size_bytes,
            "p2p_exec_time_us": exec_us,
            "p2p_timing_source": "kernel_gpu",
            "p2p_algobw_gbs": round(algbw, 6),
            "p2p_busbw_gbs": busbw,
        }
    else:
        out["coll_perf"] = {
            "coll": collective,
            "coll_sn": sn,
            "coll_msg_size_bytes": comm.size_bytes,
            "coll_exec_time_us": exec_us,
            "coll_timing_source": "kernel_gpu",
            "coll_algobw_gbs": round(algbw, 6),
            "coll_busbw_gbs": busbw,
        }
    return out


# ---------------------------------------------------------------------------------------------
# The fleet's jobs


@dataclass(frozen=True)
class NodeFaults:
    """What one node's faults do to collectives; built by ``sim.fleet`` from its fault list."""

    kind: str
    node: str
    peer: str | None
    gpu: int | None
    port: int | None
    job: str | None
    params: Mapping[str, float]
    active: Callable[[float], bool]
    index: int = -1  # its index in the scenario's faults (what a report "shows")

    def touches(self, comm: Comm) -> bool:
        """Whether it changes what ``comm``'s collectives record (its transfer or a rank's wait)."""
        on = {n for n, _ in comm.members}
        if self.kind == "slow_job":
            return comm.job == self.job
        if self.kind == "degraded_link":
            return (
                self.peer is not None and (min(self.node, self.peer), max(self.node, self.peer)) in comm.hops
            )
        if self.kind == "slow_nic":
            return comm.kind != "tp" and self.node in on
        if self.kind == "ib_port_down":
            return comm.kind != "tp" and (self.node, self.port) in comm.members
        if self.kind == "nvlink_crc":
            return comm.kind == "tp" and self.node in on
        return self.node in on  # a slow GPU, thermal, power brake: its ranks arrive late


def conditions_at(faults: Iterable[NodeFaults], rel: float, gpus: int) -> Conditions:
    """The fleet's ``Conditions`` at ``rel`` seconds after the start, from its faults."""
    nic: dict[str, float] = {}
    link: dict[Pair, float] = {}
    rails: set[tuple[str, int]] = set()
    nvlink: dict[str, float] = {}
    clock: dict[tuple[str, int], float] = {}
    job: dict[str, float] = {}
    for f in faults:
        if not f.active(rel):
            continue
        p = f.params
        if f.kind == "slow_nic":
            nic[f.node] = min(nic.get(f.node, 1.0), p["ratio"])
        elif f.kind == "degraded_link" and f.peer is not None:
            hop = (min(f.node, f.peer), max(f.node, f.peer))
            link[hop] = min(link.get(hop, 1.0), p["ratio"])
        elif f.kind == "ib_port_down" and f.port is not None:
            rails.add((f.node, f.port))
        elif f.kind == "slow_gpu" and f.gpu is not None:
            nvlink[f.node] = min(nvlink.get(f.node, 1.0), p["busbw_ratio"])
            clock[(f.node, f.gpu)] = min(clock.get((f.node, f.gpu), 1.0), p["ratio"])
        elif f.kind == "thermal" and f.gpu is not None:
            clock[(f.node, f.gpu)] = min(clock.get((f.node, f.gpu), 1.0), p["clock_ratio"])
        elif f.kind == "power_brake":
            nvlink[f.node] = min(nvlink.get(f.node, 1.0), 0.5 + 0.5 * p["clock_ratio"])
            for g in range(gpus):
                clock[(f.node, g)] = min(clock.get((f.node, g), 1.0), p["clock_ratio"])
        elif f.kind == "nvlink_crc":
            nvlink[f.node] = min(nvlink.get(f.node, 1.0), NVLINK_CRC_RATIO)
        elif f.kind == "slow_job" and f.job is not None:
            job[f.job] = min(job.get(f.job, 1.0), p["ratio"])
    return Conditions(nic, link, frozenset(rails), nvlink, clock, job)


@dataclass(frozen=True)
class Hardware:
    """What a pool's nodes can do, for the communicators on them (from ``sim.profiles``)."""

    gpus: int
    nvlink_busbw: float  # bytes/s: the local all-reduce figure
    nic_busbw: float  # bytes/s: the two-node all-reduce figure over one NIC


class JobFleet:
    """The scenario's jobs: their communicators, and each node's Inspector records per cycle.

    ``lines(node, prev_t, t, skew)`` gives the record lines of the dumps in ``(prev_t, t]`` (true
    time) for the node's ranks, with dump timestamps on the node's clock (``+ skew``): the
    ``record`` layout, formatted from a template per rank (tests check that the two agree).
    Every collective of one dump is drawn at once, from a generator seeded by the seed and the
    dump, and kept for the other nodes of its communicators, so no node's order of asking
    changes a value.
    """

    def __init__(
        self,
        *,
        seed: int,
        start: float,
        jobs: Sequence[JobSpec],
        hardware: Mapping[str, Hardware],  # job name -> its pool's hardware
        faults: Sequence[NodeFaults],
    ) -> None:
        self.seed, self.start, self.jobs = seed, start, {j.name: j for j in jobs}
        self.hardware = hardware
        self.faults = list(faults)
        self.comms: list[Comm] = []
        for j in jobs:
            self.comms.extend(communicators(seed, j, hardware[j.name].gpus))
        # Flat per-rank arrays: rank k of the fleet belongs to communicator comm_of[k].
        offsets: list[int] = []
        comm_of: list[int] = []
        for c, comm in enumerate(self.comms):
            offsets.append(len(comm_of))
            comm_of.extend([c] * comm.n_ranks)
        self._offsets = np.array(offsets, np.int64)
        self._comm_of = np.array(comm_of, np.int64)
        self._healthy_s = np.array(
            [
                comm.size_bytes
                * bus_factor(comm.collectives[0], comm.n_ranks)
                / (
                    self.hardware[comm.job].nvlink_busbw
                    if comm.kind == "tp"
                    else self.hardware[comm.job].nic_busbw
                )
                for comm in self.comms
            ]
        )
        # node -> (flat rank index, its comm, its job, templates of its lines)
        self._ranks: dict[str, list[tuple[int, Comm, JobSpec, tuple[str, ...]]]] = {}
        for c, comm in enumerate(self.comms):
            for rank, (node, gpu) in enumerate(comm.members):
                templates = tuple(
                    _template(comm, rank, col, pod_name(comm.job, node), pid_of(gpu))
                    for col in comm.collectives
                )
                self._ranks.setdefault(node, []).append(
                    (offsets[c] + rank, comm, self.jobs[comm.job], templates)
                )
        # fault -> the nodes whose records it changes (any rank of a communicator it touches)
        self._seen_by: dict[int, frozenset[str]] = {
            i: frozenset(n for comm in self.comms if f.touches(comm) for n, _ in comm.members)
            for i, f in enumerate(self.faults)
        }
        self._states: dict[tuple[bool, ...], tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]] = {}
        self._dumps: dict[int, npt.NDArray[np.float64]] = {}  # dump -> every rank's kernel time (s)

    def _state(self, rel: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per communicator its transfer time (s), per rank its lateness (transfer times), for the
        faults active at ``rel``; kept per set of active faults (they change a few times a run)."""
        key = tuple(f.active(rel) for f in self.faults)
        got = self._states.get(key)
        if got is None:
            gpus = max((h.gpus for h in self.hardware.values()), default=8)
            c = conditions_at(self.faults, rel, gpus)
            ratio = np.array([transfer_ratio(comm, c) for comm in self.comms])
            late = np.array(
                [x for comm in self.comms for x in lateness(comm, c, self.hardware[comm.job].gpus)],
                np.float64,
            )
            got = self._states[key] = (self._healthy_s / ratio, late)
        return got

    def exec_times(self, dump: int) -> npt.NDArray[np.float64]:
        """Every rank's kernel time (s) in the collective of ``dump`` (``exec_times``, vectorized)."""
        got = self._dumps.get(dump)
        if got is None:
            transfer, late = self._state(dump * DUMP_INTERVAL_S)
            rng = np.random.default_rng([self.seed, dump])
            t = transfer * np.maximum(0.5, rng.normal(1.0, TRANSFER_NOISE, len(transfer)))
            per_rank = transfer[self._comm_of]
            arrive = (late + np.abs(rng.normal(0.0, ARRIVAL_JITTER, len(late)))) * per_rank
            last = np.maximum.reduceat(arrive, self._offsets)
            got = t[self._comm_of] + last[self._comm_of] - arrive
            if len(self._dumps) > 16:  # nodes ask within a cycle of each other: a few dumps suffice
                for old in sorted(self._dumps)[:-8]:
                    del self._dumps[old]
            self._dumps[dump] = got
        return got

    def lines(self, node: str, prev_t: float, t: float, skew: float) -> list[bytes]:
        """The node's record lines for the dumps in ``(prev_t, t]`` (true times), of its active jobs."""
        ranks = self._ranks.get(node)
        if not ranks:
            return []
        first = math.floor((prev_t - self.start) / DUMP_INTERVAL_S) + 1
        last = math.floor((t - self.start) / DUMP_INTERVAL_S)
        out: list[bytes] = []
        for dump in range(max(first, 0), last + 1):
            rel = dump * DUMP_INTERVAL_S
            stamp = round((self.start + rel + skew) * 1e6)
            execs = self.exec_times(dump)
            for k, comm, job, templates in ranks:
                if not job.active(rel):
                    continue
                exec_us = max(1.0, round(float(execs[k]) * 1e6, 0))
                algbw = comm.size_bytes / (exec_us * 1e-6) / 1e9
                sn = int(rel / OP_PERIOD_S[comm.kind])
                for template, collective in zip(templates, comm.collectives, strict=True):
                    busbw = algbw * bus_factor(collective, comm.n_ranks)
                    out.append((template % (stamp, sn, exec_us, algbw, busbw)).encode())
        return out

    def section(
        self, node: str, prev_t: float, t: float, skew: float, crashed: bool
    ) -> tuple[Jobs, set[int]]:
        """The node's ``Report.jobs`` for the cycle ``(prev_t, t]``: its records, as lines of the
        Inspector's files, through the agent's own parser and ``Summarizer``; and the faults
        (scenario indices) they show. A node with a lost GPU has no job running (it crashed)."""
        summarizer = Summarizer()
        shows: set[int] = set()
        lines = [] if crashed else self.lines(node, prev_t, t, skew)
        if lines:
            Stream().feed(lines, summarizer)
            rel = t - self.start
            shows = {f.index for i, f in enumerate(self.faults) if node in self._seen_by[i] and f.active(rel)}
        return summarizer.take(), shows


def _template(comm: Comm, rank: int, collective: str, hostname: str, pid: int) -> str:
    """``record``'s line for one rank, with %-placeholders for the dump timestamp (us), the
    sequence number, the kernel time (us), the algorithm and the bus bandwidth (GB/s)."""
    d = record(
        comm, rank=rank, collective=collective, sn=0, exec_s=1.0, dump_time=0.0, hostname=hostname, pid=pid
    )
    p = "p2p" if "p2p_perf" in d else "coll"
    d["metadata"]["dump_timestamp_us"] = "@ts@"
    perf = d[f"{p}_perf"]
    for name, mark in (
        ("sn", "@sn@"),
        ("exec_time_us", "@ex@"),
        ("algobw_gbs", "@alg@"),
        ("busbw_gbs", "@bus@"),
    ):
        perf[f"{p}_{name}"] = mark
    text = _ENCODER.encode(d).decode().replace("%", "%%")
    for mark, fmt in (("@ts@", "%d"), ("@sn@", "%d"), ("@ex@", "%.1f"), ("@alg@", "%.6f"), ("@bus@", "%.6f")):
        text = text.replace(f'"{mark}"', fmt)
    return text


_ENCODER: Final = msgspec.json.Encoder()


def pod_name(job: str, node: str) -> str:
    """The pod of ``job`` on ``node`` (one pod per node; the Inspector's hostname in a pod)."""
    return f"{job}-worker-{int(node[4:]):04d}"


def pid_of(gpu: int) -> int:
    """One process per GPU; PIDs in the pod's namespace start after the launcher's."""
    return 100 + gpu


def busy_windows(s: Scenario) -> dict[str, tuple[float, float]]:
    """Each job node's busy stretch in true time: its job's span."""
    out = {}
    for j in s.multinode_jobs:
        end = math.inf if j.until_s is None else s.start + j.until_s
        for n in j.node_names():
            out[n] = (s.start + j.at_s, end)
    return out


def job_fleet(s: Scenario) -> JobFleet | None:
    """The scenario's ``JobFleet`` (None without ``multinode_jobs``); faults must be placed."""
    if not s.multinode_jobs:
        return None
    hardware = {}
    for j in s.multinode_jobs:
        p = s.pool_of(j.first).profile
        hardware[j.name] = Hardware(
            p.gpus, p.local_busbw_bytes_per_second, p.pair_busbw_bytes_per_second / p.nics
        )
    faults = [
        NodeFaults(
            kind=f.kind,
            node=f.node or "",
            peer=f.peer,
            gpu=f.gpu,
            port=f.port,
            job=f.job,
            params={k: f.param(k) for k in FAULT_PARAMS.get(f.kind, ())},
            active=f.active,
            index=i,
        )
        for i, f in enumerate(s.faults)
        if f.kind in FAULT_PARAMS
    ]
    return JobFleet(seed=s.seed, start=s.start, jobs=s.multinode_jobs, hardware=hardware, faults=faults)


# The fault kinds that act on collectives, and the parameters they use.
FAULT_PARAMS: Final[Mapping[str, tuple[str, ...]]] = {
    "slow_nic": ("ratio",),
    "degraded_link": ("ratio",),
    "ib_port_down": (),
    "slow_gpu": ("ratio", "busbw_ratio"),
    "thermal": ("clock_ratio",),
    "power_brake": ("clock_ratio",),
    "nvlink_crc": (),
    "slow_job": ("ratio",),
}
