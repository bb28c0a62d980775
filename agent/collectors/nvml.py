"""GPU health from NVML: one ``Gpu`` per device, every field in the report schema's units.

NVML says MHz, mW, mJ and percent; the report says Hz, W, J and a 0..1 ratio. Each field is read
with its own call, so one call that fails costs that field only:

- NOT_SUPPORTED (and FUNCTION_NOT_FOUND: a driver too old to have the call) is ``null``, silently:
  it is what the hardware is, not a fault (H100 has no retired pages, it remaps rows).
- any other error is ``null`` too, and the GPU's failed reads are listed in one ``errors`` entry.
- GPU_IS_LOST on any call means the GPU fell off the bus: the GPU is left out of ``gpus`` and
  ``errors`` says "GPU 3 (GPU-..., 00000000:5D:00.0): GPU is lost" with code ``gpu_lost`` and
  ``gpu`` 3 (every error here carries a code: ``agent.report.ErrorCode``). Left out rather than sent with
  every field null, because a GPU with every field null reads like a GPU without sensors, while a
  GPU missing from the report is exactly what the aggregator's "GPU disappeared" rule looks for;
  the error carries the identity remembered from earlier cycles so a human knows which board.
- RESET_REQUIRED on any call means the same for a GPU that is still on the bus but unusable until
  it is reset (after some fatal errors NVML answers it to every call): left out, code
  ``reset_required``, and the GPU's other reads are skipped for the cycle.
- a UUID that cannot be read is the one read earlier in this run for that index (and bus id), as
  a GPU's UUID never changes while its handle lives; without one it is ``""``, which the report
  schema and the aggregator take as unknown (several GPUs may say it).
- a failed ``nvmlInit`` is no GPUs and one error, never an exception: the NICs still go out.

Static fields (UUID, name, PCI bus id, maximum SM clock, maximum PCIe generation and width) are
read once per device handle and kept, but only once a read of them all succeeded. The power limit
is not static (an operator or the BMC caps it at run time) and is read every cycle. The driver
version is the system's, not a GPU's: read once per cycle outside the GPUs until a read succeeds,
then kept, so a failure is one error, not one per GPU.

NVLinks: every link number up to NVML's maximum is asked until one answers INVALID_ARGUMENT (past
the GPU's last link); a link answering NOT_SUPPORTED is skipped (a floor-swept part can have such
links among working ones). Which links exist is kept per handle once a pass read them without
another error, so a GPU without NVLink costs no calls after its first cycle.

GPU Performance Monitoring (GPM: SM activity and occupancy, tensor activity, DRAM bandwidth, PCIe
and NVLink throughput) exists on Hopper and later. NVML computes its metrics between two samples,
so the collector keeps the last sample of each GPU (``_Gpm``: at most one per GPU index, so at most
``MAX_GPUS``) and reports the metrics between it and this cycle's: over the report interval, as
dcgm-exporter's DCGM_FI_PROF_* fields are over its own. A GPU's first cycle has no previous sample:
its GPM fields are null then. A GPU without GPM (``nvmlGpmQueryDeviceSupport`` says so, asked once
per handle) has them null always, silently. Every sample is freed: the previous one once the
metrics are read, both when a read fails or the GPU is lost, all of them on ``close``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, ParamSpec, TypeVar

from msgspec import UNSET, UnsetType

from agent.collectors.base import Collected, CollectorContext, Problem, Support
from agent.gpu.api import (
    AGGREGATE_ECC,
    CLOCK_MEM,
    CLOCK_SM,
    ERROR_FUNCTION_NOT_FOUND,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_SUPPORTED,
    ERROR_RESET_REQUIRED,
    FEATURE_ENABLED,
    FI_DEV_MEMORY_TEMP,
    GPM_METRIC_ANY_TENSOR_UTIL,
    GPM_METRIC_DRAM_BW_UTIL,
    GPM_METRIC_GRAPHICS_UTIL,
    GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
    GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    GPM_METRIC_PCIE_RX_PER_SEC,
    GPM_METRIC_PCIE_TX_PER_SEC,
    GPM_METRIC_SM_OCCUPANCY,
    GPM_METRIC_SM_UTIL,
    MEMORY_ERROR_TYPE_CORRECTED,
    MEMORY_ERROR_TYPE_UNCORRECTED,
    NVLINK_ERROR_DL_CRC_DATA,
    NVLINK_ERROR_DL_CRC_FLIT,
    NVLINK_ERROR_DL_RECOVERY,
    NVLINK_ERROR_DL_REPLAY,
    NVLINK_MAX_LINKS,
    PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    PSTATE_UNKNOWN,
    SUCCESS,
    TEMPERATURE_GPU,
    VOLATILE_ECC,
    DeviceHandle,
    GpmSample,
    NvmlApi,
    NVMLError,
    error_code,
    error_text,
    field_value,
    gpm_metrics_request,
    handle_key,
)
from agent.gpu.session import NvmlSession
from agent.report import ErrorCode, Gpu, NvLink

# GPM metric -> (report field, factor from NVML's unit to the report's): percent to a ratio,
# MiB/s to bytes per second.
_MIB: Final = float(2**20)
GPM_FIELDS: Final[tuple[tuple[int, str, float], ...]] = (
    (GPM_METRIC_GRAPHICS_UTIL, "gr_engine_active_ratio", 0.01),
    (GPM_METRIC_SM_UTIL, "sm_active_ratio", 0.01),
    (GPM_METRIC_SM_OCCUPANCY, "sm_occupancy_ratio", 0.01),
    (GPM_METRIC_ANY_TENSOR_UTIL, "tensor_active_ratio", 0.01),
    (GPM_METRIC_DRAM_BW_UTIL, "dram_active_ratio", 0.01),
    (GPM_METRIC_PCIE_TX_PER_SEC, "pcie_tx_bytes_per_second", _MIB),
    (GPM_METRIC_PCIE_RX_PER_SEC, "pcie_rx_bytes_per_second", _MIB),
    (GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, "nvlink_tx_bytes_per_second", _MIB),
    (GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, "nvlink_rx_bytes_per_second", _MIB),
)
_GPM_IDS: Final = tuple(metric for metric, _, _ in GPM_FIELDS)

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

MAX_GPUS: Final = 64  # the report schema's bound on gpus (and index <= 63)
MAX_LINKS: Final = min(NVLINK_MAX_LINKS, 32)  # the schema's bound on links per GPU (link <= 31)
MAX_ERROR_CHARS: Final = 1000  # the schema allows 1024 per error message
_UNSUPPORTED: Final = frozenset({ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND})
# The answers after which the rest of a GPU's reads are pointless, and the error code each gets.
_UNUSABLE: Final[dict[int, ErrorCode]] = {
    ERROR_GPU_IS_LOST: "gpu_lost",
    ERROR_RESET_REQUIRED: "reset_required",
}
_UNUSABLE_WORDS: Final[dict[ErrorCode, str]] = {
    "gpu_lost": "GPU is lost",
    "reset_required": "GPU requires a reset (NVML_ERROR_RESET_REQUIRED)",
}


class _GpuLost(Exception):
    """GPU_IS_LOST or RESET_REQUIRED from any call: the rest of this GPU's reads are pointless."""

    def __init__(self, code: ErrorCode) -> None:
        super().__init__(code)
        self.code: ErrorCode = code


def _unusable(status: int | None) -> None:
    """Raise ``_GpuLost`` for an answer that makes the GPU unusable."""
    code = _UNUSABLE.get(status) if status is not None else None
    if code is not None:
        raise _GpuLost(code)


class _Reader:
    """Calls NVML for one field; a failure becomes None (and a note, unless it is NOT_SUPPORTED)."""

    __slots__ = ("last_code", "problems")

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.last_code: int | None = None

    def __call__(self, what: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        try:
            value = fn(*args, **kwargs)
        except NVMLError as exc:
            code = self.last_code = error_code(exc)
            _unusable(code)
            if code not in _UNSUPPORTED:
                self.problems.append(f"{what}: {error_text(exc)}")
            return None
        self.last_code = SUCCESS
        return value


@dataclass(frozen=True)
class _Static:
    handle_key: int
    uuid: str
    model: str | None
    pci_bus_id: str | None
    sm_clock_max_hz: float | None
    pcie_link_gen_max: int | None
    pcie_link_width_max: int | None


def _hz(mhz: int | None) -> float | None:
    return None if mhz is None else mhz * 1e6


def _per_mille(milli: int | None) -> float | None:
    return None if milli is None else milli / 1000.0


def _ratio(percent: int) -> float:
    # Outside 0..100 would make the whole report invalid at the aggregator; NVML never should.
    return min(max(percent / 100.0, 0.0), 1.0)


def _text(value: str | bytes | None, limit: int) -> str | None:
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    return text[:limit]


@dataclass(frozen=True)
class _GpmPrevious:
    handle_key: int
    sample: GpmSample


class _Gpm:
    """GPM per GPU: the previous sample of each (one per index, freed when replaced) and whether
    the GPU has GPM at all (asked once per handle)."""

    def __init__(self) -> None:
        self._previous: dict[int, _GpmPrevious] = {}
        self._supported: dict[int, tuple[int, bool]] = {}  # index -> (handle key, has GPM)
        self._no_gpm = False  # a driver without the nvmlGpm* calls

    def read(self, api: NvmlApi, index: int, handle: DeviceHandle, r: _Reader) -> dict[str, float | None]:
        """The GPM fields between the GPU's previous sample and a new one ({} where none)."""
        key = handle_key(handle)
        previous = self._previous.pop(index, None)
        try:
            if previous is not None and previous.handle_key != key:
                _free(api, previous.sample)  # another device now: its sample says nothing here
                previous = None
            if not self._has_gpm(api, index, key, handle, r):
                return {}
            sample = r("GPM sample alloc", api.nvmlGpmSampleAlloc)
            if sample is None:
                return {}
            try:
                filled = r("GPM sample", api.nvmlGpmSampleGet, handle, sample)
            except BaseException:
                _free(api, sample)
                raise
            if filled is None:
                _free(api, sample)
                return {}
            self._previous[index] = _GpmPrevious(key, sample)
            return {} if previous is None else self._metrics(api, previous.sample, sample, r)
        finally:
            if previous is not None:
                _free(api, previous.sample)

    def _has_gpm(self, api: NvmlApi, index: int, key: int, handle: DeviceHandle, r: _Reader) -> bool:
        if self._no_gpm:
            return False
        known = self._supported.get(index)
        if known is not None and known[0] == key:
            return known[1]
        support = r("GPM support", api.nvmlGpmQueryDeviceSupport, handle)
        if support is None:
            if r.last_code == ERROR_FUNCTION_NOT_FOUND:
                self._no_gpm = True
            elif r.last_code in _UNSUPPORTED:
                self._supported[index] = (key, False)
            return False  # any other failure: asked again next cycle
        self._supported[index] = (key, bool(support.isSupportedDevice))
        return bool(support.isSupportedDevice)

    @staticmethod
    def _metrics(api: NvmlApi, first: GpmSample, second: GpmSample, r: _Reader) -> dict[str, float | None]:
        got = r("GPM metrics", api.nvmlGpmMetricsGet, gpm_metrics_request(first, second, _GPM_IDS))
        if got is None:
            return {}
        out: dict[str, float | None] = {}
        for slot, (metric, name, factor) in zip(got.metrics, GPM_FIELDS, strict=False):
            if slot.metricId != metric:
                r.problems.append(f"GPM metric {metric}: NVML answered metric {slot.metricId}")
                continue
            status = slot.nvmlReturn
            _unusable(status)
            if status == SUCCESS and math.isfinite(slot.value):
                value = max(slot.value, 0.0) * factor
                out[name] = min(value, 1.0) if name.endswith("_ratio") else value
            elif status != SUCCESS and status not in _UNSUPPORTED:
                r.problems.append(f"GPM metric {metric}: NVML error {status}")
        return out

    def forget(self, api: NvmlApi, index: int) -> None:
        """The GPU is gone (lost, or no handle): free its sample."""
        previous = self._previous.pop(index, None)
        self._supported.pop(index, None)
        if previous is not None:
            _free(api, previous.sample)

    def close(self, api: NvmlApi) -> None:
        for index in list(self._previous):
            self.forget(api, index)
        self._supported.clear()

    def __len__(self) -> int:
        return len(self._previous)


def _free(api: NvmlApi, sample: GpmSample) -> None:
    try:
        api.nvmlGpmSampleFree(sample)
    except NVMLError as exc:
        # Nothing to do about it: NVML keeps or drops the memory; the sample is never used again.
        log.debug("GPM sample free failed", extra={"error": error_text(exc)})


class NvmlCollector:
    name = "nvml"

    def __init__(self, ctx: CollectorContext) -> None:
        self._session: NvmlSession | None = ctx.nvml
        self._static: dict[int, _Static] = {}
        # index -> (UUID, PCI bus id) of the last UUID read there: the UUID to report when a read
        # of it fails (RESET_REQUIRED, UNKNOWN), so that two such GPUs do not both say "".
        self._uuids: dict[int, tuple[str, str | None]] = {}
        # index -> (handle key, the link numbers that exist): asked once per handle.
        self._links: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._lost: dict[int, ErrorCode] = {}  # index -> why it is left out, while it is
        # index -> identity of every GPU reported in this run, to name one that vanishes.
        self._reported: dict[int, str] = {}
        # Old drivers lack the newer calls; once FUNCTION_NOT_FOUND, go straight to the old one.
        self._no_clocks_event_reasons = False
        self._gpm = _Gpm()
        self._driver_version: str | None = None  # read once it is read successfully

    def supported(self) -> Support:
        if self._session is None:
            return Support(False, "no GPU backend (--gpu-backend none)")
        return Support(True)

    def close(self) -> None:
        # The session belongs to whoever opened it (the event source shares it): not shut down here.
        self._static.clear()
        if self._session is not None:
            self._gpm.close(self._session.api)

    def collect(self) -> Collected:
        session = self._session
        if session is None:
            return Collected()
        if not session.ensure_init():
            message = f"NVML init failed: {session.init_error or 'not initialized'}"
            return Collected(errors=(Problem(message, "init_failed"),))
        gpus: list[Gpu] = []
        errors: list[Problem] = []
        driver = self._driver(session.api, errors)
        count = session.device_count
        if count > MAX_GPUS:
            message = f"{count} GPUs; the report holds {MAX_GPUS}, the rest are not reported"
            errors.append(Problem(message, "too_many_gpus"))
            count = MAX_GPUS
        for index in range(count):
            gpu, error = self._collect_gpu(session, index, driver)
            if gpu is not None:
                gpus.append(gpu)
            if error is not None:
                errors.append(error)
        errors.extend(self._vanished(gpus, count))
        return Collected(gpus=tuple(gpus), errors=tuple(errors))

    def _vanished(self, gpus: list[Gpu], count: int) -> list[Problem]:
        """GPUs reported earlier in this run that NVML no longer counts (a driver reload that came
        back with fewer): named, as lost, every cycle they stay gone. One NVML still counts but
        cannot read is its handle or lost error already."""
        for gpu in gpus:
            self._reported[gpu.index] = gpu.uuid
        return [
            Problem(f"vanished: GPU {index} ({uuid}) is no longer counted by NVML", "gpu_lost", index)
            for index, uuid in sorted(self._reported.items())
            if index >= count
        ]

    def _identity(self, index: int) -> tuple[str | None, str | None]:
        """The GPU's UUID and PCI bus id as last read (a GPU unreadable since may have only its UUID)."""
        static = self._static.get(index)
        if static is not None:
            return static.uuid or None, static.pci_bus_id
        return self._uuids.get(index, (None, None))

    def _name(self, index: int) -> str:
        identity = ", ".join(part for part in self._identity(index) if part)
        return f"GPU {index} ({identity})" if identity else f"GPU {index}"

    def _collect_gpu(
        self, session: NvmlSession, index: int, driver: str | None
    ) -> tuple[Gpu | None, Problem | None]:
        try:
            handle = session.handle(index)
        except NVMLError as exc:
            self._gpm.forget(session.api, index)
            unusable = _UNUSABLE.get(error_code(exc) or SUCCESS)
            if unusable is not None:
                return None, self._mark_lost(index, unusable)
            return None, Problem(
                f"{self._name(index)}: no device handle: {error_text(exc)}", "no_handle", index
            )
        try:
            gpu, problems = self._read_gpu(session.api, index, handle, driver)
        except _GpuLost as gone:
            self._gpm.forget(session.api, index)
            return None, self._mark_lost(index, gone.code)
        if self._lost.pop(index, None) is not None:
            log.info("GPU answers again", extra={"gpu": index, "uuid": gpu.uuid})
        if not problems:
            return gpu, None
        message = f"{self._name(index)}: {len(problems)} unreadable: {'; '.join(problems)}"
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        return gpu, Problem(message, "unreadable", index)

    def _mark_lost(self, index: int, code: ErrorCode) -> Problem:
        words = _UNUSABLE_WORDS[code]
        problem = Problem(f"{self._name(index)}: {words}", code, index)
        if self._lost.get(index) != code:
            self._lost[index] = code
            uuid, pci_bus_id = self._identity(index)
            log.warning(words, extra={"gpu": index, "uuid": uuid, "pci_bus_id": pci_bus_id})
        return problem

    def _static_info(self, api: NvmlApi, index: int, handle: DeviceHandle, r: _Reader) -> _Static:
        key = handle_key(handle)
        cached = self._static.get(index)
        if cached is not None and cached.handle_key == key:
            return cached
        before = len(r.problems)
        uuid = _text(r("uuid", api.nvmlDeviceGetUUID, handle), 96)
        model = r("name", api.nvmlDeviceGetName, handle)
        pci = r("pci info", api.nvmlDeviceGetPciInfo, handle)
        pci_bus_id = _text(pci.busId, 32) if pci is not None else None
        if uuid:
            self._uuids[index] = (uuid, pci_bus_id)
        else:
            uuid = self._remembered_uuid(index, pci_bus_id)
        static = _Static(
            handle_key=key,
            uuid=uuid,
            model=_text(model, 96),
            pci_bus_id=pci_bus_id,
            sm_clock_max_hz=_hz(r("max SM clock", api.nvmlDeviceGetMaxClockInfo, handle, CLOCK_SM)),
            # What this GPU can reach in this slot (the lesser of the two), as for the width: a
            # Gen5 GPU in a Gen4 host runs at its best at Gen4, which is how the host is built,
            # not a fault (nvmlDeviceGetGpuMaxPcieLinkGeneration, the GPU's own, would make it
            # one in a pool of both kinds of host). A link trained below it is.
            pcie_link_gen_max=r("max PCIe generation", api.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            pcie_link_width_max=r("max PCIe width", api.nvmlDeviceGetMaxPcieLinkWidth, handle),
        )
        if len(r.problems) == before:
            # Only a complete read is kept; a field that failed is tried again next cycle.
            self._static[index] = static
        return static

    def _remembered_uuid(self, index: int, pci_bus_id: str | None) -> str:
        """The UUID read earlier at this index, unless the bus id says it is another board; else
        "" (unknown: the aggregator never takes it for a GPU, nor two of them for one)."""
        known = self._uuids.get(index)
        if known is None:
            return ""
        uuid, bus_id = known
        return uuid if pci_bus_id is None or bus_id is None or bus_id == pci_bus_id else ""

    def _clocks_event_reasons(self, api: NvmlApi, handle: DeviceHandle, r: _Reader) -> int | None:
        if not self._no_clocks_event_reasons:
            current = getattr(api, "nvmlDeviceGetCurrentClocksEventReasons", None)
            if current is not None:
                value: int | None = r("clock event reasons", current, handle)
                if r.last_code != ERROR_FUNCTION_NOT_FOUND:
                    return value
            self._no_clocks_event_reasons = True
        return r("clock event reasons", api.nvmlDeviceGetCurrentClocksThrottleReasons, handle)

    @staticmethod
    def _memory_temperature(api: NvmlApi, handle: DeviceHandle, r: _Reader) -> float | None:
        values = r("memory temperature", api.nvmlDeviceGetFieldValues, handle, [FI_DEV_MEMORY_TEMP])
        if not values:
            return None
        fv = values[0]
        status = fv.nvmlReturn
        _unusable(status)
        if status == SUCCESS:
            value = field_value(fv)
            return None if value is None else float(value)
        if status not in _UNSUPPORTED:
            r.problems.append(f"memory temperature: NVML error {status}")
        return None

    def _nvlinks(
        self, api: NvmlApi, index: int, handle: DeviceHandle, r: _Reader
    ) -> tuple[NvLink, ...] | UnsetType:
        key = handle_key(handle)
        known = self._links.get(index)
        numbers = known[1] if known is not None and known[0] == key else range(MAX_LINKS)
        complete = True  # every link answered, or said it does not exist: worth remembering
        present: list[int] = []
        links: list[NvLink] = []
        counter = api.nvmlDeviceGetNvLinkErrorCounter
        for link in numbers:
            try:
                state: int | None = api.nvmlDeviceGetNvLinkState(handle, link)
            except NVMLError as exc:
                code = error_code(exc)
                if code == ERROR_INVALID_ARGUMENT:
                    break  # past the GPU's last link
                if code in _UNSUPPORTED:
                    continue  # this link (or the whole GPU) has no NVLink; the next may
                _unusable(code)
                r.problems.append(f"nvlink {link} state: {error_text(exc)}")
                complete = False
                state = None
            present.append(link)
            links.append(
                NvLink(
                    link=link,
                    active=None if state is None else state == FEATURE_ENABLED,
                    crc_flit_errors_total=r(
                        f"nvlink {link} crc flit", counter, handle, link, NVLINK_ERROR_DL_CRC_FLIT
                    ),
                    crc_data_errors_total=r(
                        f"nvlink {link} crc data", counter, handle, link, NVLINK_ERROR_DL_CRC_DATA
                    ),
                    replay_errors_total=r(
                        f"nvlink {link} replay", counter, handle, link, NVLINK_ERROR_DL_REPLAY
                    ),
                    recovery_errors_total=r(
                        f"nvlink {link} recovery", counter, handle, link, NVLINK_ERROR_DL_RECOVERY
                    ),
                )
            )
        if complete and (known is None or known[0] != key):
            self._links[index] = (key, tuple(present))
        # The schema has no null for nvlink: a GPU without NVLink leaves the field out.
        return tuple(links) if links else UNSET

    def _driver(self, api: NvmlApi, errors: list[Problem]) -> str | None:
        """The system's driver version, read until a read succeeds; a failure is one error."""
        if self._driver_version is None:
            try:
                self._driver_version = _text(api.nvmlSystemGetDriverVersion(), 32)
            except NVMLError as exc:
                if error_code(exc) not in _UNSUPPORTED:
                    errors.append(Problem(f"driver version unreadable: {error_text(exc)}", "unreadable"))
        return self._driver_version

    def _read_gpu(
        self, api: NvmlApi, index: int, handle: DeviceHandle, driver: str | None
    ) -> tuple[Gpu, list[str]]:
        r = _Reader()
        static = self._static_info(api, index, handle, r)
        gpm = self._gpm.read(api, index, handle, r)
        util = r("utilization", api.nvmlDeviceGetUtilizationRates, handle)
        memory = r("memory info", api.nvmlDeviceGetMemoryInfo, handle)
        temperature = r("temperature", api.nvmlDeviceGetTemperature, handle, TEMPERATURE_GPU)
        pstate = r("performance state", api.nvmlDeviceGetPerformanceState, handle)
        retired_sbe = r(
            "retired pages (SBE)",
            api.nvmlDeviceGetRetiredPages,
            handle,
            PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        retired_dbe = r(
            "retired pages (DBE)",
            api.nvmlDeviceGetRetiredPages,
            handle,
            PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        retired_pending = r("retired pages pending", api.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        remapped = r("remapped rows", api.nvmlDeviceGetRemappedRows, handle)
        ecc = api.nvmlDeviceGetTotalEccErrors
        gpu = Gpu(
            index=index,
            uuid=static.uuid,
            model=static.model,
            pci_bus_id=static.pci_bus_id,
            utilization_ratio=_ratio(util.gpu) if util is not None else None,
            memory_utilization_ratio=_ratio(util.memory) if util is not None else None,
            memory_used_bytes=memory.used if memory is not None else None,
            memory_total_bytes=memory.total if memory is not None else None,
            temperature_celsius=float(temperature) if temperature is not None else None,
            memory_temperature_celsius=self._memory_temperature(api, handle, r),
            power_watts=_per_mille(r("power", api.nvmlDeviceGetPowerUsage, handle)),
            power_limit_watts=_per_mille(r("power limit", api.nvmlDeviceGetEnforcedPowerLimit, handle)),
            energy_joules_total=_per_mille(r("energy", api.nvmlDeviceGetTotalEnergyConsumption, handle)),
            sm_clock_hz=_hz(r("SM clock", api.nvmlDeviceGetClockInfo, handle, CLOCK_SM)),
            sm_clock_max_hz=static.sm_clock_max_hz,
            memory_clock_hz=_hz(r("memory clock", api.nvmlDeviceGetClockInfo, handle, CLOCK_MEM)),
            clock_event_reasons=self._clocks_event_reasons(api, handle, r),
            # 32 is NVML_PSTATE_UNKNOWN: no P-state, not a 33rd one.
            performance_state=pstate if pstate is not None and 0 <= pstate < PSTATE_UNKNOWN else None,
            ecc_sbe_volatile_total=r(
                "ECC SBE volatile", ecc, handle, MEMORY_ERROR_TYPE_CORRECTED, VOLATILE_ECC
            ),
            ecc_dbe_volatile_total=r(
                "ECC DBE volatile", ecc, handle, MEMORY_ERROR_TYPE_UNCORRECTED, VOLATILE_ECC
            ),
            ecc_sbe_aggregate_total=r(
                "ECC SBE aggregate", ecc, handle, MEMORY_ERROR_TYPE_CORRECTED, AGGREGATE_ECC
            ),
            ecc_dbe_aggregate_total=r(
                "ECC DBE aggregate", ecc, handle, MEMORY_ERROR_TYPE_UNCORRECTED, AGGREGATE_ECC
            ),
            retired_pages_sbe=len(retired_sbe) if retired_sbe is not None else None,
            retired_pages_dbe=len(retired_dbe) if retired_dbe is not None else None,
            retired_pages_pending=retired_pending == FEATURE_ENABLED if retired_pending is not None else None,
            remapped_rows_correctable=remapped[0] if remapped is not None else None,
            remapped_rows_uncorrectable=remapped[1] if remapped is not None else None,
            remapped_rows_pending=bool(remapped[2]) if remapped is not None else None,
            remapped_rows_failure=bool(remapped[3]) if remapped is not None else None,
            pcie_link_gen=r("PCIe generation", api.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            pcie_link_gen_max=static.pcie_link_gen_max,
            pcie_link_width=r("PCIe width", api.nvmlDeviceGetCurrPcieLinkWidth, handle),
            pcie_link_width_max=static.pcie_link_width_max,
            pcie_replay_total=r("PCIe replays", api.nvmlDeviceGetPcieReplayCounter, handle),
            nvlink=self._nvlinks(api, index, handle, r),
            driver_version=driver,
            **gpm,
        )
        return gpu, r.problems
