"""Ground truth: what the simulator broke, where, and when the trace first showed it.

The file ``gpuwarden sim --truth`` writes and ``gpuwarden eval`` reads (JSON)::

    {"version": 1, "seed": 7, "start": 1764000000.0, "end": 1764003600.0,
     "nodes": ["gpu-0000", ...],
     "faults": [{"id": 0, "kind": "slow_gpu", "class": "soft", "node": "gpu-0007", "peer": null,
                 "rack": null, "gpu": 4, "port": null, "start": 1764000300.0,
                 "first_seen": 1764000310.99, "end": null}, ...]}

``start`` and ``end`` are true (simulation) times; ``first_seen`` is the ``time`` of the first
delivered report that shows the fault (the node's own, or for a pair-probe fault either end's),
on that report's clock, as the aggregator sees it (null where
no report ever showed it, e.g. a slow NIC never probed while idle). A silent rack has one entry per
node in the rack, with ``rack`` set and ``first_seen`` its start: silence has no report to show it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from agent.errors import ConfigError
from sim.scenario import Scenario, read_document, silenced_nodes

TRUTH_VERSION: Final = 1
CLASSES: Final = ("hard", "soft", "link", "silent", "lookalike")


@dataclass(frozen=True)
class TruthFault:
    id: int
    kind: str
    fault_class: str
    node: str
    start: float
    first_seen: float | None
    end: float | None
    peer: str | None = None
    rack: str | None = None
    gpu: int | None = None
    port: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "class": self.fault_class,
            "node": self.node,
            "peer": self.peer,
            "rack": self.rack,
            "gpu": self.gpu,
            "port": self.port,
            "start": self.start,
            "first_seen": self.first_seen,
            "end": self.end,
        }


@dataclass(frozen=True)
class Truth:
    seed: int
    start: float
    end: float
    nodes: tuple[str, ...]
    faults: tuple[TruthFault, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": TRUTH_VERSION,
            "seed": self.seed,
            "start": self.start,
            "end": self.end,
            "nodes": list(self.nodes),
            "faults": [f.to_json() for f in self.faults],
        }


def build(scenario: Scenario, first_seen: Mapping[int, float]) -> Truth:
    """The truth of a simulated scenario, given the first report time that showed each fault."""
    s = scenario
    faults: list[TruthFault] = []
    for idx, f in enumerate(s.faults):
        start = s.start + f.at_s
        end = None if f.until_s is None else s.start + f.until_s
        if f.fault_class == "silent":  # one entry per node cut off, shown from its start
            for name in silenced_nodes(s, f):
                faults.append(TruthFault(idx, f.kind, f.fault_class, name, start, start, end, rack=f.rack))
            continue
        if f.kind == "slow_job":  # one entry per node of the job, as for a silent rack
            job = next(j for j in s.multinode_jobs if j.name == f.job)
            for name in job.node_names():
                faults.append(TruthFault(idx, f.kind, f.fault_class, name, start, first_seen.get(idx), end))
            continue
        if f.node is None:  # a fault given by its leaf: sim.fleet.place names its nodes
            raise ValueError(f"faults[{idx}] ({f.kind}) on {f.leaf} is not placed: use sim.fleet.place first")
        faults.append(
            TruthFault(
                idx,
                f.kind,
                f.fault_class,
                f.node,
                start,
                first_seen.get(idx),
                end,
                peer=f.peer,
                gpu=f.gpu,
                port=f.port,
            )
        )
    return Truth(s.seed, s.start, s.start + s.duration_s, tuple(s.node_names()), tuple(faults))


def write(path: Path | str, truth: Truth) -> None:
    Path(path).write_text(json.dumps(truth.to_json(), indent=1) + "\n", "utf-8")


def _opt_float(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{where}: expected a number or null, got {v!r}")
    return float(v)


def _opt_int(v: Any, where: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: expected an integer or null, got {v!r}")
    return v


def _opt_str(v: Any, where: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise ConfigError(f"{where}: expected a string or null, got {v!r}")


def _fault(raw: Any, where: str) -> TruthFault:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected an object")
    for key in ("kind", "class", "node", "start"):
        if key not in raw:
            raise ConfigError(f"{where}: missing {key}")
    if raw["class"] not in CLASSES:
        raise ConfigError(f"{where}.class: expected one of {', '.join(CLASSES)}, got {raw['class']!r}")
    node, kind = _opt_str(raw["node"], f"{where}.node"), _opt_str(raw["kind"], f"{where}.kind")
    start = _opt_float(raw["start"], f"{where}.start")
    if node is None or kind is None or start is None:
        raise ConfigError(f"{where}: kind, node and start must not be null")
    peer = _opt_str(raw.get("peer"), f"{where}.peer")
    if raw["class"] == "link" and peer is None:
        raise ConfigError(f"{where}: a link fault needs a peer")
    return TruthFault(
        id=_opt_int(raw.get("id", 0), f"{where}.id") or 0,
        kind=kind,
        fault_class=raw["class"],
        node=node,
        start=start,
        first_seen=_opt_float(raw.get("first_seen"), f"{where}.first_seen"),
        end=_opt_float(raw.get("end"), f"{where}.end"),
        peer=peer,
        rack=_opt_str(raw.get("rack"), f"{where}.rack"),
        gpu=_opt_int(raw.get("gpu"), f"{where}.gpu"),
        port=_opt_int(raw.get("port"), f"{where}.port"),
    )


def load(path: Path | str) -> Truth:
    """Read a truth file; a ``ConfigError`` names the file and the field that is wrong."""
    path = Path(path)
    data = read_document(path, json.loads, json.JSONDecodeError, "JSON")
    if not isinstance(data, Mapping) or not isinstance(data.get("faults"), list):
        raise ConfigError(f"{path}: expected an object with a faults list")
    nodes = data.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise ConfigError(f"{path}: nodes must be a list of names")
    faults = tuple(_fault(f, f"{path}: faults[{i}]") for i, f in enumerate(data["faults"]))
    start = _opt_float(data.get("start"), f"{path}: start")
    end = _opt_float(data.get("end"), f"{path}: end")
    names: Iterable[str] = nodes or sorted({f.node for f in faults})
    return Truth(
        seed=_opt_int(data.get("seed"), f"{path}: seed") or 0,
        start=start if start is not None else min((f.start for f in faults), default=0.0),
        end=end if end is not None else max((f.start for f in faults), default=0.0),
        nodes=tuple(names),
        faults=faults,
    )
