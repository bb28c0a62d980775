"""Active probes: short all-reduce and TCP tests the aggregator assigns and the agent runs.

A new probe kind is one module here plus one line in ``PROBES`` (as ``agent.collectors`` does for
collectors). The assignment protocol is ``agent.probes.protocol``; the loop that fetches, checks
and runs assignments is ``agent.probes.poller``; ``docs/probes.md`` explains both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.clock import Clock
from agent.probes.base import ProbeKindRunner
from agent.probes.idle import IdleGuard
from agent.probes.nccl import CupyBackend, NcclLocalProbe, NcclPairProbe, NcclTestsBinary
from agent.probes.tcp import TcpPairProbe


@dataclass(frozen=True)
class ProbeContext:
    node: str
    clock: Clock
    guard: IdleGuard
    nccl_tests: NcclTestsBinary | None
    cupy: CupyBackend | None


def _tcp(ctx: ProbeContext) -> ProbeKindRunner:
    return TcpPairProbe(node=ctx.node, clock=ctx.clock)


def _local(ctx: ProbeContext) -> ProbeKindRunner:
    return NcclLocalProbe(clock=ctx.clock, guard=ctx.guard, binary=ctx.nccl_tests, cupy=ctx.cupy)


def _pair(ctx: ProbeContext) -> ProbeKindRunner:
    return NcclPairProbe(clock=ctx.clock, guard=ctx.guard, binary=ctx.nccl_tests, cupy=ctx.cupy)


PROBES: tuple[Callable[[ProbeContext], ProbeKindRunner], ...] = (_tcp, _local, _pair)


def build_probes(ctx: ProbeContext) -> list[ProbeKindRunner]:
    return [factory(ctx) for factory in PROBES]


def find_backends(
    clock: Clock, nccl_tests_path: Path | None
) -> tuple[NcclTestsBinary | None, CupyBackend | None]:
    """The NCCL backends this node has: nccl-tests' binary and CuPy, each None when absent."""
    return NcclTestsBinary.find(nccl_tests_path, clock), CupyBackend.load(clock)
