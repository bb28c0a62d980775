"""The idle guard: probes run only on idle GPUs, and step aside the moment a job starts.

Before a probe, the node is idle when no GPU has a compute process (NVML's
``nvmlDeviceGetComputeRunningProcesses``) and every GPU's utilization is below a threshold (10 %
by default: a job between steps can show 0 % for a moment, but not for long, and the processes
check catches it anyway). A GPU whose state cannot be read counts as busy: a probe on a node we
cannot see is a probe that may land on someone's job.

During a probe the probe itself is the load, so only processes count, and the probe's own
processes (the agent, an ``all_reduce_perf`` child) are left out by PID. NVML reports PIDs of the
host's PID namespace, so the agent must run with ``hostPID: true`` for a GPU probe to recognise
itself (otherwise every GPU probe steps aside at its first check, which is safe but useless).

Without NVML (no GPUs, a CI box) nothing can be busy: ``tcp_pair`` still runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from types import TracebackType
from typing import Final

from agent.gpu.api import NVMLError, error_text
from agent.gpu.session import NvmlSession
from agent.probes.base import STEPPED_ASIDE, Cancel

log = logging.getLogger(__name__)

DEFAULT_UTILIZATION_THRESHOLD: Final = 0.10
DEFAULT_WATCH_INTERVAL_S: Final = 1.0


class IdleGuard:
    def __init__(
        self,
        session: NvmlSession | None,
        *,
        utilization_threshold: float = DEFAULT_UTILIZATION_THRESHOLD,
        own_pids: Callable[[], Collection[int]] | None = None,
    ) -> None:
        if not 0 < utilization_threshold <= 1:
            raise ValueError(f"utilization threshold must be in (0, 1], got {utilization_threshold}")
        self._session = session
        self._threshold = utilization_threshold
        self._own_pids = own_pids or (lambda: (os.getpid(),))

    @property
    def gpu_count(self) -> int:
        if self._session is None or not self._session.ensure_init():
            return 0
        return self._session.device_count

    def busy(self, *, during_probe: bool = False, exclude: Collection[int] = ()) -> str | None:
        """Why the GPUs are not idle, or None. ``during_probe``: only foreign processes count."""
        session = self._session
        if session is None or not session.ensure_init():
            return None
        api = session.api
        own = set(self._own_pids()) | set(exclude)
        for index in range(session.device_count):
            try:
                handle = session.handle(index)
                pids = sorted(
                    p.pid for p in api.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid not in own
                )
                if pids:
                    shown = ", ".join(str(p) for p in pids[:4])
                    return f"GPU {index} runs compute process(es) {shown}"
                if not during_probe:
                    busy = api.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                    if busy >= self._threshold:
                        return f"GPU {index} is {busy:.0%} utilized"
            except NVMLError as exc:
                return f"GPU {index} state unreadable: {error_text(exc)}"
        return None

    def watch(
        self,
        cancel: Cancel,
        *,
        interval_s: float = DEFAULT_WATCH_INTERVAL_S,
        exclude: Callable[[], Collection[int]] = tuple,
    ) -> IdleWatch:
        return IdleWatch(self, cancel, interval_s, exclude)


class IdleWatch:
    """A context manager: checks every ``interval_s`` while a probe runs, cancels it if a job starts."""

    def __init__(
        self, guard: IdleGuard, cancel: Cancel, interval_s: float, exclude: Callable[[], Collection[int]]
    ) -> None:
        self._guard = guard
        self._cancel = cancel
        self._interval = interval_s
        self._exclude = exclude
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpuwarden-idle-watch", daemon=True)
        self.reason: str | None = None

    def __enter__(self) -> IdleWatch:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join(self._interval + 5.0)

    def _loop(self) -> None:
        while not self._done.wait(self._interval):
            reason = self._guard.busy(during_probe=True, exclude=self._exclude())
            if reason is not None:
                self.reason = reason
                log.warning("probe stepping aside", extra={"reason": reason})
                self._cancel.set(STEPPED_ASIDE)
                return
