"""The agent's collectors. A new collector is one module here plus one line in ``COLLECTORS``."""

from __future__ import annotations

from collections.abc import Callable

from agent.collectors.base import Collector, CollectorContext
from agent.collectors.infiniband import InfinibandCollector
from agent.collectors.nccl_inspector import NcclInspectorCollector
from agent.collectors.netdev import NetdevCollector
from agent.collectors.nvml import NvmlCollector
from agent.collectors.xid import XidCollector

COLLECTORS: tuple[Callable[[CollectorContext], Collector], ...] = (
    NvmlCollector,
    XidCollector,
    InfinibandCollector,
    NetdevCollector,
    NcclInspectorCollector,
)


def build_collectors(ctx: CollectorContext) -> list[Collector]:
    return [factory(ctx) for factory in COLLECTORS]
