"""What every detector is to the pipeline: settings, a period, hooks for what it watches, a run.

The pipeline builds one detector of each entry of ``aggregator.detect.DETECTORS`` (a
``DetectorSpec``: the settings type, whose ``name`` is the detector's, and the factory), with the
settings the ``detectors:`` section of the config file gives it. Then, for every detector alike:

- ``observe_report(report, placement, measured)`` for every report ingested, ``measured`` being
  when the report was measured on the aggregator's clock (``aggregator/fleet/sendtime.py``: its
  own time plus its node's clock offset, never after its receipt; a backlog does not move it). A
  detector that reads only the pool frames does nothing here; the probe detectors keep the
  report's probe results, the jobs detector its collectives;
- ``run(frames, now)`` every ``every_seconds`` of the aggregator's clock (a ``PoolDetector``'s
  ``run_pool(frame, now)`` for each pool instead, one pool per step of the cycle), returning a ``Verdict``:
  findings per node, handed to the health machine (``HealthMachine.update(node, name, findings,
  now)``), and optionally slow links (for the link state machine) and switch alerts;
- ``forget(node)`` when the pipeline forgets a node that has been silent for a long time.

A pool detector whose run is mostly pure number crunching (the forest, peer and trend detectors) can be an
``OffloadingPoolDetector``: it splits each pool's run into ``prepare_pool`` (on the caller's thread:
copies what it needs out of the frame), ``Offload.compute`` (reads only that copy; the live service
runs it in a worker thread while the event loop goes on answering reports) and ``Offload.finish``
(back on the caller's thread). Replay, tests and ``Pipeline.advance`` call the three in a row, on one
thread: the same findings either way.

A detector answers for every node it looked at, with an empty list where it sees nothing: that is
how its earlier findings on a node clear. A node it did not look at keeps whatever it had until it
is forgotten. A detector that raises is logged, counted and skipped for that call; nothing else in
the pipeline waits for it (``aggregator.pipeline``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast, final, runtime_checkable

import msgspec

from agent.report import Report
from aggregator.config import DetectorSettings, DetectorsSection
from aggregator.fleet.frame import FleetFrames, PoolFrame
from aggregator.fleet.pools import Placement
from aggregator.model import Finding

Pair = tuple[str, str]  # two node names, sorted


@dataclass(frozen=True)
class SwitchAlert:
    """A shared switch the findings point at: several culprits in one rack or leaf."""

    domain_kind: str  # "rack" or "leaf"
    domain: str
    pool: str
    nodes: tuple[str, ...]  # the nodes involved (bad nodes, ends of slow pairs)
    pairs: tuple[Pair, ...]  # the slow pairs behind it
    summary: str


@dataclass
class Verdict:
    """One run's answer.

    ``nodes``: findings per node, for every node judged ([] clears). ``links``: the slow pairs now
    (every other pair is clear), or None from a detector that does not judge links, which then
    leaves the link state machine alone. ``switches``: the shared-switch problems it sees now.
    """

    nodes: dict[str, list[Finding]] = field(default_factory=dict)
    links: dict[Pair, Finding] | None = None
    switches: list[SwitchAlert] = field(default_factory=list)


class Detector(Protocol):
    @property
    def every_seconds(self) -> float:
        """How often the pipeline runs it, in seconds of the aggregator's clock."""
        ...

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:
        """A report was ingested; it was measured at ``measured`` on the aggregator's clock."""
        ...

    def run(self, frames: FleetFrames, now: float) -> Verdict:
        """Findings per node, for every node looked at (an empty list clears its findings)."""
        ...

    def forget(self, node: str) -> None:
        """The node is gone (silent for ``silence.forget_after_seconds``): drop its state."""
        ...


@runtime_checkable
class MeasuresPairs(Protocol):
    """A detector that keeps pair measurements (the link localizer): what the status page's link
    matrix shows. Optional: the pipeline asks only the detectors that have it."""

    def bandwidth(self) -> dict[tuple[Pair, str], tuple[float, float]]:
        """(pair, probe kind) -> (time, bytes/s) of its newest retained measurement."""
        ...


class PoolDetector(abc.ABC):
    """A detector of the pool frames alone: each pool judged on its own, nothing kept per node
    between runs but what the frames hold."""

    every_seconds: float

    def observe_report(self, report: Report, placement: Placement, measured: float) -> None:  # noqa: B027
        """The frames already hold what it needs."""

    def forget(self, node: str) -> None:  # noqa: B027 - a hook it does not need, not an abstract one
        """Nothing of its own to drop: the frames forget the node."""

    @final
    def run(self, frames: FleetFrames, now: float) -> Verdict:
        """Every pool's ``run_pool``. Final: the pipeline runs a pool detector pool by pool
        (``Pipeline.advance_steps``), so what a detector does must live in ``run_pool`` (or, for
        an ``OffloadingPoolDetector``, in the parts ``prepare_pool`` returns)."""
        out = Verdict()
        for pool in frames.pools():
            frame = frames.frame(pool)
            if frame is not None:
                out.nodes.update(self.run_pool(frame, now))
        return out

    @abc.abstractmethod
    def run_pool(self, frame: PoolFrame, now: float) -> dict[str, list[Finding]]:
        """Findings for every node of one pool's frame (empty lists where nothing stands out)."""


T = TypeVar("T")


@dataclass(frozen=True)
class Offload(Generic[T]):
    """One pool's run, split so that its costly part may leave the caller's thread.

    ``compute()`` is called exactly once, perhaps in a worker thread while the caller ingests reports
    and runs other detectors' steps. It may read only what it closes over, and what it closes over
    must be built or copied by ``prepare_pool`` for it alone: arrays it owns (copies, never views of
    a frame: a frame's rows move when a node is forgotten), frozen settings, plain values. It writes
    nothing but its return value: no detector state, no frame, no metrics. Logging is fine.

    ``finish(result)`` is called with that return value on the caller's thread, after ``compute`` and
    before the detector's next ``prepare_pool``; it may use the detector's state, and returns the
    pool's findings as ``run_pool`` would. Whatever ``compute`` raises is counted as the run failing,
    as a raising ``run_pool`` is.
    """

    compute: Callable[[], T]
    finish: Callable[[T], dict[str, list[Finding]]]


class OffloadingPoolDetector(PoolDetector):
    """A pool detector whose costly part runs off the caller's thread (see ``Offload``): the
    pipeline calls ``prepare_pool`` and lets its driver run ``compute`` where it likes."""

    @final
    def run_pool(self, frame: PoolFrame, now: float) -> dict[str, list[Finding]]:
        """The three parts in a row, on this thread (replay, tests, ``Pipeline.advance``). Final: what
        the service runs split must be what everything else runs whole."""
        work = self.prepare_pool(frame, now)
        return work.finish(work.compute())

    @abc.abstractmethod
    def prepare_pool(self, frame: PoolFrame, now: float) -> Offload[Any]:
        """What one pool's run needs, copied out of ``frame``, and the run's two remaining parts."""


S = TypeVar("S", bound=DetectorSettings)


@dataclass(frozen=True)
class DetectorSpec(Generic[S]):
    """One entry of ``DETECTORS``: the settings type (with the detector's ``name``) and the
    factory that makes the detector from them."""

    settings: type[S]
    make: Callable[[S], Detector]

    @property
    def name(self) -> str:
        return self.settings.name

    def build(self, section: DetectorsSection) -> Detector:
        """The detector, with the settings ``section`` holds for it (its defaults where the section
        was built without it, e.g. a detector registered by a test)."""
        found: Any = getattr(section, self.name, None)
        settings = found if isinstance(found, self.settings) else self.settings()
        return self.make(settings)


def detectors_section(specs: tuple[DetectorSpec[Any], ...]) -> type[DetectorsSection]:
    """The type of the ``detectors:`` config section for ``specs``: a key per detector, holding its
    settings, each with its defaults. Unknown keys are refused, at every level."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two detectors share a name: {names}")
    fields = [(s.name, s.settings, msgspec.field(default_factory=s.settings)) for s in specs]
    built = msgspec.defstruct(
        "DetectorsConfig",
        fields,
        bases=(DetectorsSection,),
        module="aggregator.config",
        kw_only=True,
        frozen=True,
        forbid_unknown_fields=True,
    )
    return cast("type[DetectorsSection]", built)
