"""One NVML session per agent process, shared by the NVML collector and the XID event source.

``nvmlInit`` runs once. When it fails (no driver loaded, library missing, version mismatch) the
failure is remembered as text for the report's ``errors`` and retried at most every
``retry_seconds`` on the injected clock: a node whose driver is broken still reports its NICs every
cycle without paying for a doomed init each time, and picks its GPUs up once the driver is back.

The device count is read once, right after init: NVML fixes it for the life of the session (a GPU
that falls off the bus keeps its index and answers GPU_IS_LOST). Device handles are fetched per
index on first use and kept; an index whose handle cannot be had (a GPU lost before we started)
is asked again next time.

Whoever opened the session closes it, after the collector and the event source are closed: they
share it and neither shuts NVML down under the other.
"""

from __future__ import annotations

import logging
import threading

from agent.clock import Clock, SystemClock
from agent.gpu.api import ERROR_UNINITIALIZED, DeviceHandle, NvmlApi, NVMLError, error_text, nvml_error

log = logging.getLogger(__name__)

DEFAULT_RETRY_SECONDS = 60.0


class NvmlSession:
    def __init__(
        self,
        api: NvmlApi,
        clock: Clock | None = None,
        *,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        source: str = "nvml",
    ) -> None:
        self._api = api
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._retry_seconds = retry_seconds
        self.source = source  # what the session talks to ("nvml", "fake:FILE"), for logs
        self._lock = threading.Lock()
        self._initialized = False
        self._closed = False
        self._init_error: str | None = None
        self._last_attempt: float | None = None
        self._count = 0
        self._handles: dict[int, DeviceHandle] = {}

    @property
    def api(self) -> NvmlApi:
        return self._api

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def init_error(self) -> str | None:
        """Why the last ``nvmlInit`` failed; None once it has succeeded (or before it was tried)."""
        return self._init_error

    @property
    def device_count(self) -> int:
        """GPUs NVML saw at init; 0 until init succeeds."""
        return self._count if self._initialized else 0

    def ensure_init(self) -> bool:
        """Initialize NVML unless it is, or the last failure is more recent than the retry interval."""
        with self._lock:
            if self._initialized:
                return True
            if self._closed:
                self._init_error = "NVML session closed"
                return False
            now = self._clock.monotonic()
            if self._last_attempt is not None and now - self._last_attempt < self._retry_seconds:
                return False
            self._last_attempt = now
            return self._try_init()

    def _try_init(self) -> bool:
        previous = self._init_error
        try:
            self._api.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError, or its own NVMLLibraryMismatchError
            self._init_error = error_text(exc)
            self._log_failure(previous, "nvmlInit failed")
            return False
        try:
            count = self._api.nvmlDeviceGetCount()
        except NVMLError as exc:
            self._init_error = f"nvmlDeviceGetCount: {error_text(exc)}"
            self._log_failure(previous, "NVML initialized but the GPU count is unreadable")
            self._shutdown_quietly()
            return False
        self._count = count
        self._initialized = True
        self._init_error = None
        log.info("NVML initialized", extra={"source": self.source, "gpus": count})
        return True

    def _log_failure(self, previous: str | None, message: str) -> None:
        # A broken driver stays broken for hours: say so when the reason changes, not every retry.
        level = logging.WARNING if self._init_error != previous else logging.DEBUG
        log.log(
            level,
            message,
            extra={"source": self.source, "error": self._init_error, "retry_seconds": self._retry_seconds},
        )

    def handle(self, index: int) -> DeviceHandle:
        """The device handle for ``index``; raises pynvml's NVMLError (GPU_IS_LOST, ...) if there is none."""
        handle = self._handles.get(index)
        if handle is not None:
            return handle
        with self._lock:
            if not self._initialized:
                raise nvml_error(ERROR_UNINITIALIZED)
            handle = self._handles.get(index)
            if handle is None:
                handle = self._api.nvmlDeviceGetHandleByIndex(index)
                self._handles[index] = handle
            return handle

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._handles.clear()
            if self._initialized:
                self._initialized = False
                self._shutdown_quietly()

    def _shutdown_quietly(self) -> None:
        try:
            self._api.nvmlShutdown()
        except NVMLError as exc:
            log.warning("nvmlShutdown failed", extra={"source": self.source, "error": error_text(exc)})
