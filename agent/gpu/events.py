"""Critical XID events from NVML's event API, received in a background thread.

NVML queues an XID for every event set registered for ``nvmlEventTypeXidCriticalError`` on that
GPU; ``nvmlEventSetWait_v2`` hands them out one at a time. A daemon thread waits with a short
timeout (so ``close()`` stops it within about that long), stamps each event with the injected
clock's time on receipt, and keeps it until ``drain()`` takes it: each event is returned once.

The queue is bounded (``max_queued``): under an XID storm with nobody draining, the oldest are
dropped and the drop is logged, instead of the agent growing without limit.

A GPU that has fallen off the bus makes NVML's wait answer GPU_IS_LOST at once; the thread then
backs off for one timeout between waits rather than spinning, and keeps delivering the other
GPUs' XIDs.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping

from agent.clock import Clock
from agent.collectors.base import RawXid, Support, normalize_pci_bus_id
from agent.gpu.api import (
    ERROR_TIMEOUT,
    EVENT_TYPE_XID_CRITICAL_ERROR,
    EventSet,
    NVMLError,
    error_code,
    error_text,
    handle_key,
)
from agent.gpu.session import NvmlSession

log = logging.getLogger(__name__)

DEFAULT_WAIT_MS = 250
DEFAULT_MAX_QUEUED = 4096


class NvmlXidSource:
    """An ``XidEventSource`` (see ``agent.collectors.base``) over an ``NvmlSession``."""

    def __init__(
        self,
        session: NvmlSession,
        clock: Clock | None = None,
        *,
        wait_timeout_ms: int = DEFAULT_WAIT_MS,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self._session = session
        self._clock: Clock = clock if clock is not None else session.clock
        self._wait_ms = wait_timeout_ms
        self._lock = threading.Lock()
        self._events: deque[RawXid] = deque(maxlen=max_queued)
        self._dropped = 0
        self._pci: dict[str, int] = {}
        self._capable: list[int] | None = None  # GPUs that support XID events, once probed
        self._start_error: str | None = None
        self._by_handle: dict[int, int] = {}  # handle_key -> GPU index
        self._event_set: EventSet | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- XidEventSource -----------------------------------------------------------------------

    def supported(self) -> Support:
        if not self._session.ensure_init():
            # Transient: the session retries nvmlInit (at most once per its retry interval, however
            # often it is asked), and the driver may be loaded after the agent started.
            reason = f"NVML init failed: {self._session.init_error or 'not initialized'}"
            return Support(False, reason, transient=True)
        with self._lock:
            capable = self._probe()
            if not capable:
                return Support(False, "no GPU supports NVML XID events")
            if self._start_error is not None:
                return Support(False, self._start_error)
            return Support(True)

    def start(self) -> None:
        support = self.supported()
        with self._lock:
            if self._thread is not None:
                return
            if not support.supported:
                log.info("NVML XID events not used", extra={"reason": support.reason})
                return
            api = self._session.api
            try:
                event_set = api.nvmlEventSetCreate()
            except NVMLError as exc:
                self._start_error = f"nvmlEventSetCreate: {error_text(exc)}"
                log.warning("NVML XID events unavailable", extra={"error": self._start_error})
                return
            for index in self._capable or []:
                try:
                    handle = self._session.handle(index)
                    api.nvmlDeviceRegisterEvents(handle, EVENT_TYPE_XID_CRITICAL_ERROR, event_set)
                except NVMLError as exc:
                    log.warning("XID events not registered", extra={"gpu": index, "error": error_text(exc)})
                    continue
                self._by_handle[handle_key(handle)] = index
            if not self._by_handle:
                self._start_error = "no GPU accepted XID event registration"
                self._free(event_set)
                log.warning("NVML XID events unavailable", extra={"error": self._start_error})
                return
            self._event_set = event_set
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, args=(event_set,), name="nvml-xid-events", daemon=True
            )
            self._thread.start()
            log.info("waiting for NVML XID events", extra={"gpus": sorted(self._by_handle.values())})

    def drain(self) -> list[RawXid]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            log.warning("XID events dropped: queue full", extra={"dropped": dropped})
        return events

    def pci_bus_ids(self) -> Mapping[str, int]:
        if self._session.ensure_init():
            with self._lock:
                self._probe()
        with self._lock:
            return dict(self._pci)

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self._wait_ms / 1000.0 + 1.0)
            if thread.is_alive():
                # Still inside nvmlEventSetWait: freeing the set under it is not safe.
                log.warning("XID event thread did not stop; event set not freed")
                return
        with self._lock:
            self._thread = None
            event_set, self._event_set = self._event_set, None
        if event_set is not None:
            self._free(event_set)

    # ---- internals ----------------------------------------------------------------------------

    def _probe(self) -> list[int]:
        """Which GPUs support XID events, and every GPU's PCI bus id. Caller holds the lock."""
        if self._capable is not None:
            return self._capable
        api = self._session.api
        capable: list[int] = []
        for index in range(self._session.device_count):
            try:
                handle = self._session.handle(index)
                bus_id = api.nvmlDeviceGetPciInfo(handle).busId
                text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
                normal = normalize_pci_bus_id(text)
                if normal is not None:
                    self._pci[normal] = index
                if api.nvmlDeviceGetSupportedEventTypes(handle) & EVENT_TYPE_XID_CRITICAL_ERROR:
                    capable.append(index)
            except NVMLError as exc:
                log.debug("GPU not probed for XID events", extra={"gpu": index, "error": error_text(exc)})
        self._capable = capable
        return capable

    def _free(self, event_set: EventSet) -> None:
        try:
            self._session.api.nvmlEventSetFree(event_set)
        except NVMLError as exc:
            log.warning("nvmlEventSetFree failed", extra={"error": error_text(exc)})

    def _run(self, event_set: EventSet) -> None:
        api = self._session.api
        backoff = self._wait_ms / 1000.0
        last_error: str | None = None
        while not self._stop.is_set():
            try:
                data = api.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except NVMLError as exc:
                if error_code(exc) == ERROR_TIMEOUT:
                    continue
                text = error_text(exc)
                if text != last_error:
                    log.warning("waiting for XID events failed", extra={"error": text})
                    last_error = text
                self._stop.wait(backoff)
                continue
            except Exception:  # a bug here must not silently end XID delivery for the process
                log.exception("XID event thread error")
                self._stop.wait(backoff)
                continue
            last_error = None
            if not data.eventType & EVENT_TYPE_XID_CRITICAL_ERROR:
                continue
            event = RawXid(
                gpu=self._by_handle.get(handle_key(data.device)),
                code=int(data.eventData),
                time=self._clock.time(),
            )
            with self._lock:
                if len(self._events) == self._events.maxlen:
                    self._dropped += 1
                self._events.append(event)
