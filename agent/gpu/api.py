"""The NVML boundary: the part of pynvml the agent calls, as a typed Protocol.

Two things implement ``NvmlApi``: the ``pynvml`` module itself (``agent.gpu.nvml.load_nvml``) and
``agent.gpu.fake.FakeNvml``. Both return pynvml's own ctypes structures and raise pynvml's own
``NVMLError`` subclasses, so the code that reads them is the same on a test box and on a GPU node.

Signatures are positional-only because pynvml's parameter names are not an interface we rely on.
Handles are opaque ctypes pointers (``c_nvmlDevice_t``, ``c_nvmlEventSet_t``): NVML hands them
out and takes them back; only ``handle_key`` looks at the address one holds, because an event's
``device`` field is a fresh pointer object to the same device, never the object we were given.

Error classes and constants are re-exported here from pynvml so that code outside ``agent.gpu``
never imports pynvml itself. Importing pynvml is safe on a machine without a driver: it loads
``libnvidia-ml.so`` only inside ``nvmlInit``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Final, Protocol, TypeAlias

import pynvml

# Opaque handles: whatever pynvml returns (ctypes pointers). Typed loosely on purpose: nothing
# outside NVML may look inside them.
DeviceHandle: TypeAlias = Any
EventSet: TypeAlias = Any
GpmSample: TypeAlias = Any  # c_nvmlGpmSample_t: NVML allocates it, the caller frees it


class PciInfo(Protocol):
    """``nvmlPciInfo_t``: ``busId`` is ``"00000000:3B:00.0"`` (str from recent pynvml, bytes from old)."""

    busId: str | bytes
    domain: int
    bus: int
    device: int
    pciDeviceId: int


class Utilization(Protocol):
    """``c_nvmlUtilization_t``: percent of the last sample period."""

    gpu: int
    memory: int


class MemoryInfo(Protocol):
    """``c_nvmlMemory_t``: bytes."""

    total: int
    free: int
    used: int


class FieldValueUnion(Protocol):
    """``c_nvmlValue_t``: which member is meaningful depends on ``FieldValue.valueType``."""

    dVal: float
    uiVal: int
    ulVal: int
    ullVal: int
    sllVal: int
    siVal: int
    usVal: int


class FieldValue(Protocol):
    """``c_nvmlFieldValue_t``: ``nvmlReturn`` is the per-field status (the call itself succeeded)."""

    fieldId: int
    scopeId: int
    timestamp: int
    latencyUsec: int
    valueType: int
    nvmlReturn: int
    value: FieldValueUnion


class ProcessInfo(Protocol):
    """``c_nvmlProcessInfo_t`` (pynvml hands out an object with the same attributes).

    ``pid`` is in the host's PID namespace; ``usedGpuMemory`` is bytes, None where the driver
    cannot tell (WDDM).
    """

    pid: int
    usedGpuMemory: int | None


class EventData(Protocol):
    """``c_nvmlEventData_t``: for an XID, ``eventData`` is the XID code."""

    device: DeviceHandle
    eventType: int
    eventData: int


class GpmSupport(Protocol):
    """``c_nvmlGpmSupport_t``: ``isSupportedDevice`` is 1 on a GPU with GPM (Hopper and later)."""

    version: int
    isSupportedDevice: int


class GpmMetric(Protocol):
    """``c_nvmlGpmMetric_t``: ``nvmlReturn`` is the per-metric status; ``value`` a double."""

    metricId: int
    nvmlReturn: int
    value: float


class GpmMetricsGet(Protocol):
    """``c_nvmlGpmMetricsGet_t``: the metrics asked for, computed between two samples."""

    version: int
    numMetrics: int
    sample1: GpmSample
    sample2: GpmSample
    metrics: Sequence[GpmMetric]


class NvmlApi(Protocol):
    """The subset of pynvml the agent calls. Units are NVML's: MHz, mW, mJ, percent, bytes."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> DeviceHandle: ...
    def nvmlDeviceGetUUID(self, handle: DeviceHandle, /) -> str: ...
    def nvmlDeviceGetName(self, handle: DeviceHandle, /) -> str: ...
    def nvmlDeviceGetPciInfo(self, handle: DeviceHandle, /) -> PciInfo: ...
    def nvmlDeviceGetUtilizationRates(self, handle: DeviceHandle, /) -> Utilization: ...
    def nvmlDeviceGetMemoryInfo(self, handle: DeviceHandle, /) -> MemoryInfo: ...
    def nvmlDeviceGetTemperature(self, handle: DeviceHandle, sensor: int, /) -> int: ...
    def nvmlDeviceGetFieldValues(
        self, handle: DeviceHandle, fieldIds: Sequence[int], /
    ) -> Sequence[FieldValue]: ...
    def nvmlDeviceGetPowerUsage(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: DeviceHandle, clockType: int, /) -> int: ...
    def nvmlDeviceGetMaxClockInfo(self, handle: DeviceHandle, clockType: int, /) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetPerformanceState(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: DeviceHandle, /) -> Sequence[ProcessInfo]: ...
    def nvmlDeviceGetTotalEccErrors(
        self, handle: DeviceHandle, errorType: int, counterType: int, /
    ) -> int: ...
    def nvmlDeviceGetRetiredPages(self, handle: DeviceHandle, sourceFilter: int, /) -> list[int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: DeviceHandle, /) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceGetNvLinkState(self, handle: DeviceHandle, link: int, /) -> int: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, handle: DeviceHandle, link: int, counter: int, /) -> int: ...
    def nvmlEventSetCreate(self) -> EventSet: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: DeviceHandle, /) -> int: ...
    def nvmlDeviceRegisterEvents(
        self, handle: DeviceHandle, eventTypes: int, eventSet: EventSet, /
    ) -> None: ...
    def nvmlEventSetWait_v2(self, eventSet: EventSet, timeoutms: int, /) -> EventData: ...
    def nvmlEventSetFree(self, eventSet: EventSet, /) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: ...
    def nvmlGpmQueryDeviceSupport(self, handle: DeviceHandle, /) -> GpmSupport: ...
    def nvmlGpmSampleAlloc(self) -> GpmSample: ...
    def nvmlGpmSampleFree(self, gpmSample: GpmSample, /) -> None: ...
    def nvmlGpmSampleGet(self, handle: DeviceHandle, gpmSample: GpmSample, /) -> GpmSample: ...
    def nvmlGpmMetricsGet(self, metricsGet: GpmMetricsGet, /) -> GpmMetricsGet: ...


# Every name NvmlApi declares, for checks (the fake's "missing_functions") and tests.
API_FUNCTIONS: Final[frozenset[str]] = frozenset(
    name for name in vars(NvmlApi) if name.startswith("nvml") and callable(getattr(NvmlApi, name))
)


def handle_key(handle: DeviceHandle) -> int:
    """The device address a handle holds: equal for every pointer object to the same device."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value or 0)


# pynvml's error classes. ``NVMLError(code)`` returns the subclass for that code.
NVMLError: Final[type[Exception]] = pynvml.NVMLError
NVMLError_NotSupported: Final[type[Exception]] = pynvml.NVMLError_NotSupported
NVMLError_GpuIsLost: Final[type[Exception]] = pynvml.NVMLError_GpuIsLost
NVMLError_Timeout: Final[type[Exception]] = pynvml.NVMLError_Timeout
NVMLError_FunctionNotFound: Final[type[Exception]] = pynvml.NVMLError_FunctionNotFound


def nvml_error(code: int) -> Exception:
    """A pynvml exception for ``code``, exactly as pynvml raises it (the right subclass)."""
    exc: Exception = pynvml.NVMLError(code)
    return exc


def error_code(exc: BaseException) -> int | None:
    """The NVML return code an ``NVMLError`` carries; None for any other exception."""
    value = getattr(exc, "value", None) if isinstance(exc, NVMLError) else None
    return value if isinstance(value, int) else None


def error_text(exc: BaseException) -> str:
    """pynvml's wording for an error ("GPU is lost"); it never needs the library to be loaded."""
    return str(exc) or type(exc).__name__


# Return codes.
SUCCESS: Final[int] = pynvml.NVML_SUCCESS
ERROR_INVALID_ARGUMENT: Final[int] = pynvml.NVML_ERROR_INVALID_ARGUMENT
ERROR_NOT_SUPPORTED: Final[int] = pynvml.NVML_ERROR_NOT_SUPPORTED
ERROR_FUNCTION_NOT_FOUND: Final[int] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
ERROR_GPU_IS_LOST: Final[int] = pynvml.NVML_ERROR_GPU_IS_LOST
ERROR_RESET_REQUIRED: Final[int] = pynvml.NVML_ERROR_RESET_REQUIRED
ERROR_TIMEOUT: Final[int] = pynvml.NVML_ERROR_TIMEOUT
ERROR_UNINITIALIZED: Final[int] = pynvml.NVML_ERROR_UNINITIALIZED

# Query arguments.
TEMPERATURE_GPU: Final[int] = pynvml.NVML_TEMPERATURE_GPU
FI_DEV_MEMORY_TEMP: Final[int] = pynvml.NVML_FI_DEV_MEMORY_TEMP
CLOCK_GRAPHICS: Final[int] = pynvml.NVML_CLOCK_GRAPHICS
CLOCK_SM: Final[int] = pynvml.NVML_CLOCK_SM
CLOCK_MEM: Final[int] = pynvml.NVML_CLOCK_MEM
MEMORY_ERROR_TYPE_CORRECTED: Final[int] = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
MEMORY_ERROR_TYPE_UNCORRECTED: Final[int] = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE_ECC: Final[int] = pynvml.NVML_VOLATILE_ECC
AGGREGATE_ECC: Final[int] = pynvml.NVML_AGGREGATE_ECC
PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: Final[int] = (
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
)
PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: Final[int] = (
    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
)
NVLINK_MAX_LINKS: Final[int] = pynvml.NVML_NVLINK_MAX_LINKS
NVLINK_ERROR_DL_REPLAY: Final[int] = pynvml.NVML_NVLINK_ERROR_DL_REPLAY
NVLINK_ERROR_DL_RECOVERY: Final[int] = pynvml.NVML_NVLINK_ERROR_DL_RECOVERY
NVLINK_ERROR_DL_CRC_FLIT: Final[int] = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT
NVLINK_ERROR_DL_CRC_DATA: Final[int] = pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA
FEATURE_ENABLED: Final[int] = pynvml.NVML_FEATURE_ENABLED
PSTATE_UNKNOWN: Final[int] = pynvml.NVML_PSTATE_UNKNOWN  # nvmlDeviceGetPerformanceState: no P-state
FEATURE_DISABLED: Final[int] = pynvml.NVML_FEATURE_DISABLED
EVENT_TYPE_XID_CRITICAL_ERROR: Final[int] = pynvml.nvmlEventTypeXidCriticalError

# nvmlFieldValue_t.valueType: which union member holds the value.
VALUE_TYPE_DOUBLE: Final[int] = pynvml.NVML_VALUE_TYPE_DOUBLE
VALUE_TYPE_UNSIGNED_INT: Final[int] = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
VALUE_TYPE_UNSIGNED_LONG: Final[int] = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG
VALUE_TYPE_UNSIGNED_LONG_LONG: Final[int] = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
VALUE_TYPE_SIGNED_LONG_LONG: Final[int] = pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG
VALUE_TYPE_SIGNED_INT: Final[int] = pynvml.NVML_VALUE_TYPE_SIGNED_INT
VALUE_TYPE_UNSIGNED_SHORT: Final[int] = pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT


def field_value(fv: FieldValue) -> float | int | None:
    """The value of one ``nvmlFieldValue_t``, read from the union member its ``valueType`` names."""
    kind = fv.valueType
    v = fv.value
    if kind == VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if kind == VALUE_TYPE_UNSIGNED_INT:
        return int(v.uiVal)
    if kind == VALUE_TYPE_UNSIGNED_LONG:
        return int(v.ulVal)
    if kind == VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(v.ullVal)
    if kind == VALUE_TYPE_SIGNED_LONG_LONG:
        return int(v.sllVal)
    if kind == VALUE_TYPE_SIGNED_INT:
        return int(v.siVal)
    if kind == VALUE_TYPE_UNSIGNED_SHORT:
        return int(v.usVal)
    return None


# GPU Performance Monitoring (nvmlGpm*): metrics computed by NVML between two samples.
GPM_METRIC_GRAPHICS_UTIL: Final[int] = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL  # percent
GPM_METRIC_SM_UTIL: Final[int] = pynvml.NVML_GPM_METRIC_SM_UTIL  # percent
GPM_METRIC_SM_OCCUPANCY: Final[int] = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY  # percent
GPM_METRIC_ANY_TENSOR_UTIL: Final[int] = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL  # percent
GPM_METRIC_DRAM_BW_UTIL: Final[int] = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL  # percent
GPM_METRIC_PCIE_TX_PER_SEC: Final[int] = pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC  # MiB/s
GPM_METRIC_PCIE_RX_PER_SEC: Final[int] = pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC  # MiB/s
GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: Final[int] = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC  # MiB/s
GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: Final[int] = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC  # MiB/s
GPM_METRICS_GET_VERSION: Final[int] = pynvml.NVML_GPM_METRICS_GET_VERSION
GPM_METRIC_MAX: Final[int] = pynvml.NVML_GPM_METRIC_MAX


def gpm_metrics_request(sample1: GpmSample, sample2: GpmSample, metric_ids: Sequence[int]) -> GpmMetricsGet:
    """The ``nvmlGpmMetricsGet`` argument asking for ``metric_ids`` between two samples."""
    if not 0 < len(metric_ids) <= GPM_METRIC_MAX:
        raise ValueError(f"{len(metric_ids)} GPM metrics; NVML takes 1 to {GPM_METRIC_MAX}")
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = GPM_METRICS_GET_VERSION
    request.numMetrics = len(metric_ids)
    request.sample1 = sample1
    request.sample2 = sample2
    for slot, metric_id in zip(request.metrics, metric_ids, strict=False):
        slot.metricId = metric_id
    result: GpmMetricsGet = request
    return result
