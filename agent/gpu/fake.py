"""A fake NVML that behaves like pynvml, described by a small JSON file.

``FakeNvml`` implements ``NvmlApi``: it returns pynvml's own ctypes structures (``nvmlPciInfo_t``,
``c_nvmlMemory_t``, ``c_nvmlEventData_t``, arrays of ``c_nvmlFieldValue_t``), hands out
``c_nvmlDevice_t`` pointers as handles, and raises pynvml's own exceptions
(``pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)`` is a ``pynvml.NVMLError_GpuIsLost``), so the
code tested against it is the code that runs on real GPUs. It is what ``--gpu-backend fake:FILE``
runs, and what the tests use.

The file
--------
Everything is optional. ``{}`` is a healthy idle 8-GPU HGX H100 SXM 80GB node::

    {
      "count": 8,                          GPUs, 0..64
      "seed": "node-a",                    mixed into the generated GPU UUIDs, so that several fake
                                           nodes do not share them (default "gpuwarden-fake")
      "init_error": "DRIVER_NOT_LOADED",   nvmlInit raises this NVML error (any NVML_ERROR_* name
                                           without the prefix: LIBRARY_NOT_FOUND, UNKNOWN, ...)
      "missing_functions": ["nvmlDeviceGetCurrentClocksEventReasons"],
                                           an older driver: these raise FUNCTION_NOT_FOUND
      "all":  {FIELDS},                    overrides for every GPU
      "gpus": {"3": {FIELDS}},             overrides for one GPU, by index (applied after "all")
      "driver_version": "550.90.07",       nvmlSystemGetDriverVersion
      "events": [{"gpu": 3, "xid": 79}]    XIDs delivered by nvmlEventSetWait_v2 to the first event
                                           set that waits on that GPU's XIDs, once each (never, for
                                           a GPU lost from the start: NVML cannot register on it)
    }

FIELDS maps a field to a value, or to ``{"error": "NAME"}``: then every call that reads the field
raises that NVML error (``{"error": "NOT_SUPPORTED"}`` is how hardware says "I don't have this").
``"lost": true`` makes every call on the GPU raise GPU_IS_LOST, as after an XID 79: its handle
too (``nvmlDeviceGetHandleByIndex``), and ``nvmlEventSetWait_v2`` on a set registered on it once
the set's queued events are handed out.

=========================== ======================== =============================================
field                       default (per GPU)        read by (units)
=========================== ======================== =============================================
uuid                        GPU-<uuid5 of seed/idx>  nvmlDeviceGetUUID
name                        NVIDIA H100 80GB HBM3    nvmlDeviceGetName
pci_bus_id                  00000000:18:00.0, ...    nvmlDeviceGetPciInfo (the DGX H100 bus numbers)
utilization_gpu             0                        nvmlDeviceGetUtilizationRates (percent)
utilization_memory          0                        nvmlDeviceGetUtilizationRates (percent)
memory_total                85520809984 (81559 MiB)  nvmlDeviceGetMemoryInfo (bytes; free = total-used)
memory_used                 595591168 (568 MiB)      nvmlDeviceGetMemoryInfo (bytes)
temperature                 35..42                   nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU) (C)
memory_temperature          temperature + 4          nvmlDeviceGetFieldValues NVML_FI_DEV_MEMORY_TEMP
                                                     (C; an error is the field's nvmlReturn, as in NVML)
power_usage                 68000 + 1250 * idx       nvmlDeviceGetPowerUsage (mW)
power_limit                 700000                   nvmlDeviceGetEnforcedPowerLimit (mW)
energy                      6048000000 + ...         nvmlDeviceGetTotalEnergyConsumption (mJ)
sm_clock                    345 (idle)               nvmlDeviceGetClockInfo SM and GRAPHICS (MHz)
mem_clock                   2619                     nvmlDeviceGetClockInfo MEM (MHz)
sm_clock_max                1980                     nvmlDeviceGetMaxClockInfo SM and GRAPHICS (MHz)
mem_clock_max               2619                     nvmlDeviceGetMaxClockInfo MEM (MHz)
clocks_event_reasons        1 (GpuIdle)              nvmlDeviceGetCurrentClocks{Event,Throttle}Reasons
performance_state           0                        nvmlDeviceGetPerformanceState
ecc_sbe_volatile            0                        nvmlDeviceGetTotalEccErrors CORRECTED, VOLATILE
ecc_dbe_volatile            0                        ... UNCORRECTED, VOLATILE
ecc_sbe_aggregate           0                        ... CORRECTED, AGGREGATE
ecc_dbe_aggregate           0                        ... UNCORRECTED, AGGREGATE
retired_pages_sbe           NOT_SUPPORTED            nvmlDeviceGetRetiredPages (pages; H100 remaps rows
retired_pages_dbe           NOT_SUPPORTED            instead, so NVML says NOT_SUPPORTED there)
retired_pages_pending       NOT_SUPPORTED            nvmlDeviceGetRetiredPagesPendingStatus (bool)
remapped_rows_correctable   0                        nvmlDeviceGetRemappedRows
remapped_rows_uncorrectable 0                        nvmlDeviceGetRemappedRows
remapped_rows_pending       false                    nvmlDeviceGetRemappedRows
remapped_rows_failure       false                    nvmlDeviceGetRemappedRows
pcie_link_gen               5                        nvmlDeviceGetCurrPcieLinkGeneration
pcie_link_width             16                       nvmlDeviceGetCurrPcieLinkWidth
pcie_link_gen_max           5                        nvmlDeviceGetGpuMaxPcieLinkGeneration (the GPU's)
pcie_link_gen_max_system    pcie_link_gen_max        nvmlDeviceGetMaxPcieLinkGeneration (GPU and slot)
pcie_link_width_max         16                       nvmlDeviceGetMaxPcieLinkWidth
pcie_replay                 0                        nvmlDeviceGetPcieReplayCounter
nvlinks                     18                       how many links exist: nvmlDeviceGetNvLinkState of a
                                                     link past them is INVALID_ARGUMENT (NOT_SUPPORTED
                                                     for every link when 0)
supported_event_types       SBE|DBE|PState|Xid|...   nvmlDeviceGetSupportedEventTypes (bitmask)
lost                        false                    every call on the GPU: GPU_IS_LOST
processes                   [] (idle)                nvmlDeviceGetComputeRunningProcesses: a list of
                                                     {"pid": 4242, "used_memory": 1073741824}
                                                     (used_memory in bytes, optional, default 0)
gpm_supported               true                     nvmlGpmQueryDeviceSupport (Hopper and later);
                                                     false: nvmlGpmSampleGet is NOT_SUPPORTED
gpm_gr_engine_active        0 (idle)                 nvmlGpmMetricsGet GRAPHICS_UTIL (percent)
gpm_sm_active               0 (idle)                 nvmlGpmMetricsGet SM_UTIL (percent)
gpm_sm_occupancy            0                        ... SM_OCCUPANCY (percent)
gpm_tensor_active           0                        ... ANY_TENSOR_UTIL (percent)
gpm_dram_active             0                        ... DRAM_BW_UTIL (percent)
gpm_pcie_tx, gpm_pcie_rx    12, 25                   ... PCIE_TX/RX_PER_SEC (MiB/s)
gpm_nvlink_tx, gpm_nvlink_rx 0, 0                    ... NVLINK_TOTAL_TX/RX_PER_SEC (MiB/s); an error is
                                                     that metric's nvmlReturn, as in NVML. A metric is
                                                     what the GPU held at the later sample.
nvlink                      all active, no errors    per link: {"5": {"active": false, "crc_flit": 12}}
                                                     ("*" for every link); link fields: active,
                                                     crc_flit, crc_data, replay, recovery
                                                     (nvmlDeviceGetNvLinkState / ErrorCounter);
                                                     "active": {"error": "NOT_SUPPORTED"} is a link
                                                     the part does not have among others (floor-
                                                     swept): every call on it is NOT_SUPPORTED
=========================== ======================== =============================================

Numbers are non-negative integers, flags JSON booleans. A mistake in the file (an unknown field, a
wrong type, an unknown error name) is a ``ConfigError`` naming the file and the field.

GPM samples are allocated, filled and freed as in NVML (``open_gpm_samples`` counts the samples
allocated and not yet freed; freeing one twice is INVALID_ARGUMENT).

``nvmlSystemGetDriverVersion`` answers ``driver_version`` (a top-level key, default "550.90.07").

Tests change a running fake with ``update(index, FIELDS)`` (same format), ``inject_xid(index,
code)`` and ``set_init_error(name)``; ``value(index, field)`` reads back what the fake will answer.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pynvml

from agent.collectors.base import normalize_pci_bus_id
from agent.errors import ConfigError
from agent.gpu.api import (
    API_FUNCTIONS,
    FEATURE_DISABLED,
    FEATURE_ENABLED,
    DeviceHandle,
    EventData,
    EventSet,
    FieldValue,
    GpmMetricsGet,
    GpmSample,
    GpmSupport,
    MemoryInfo,
    PciInfo,
    ProcessInfo,
    Utilization,
)

MAX_GPUS: Final = 64
_HANDLE_BASE: Final = 0x7F00_0000_1000  # fake device addresses: never dereferenced, only compared
_EVENT_SET_BASE: Final = 0x7F00_0010_0000
_UUID_NAMESPACE: Final = uuid.UUID("9f1c4e52-6d0b-4c1e-9a59-5f6b8c7d2e10")
# The DGX H100 / HGX H100 8-GPU bus numbers, in NVML index order.
_DGX_H100_BUSES: Final = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_H100_PCI_DEVICE_ID: Final = 0x233010DE
_H100_PCI_SUBSYSTEM_ID: Final = 0x16C110DE
_H100_EVENT_TYPES: Final[int] = (
    pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeClock
    | pynvml.nvmlEventMigConfigChange
)

# Every NVML error a file may name: the NVML_ERROR_* constants pynvml defines, without the prefix.
ERROR_NAMES: Final[dict[str, int]] = {
    name.removeprefix("NVML_ERROR_"): value
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


@dataclass(frozen=True)
class FakeError:
    """A field that makes the calls reading it raise this NVML error."""

    name: str

    @property
    def code(self) -> int:
        return ERROR_NAMES[self.name]


Processes = tuple[tuple[int, int], ...]  # (pid, used GPU memory bytes) per compute process
Value = int | bool | str | Processes | FakeError | None


@dataclass(frozen=True)
class _Spec:
    kind: str  # "int", "bool", "str", "pci"
    low: int = 0
    high: int | None = None


_GPU_FIELDS: Final[dict[str, _Spec]] = {
    "uuid": _Spec("str"),
    "name": _Spec("str"),
    "pci_bus_id": _Spec("pci"),
    "utilization_gpu": _Spec("int", 0, 100),
    "utilization_memory": _Spec("int", 0, 100),
    "memory_total": _Spec("int"),
    "memory_used": _Spec("int"),
    "temperature": _Spec("int"),
    "memory_temperature": _Spec("int"),
    "power_usage": _Spec("int"),
    "power_limit": _Spec("int"),
    "energy": _Spec("int"),
    "sm_clock": _Spec("int"),
    "mem_clock": _Spec("int"),
    "sm_clock_max": _Spec("int"),
    "mem_clock_max": _Spec("int"),
    "clocks_event_reasons": _Spec("int"),
    "performance_state": _Spec("int", 0, 32),
    "ecc_sbe_volatile": _Spec("int"),
    "ecc_dbe_volatile": _Spec("int"),
    "ecc_sbe_aggregate": _Spec("int"),
    "ecc_dbe_aggregate": _Spec("int"),
    "retired_pages_sbe": _Spec("int", 0, 4096),
    "retired_pages_dbe": _Spec("int", 0, 4096),
    "retired_pages_pending": _Spec("bool"),
    "remapped_rows_correctable": _Spec("int"),
    "remapped_rows_uncorrectable": _Spec("int"),
    "remapped_rows_pending": _Spec("bool"),
    "remapped_rows_failure": _Spec("bool"),
    "pcie_link_gen": _Spec("int"),
    "pcie_link_width": _Spec("int"),
    "pcie_link_gen_max": _Spec("int"),
    "pcie_link_gen_max_system": _Spec("int"),
    "pcie_link_width_max": _Spec("int"),
    "pcie_replay": _Spec("int"),
    "nvlinks": _Spec("int", 0, pynvml.NVML_NVLINK_MAX_LINKS),
    "supported_event_types": _Spec("int"),
    "lost": _Spec("bool"),
    "processes": _Spec("processes"),
    "gpm_supported": _Spec("bool"),
    "gpm_gr_engine_active": _Spec("int", 0, 100),
    "gpm_sm_active": _Spec("int", 0, 100),
    "gpm_sm_occupancy": _Spec("int", 0, 100),
    "gpm_tensor_active": _Spec("int", 0, 100),
    "gpm_dram_active": _Spec("int", 0, 100),
    "gpm_pcie_tx": _Spec("int"),
    "gpm_pcie_rx": _Spec("int"),
    "gpm_nvlink_tx": _Spec("int"),
    "gpm_nvlink_rx": _Spec("int"),
}
# GPM metric id -> the field that answers it.
_GPM_FIELDS: Final[dict[int, str]] = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: "gpm_gr_engine_active",
    pynvml.NVML_GPM_METRIC_SM_UTIL: "gpm_sm_active",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "gpm_sm_occupancy",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "gpm_tensor_active",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "gpm_dram_active",
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: "gpm_pcie_tx",
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: "gpm_pcie_rx",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "gpm_nvlink_tx",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "gpm_nvlink_rx",
}
_GPM_SAMPLE_BASE: Final = 0x7F00_0100_0000
_LINK_FIELDS: Final[dict[str, _Spec]] = {
    "active": _Spec("bool"),
    "crc_flit": _Spec("int"),
    "crc_data": _Spec("int"),
    "replay": _Spec("int"),
    "recovery": _Spec("int"),
}
_NVLINK_COUNTER_FIELDS: Final[dict[int, str]] = {
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
}
_TOP_LEVEL: Final = frozenset(
    {"count", "seed", "init_error", "missing_functions", "all", "gpus", "events", "driver_version"}
)


def default_gpu(index: int, seed: str = "gpuwarden-fake") -> dict[str, Value]:
    """A healthy, idle H100 SXM 80GB at ``index`` (see the module docstring for the table)."""
    bus = _DGX_H100_BUSES[index % len(_DGX_H100_BUSES)]
    temperature = 35 + (index * 3) % 8
    return {
        "uuid": f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{seed}/{index}')}",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"{index // len(_DGX_H100_BUSES):08X}:{bus:02X}:00.0",
        "utilization_gpu": 0,
        "utilization_memory": 0,
        "memory_total": 81559 * 1024 * 1024,
        "memory_used": 568 * 1024 * 1024,
        "temperature": temperature,
        "memory_temperature": temperature + 4,
        "power_usage": 68_000 + 1_250 * index,
        "power_limit": 700_000,
        "energy": 6_048_000_000 + 37_000_000 * index,
        "sm_clock": 345,
        "mem_clock": 2619,
        "sm_clock_max": 1980,
        "mem_clock_max": 2619,
        "clocks_event_reasons": pynvml.nvmlClocksEventReasonGpuIdle,
        "performance_state": 0,
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_aggregate": 0,
        "ecc_dbe_aggregate": 0,
        "retired_pages_sbe": FakeError("NOT_SUPPORTED"),
        "retired_pages_dbe": FakeError("NOT_SUPPORTED"),
        "retired_pages_pending": FakeError("NOT_SUPPORTED"),
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "pcie_link_gen": 5,
        "pcie_link_width": 16,
        "pcie_link_gen_max": 5,
        "pcie_link_gen_max_system": None,  # follows pcie_link_gen_max
        "pcie_link_width_max": 16,
        "pcie_replay": 0,
        "nvlinks": 18,
        "supported_event_types": _H100_EVENT_TYPES,
        "lost": False,
        "processes": (),
        "gpm_supported": True,
        "gpm_gr_engine_active": 0,
        "gpm_sm_active": 0,
        "gpm_sm_occupancy": 0,
        "gpm_tensor_active": 0,
        "gpm_dram_active": 0,
        "gpm_pcie_tx": 12,
        "gpm_pcie_rx": 25,
        "gpm_nvlink_tx": 0,
        "gpm_nvlink_rx": 0,
    }


def _default_link() -> dict[str, Value]:
    return {"active": True, "crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}


def _error(where: str, raw: object) -> FakeError:
    """An NVML error name: "GPU_IS_LOST", or spelled as the constant, "NVML_ERROR_GPU_IS_LOST"."""
    name = raw.upper().removeprefix("NVML_ERROR_") if isinstance(raw, str) else ""
    if name not in ERROR_NAMES:
        raise ConfigError(f"{where}: unknown NVML error {raw!r}; known: {', '.join(ERROR_NAMES)}")
    return FakeError(name)


def _parse_value(where: str, spec: _Spec, raw: object) -> Value:
    if isinstance(raw, dict):
        if set(raw) != {"error"}:
            raise ConfigError(f'{where}: expected a value or {{"error": NAME}}, got {raw!r}')
        return _error(where, raw["error"])
    if spec.kind == "processes":
        return _parse_processes(where, raw)
    if spec.kind == "bool":
        if not isinstance(raw, bool):
            raise ConfigError(f"{where}: expected true or false, got {raw!r}")
        return raw
    if spec.kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"{where}: expected an integer, got {raw!r}")
        if raw < spec.low or (spec.high is not None and raw > spec.high):
            bound = f"{spec.low}..{spec.high}" if spec.high is not None else f">= {spec.low}"
            raise ConfigError(f"{where}: {raw} is out of range ({bound})")
        return raw
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: expected a string, got {raw!r}")
    if spec.kind == "pci":
        normal = normalize_pci_bus_id(raw)
        if normal is None:
            raise ConfigError(f"{where}: {raw!r} is not a PCI bus id like 00000000:18:00.0")
        domain, bus, dev = (int(part, 16) for part in normal.split(":"))
        return f"{domain:08X}:{bus:02X}:{dev:02X}.0"
    return raw


def _parse_processes(where: str, raw: object) -> Processes:
    if not isinstance(raw, list):
        raise ConfigError(f'{where}: expected a list of {{"pid": N, "used_memory": BYTES}}, got {raw!r}')
    out: list[tuple[int, int]] = []
    for n, item in enumerate(raw):
        entry = _object(f"{where}[{n}]", item)
        unknown = set(entry) - {"pid", "used_memory"}
        pid, memory = entry.get("pid"), entry.get("used_memory", 0)
        if unknown or not _is_count(pid) or not _is_count(memory):
            raise ConfigError(
                f'{where}[{n}]: expected {{"pid": N, "used_memory": BYTES}} '
                f"with non-negative integers, got {item!r}"
            )
        assert isinstance(pid, int) and isinstance(memory, int)
        out.append((pid, memory))
    return tuple(out)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _object(where: str, raw: object) -> Mapping[str, object]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object, got {type(raw).__name__}")
    return raw


def _index(where: str, key: str, limit: int) -> int:
    if not key.isdigit() or int(key) >= limit:
        raise ConfigError(f"{where}: {key!r} is not an index below {limit}")
    return int(key)


@dataclass
class _Gpu:
    index: int
    handle: DeviceHandle
    values: dict[str, Value]
    links: list[dict[str, Value]]

    def set(self, where: str, overrides: Mapping[str, object]) -> None:
        """Apply FIELDS overrides, all or nothing: a mistake anywhere changes nothing."""
        values = dict(self.values)
        for name, raw in overrides.items():
            if name == "nvlink":
                continue
            spec = _GPU_FIELDS.get(name)
            if spec is None:
                known = ", ".join([*_GPU_FIELDS, "nvlink"])
                raise ConfigError(f"{where}.{name}: unknown field; known: {known}")
            values[name] = _parse_value(f"{where}.{name}", spec, raw)
        links = [dict(link) for link in self.links]
        count = values["nvlinks"]
        if isinstance(count, int):
            del links[count:]
            links.extend(_default_link() for _ in range(count - len(links)))
        if "nvlink" in overrides:
            _set_links(f"{where}.nvlink", links, _object(f"{where}.nvlink", overrides["nvlink"]))
        self.values, self.links = values, links


def _set_links(where: str, links: list[dict[str, Value]], overrides: Mapping[str, object]) -> None:
    for key, raw in overrides.items():
        fields = _object(f"{where}.{key}", raw)
        targets = links if key == "*" else [links[_index(where, key, len(links))]]
        for name, value in fields.items():
            spec = _LINK_FIELDS.get(name)
            if spec is None:
                known = ", ".join(_LINK_FIELDS)
                raise ConfigError(f"{where}.{key}.{name}: unknown field; known: {known}")
            parsed = _parse_value(f"{where}.{key}.{name}", spec, value)
            for link in targets:
                link[name] = parsed


@dataclass
class _EventSetState:
    handle: EventSet
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> event type mask
    queue: deque[tuple[int, int]] = field(default_factory=deque)  # (GPU index, XID)
    freed: bool = False


@dataclass
class _GpmSampleState:
    handle: Any  # the c_nvmlGpmSample_t handed out
    gpu: int | None = None  # the GPU it was last filled from
    values: dict[int, Value] = field(default_factory=dict)  # metric id -> answer, at that time


def _raise(code: int) -> Exception:
    exc: Exception = pynvml.NVMLError(code)
    return exc


class FakeNvml:
    """An ``NvmlApi`` over a description (see the module docstring). Thread-safe, like NVML."""

    def __init__(self, description: Mapping[str, object] | None = None, *, source: str = "<fake>") -> None:
        data = _object(source, dict(description or {}))
        unknown = set(data) - _TOP_LEVEL
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}; known: {sorted(_TOP_LEVEL)}")
        self.source = source
        count = data.get("count", 8)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_GPUS:
            raise ConfigError(f"{source}: count: expected an integer 0..{MAX_GPUS}, got {count!r}")
        seed = data.get("seed", "gpuwarden-fake")
        if not isinstance(seed, str):
            raise ConfigError(f"{source}: seed: expected a string, got {seed!r}")
        init_error = data.get("init_error")
        self._init_error = None if init_error is None else _error(f"{source}: init_error", init_error)
        missing = data.get("missing_functions", [])
        if not isinstance(missing, list) or not all(isinstance(m, str) for m in missing):
            raise ConfigError(f"{source}: missing_functions: expected a list of function names")
        bad = sorted(set(missing) - API_FUNCTIONS)
        if bad:
            raise ConfigError(f"{source}: missing_functions: {bad} are not NvmlApi functions")
        self._missing = frozenset(missing)

        self._cond = threading.Condition()
        self._refcount = 0
        self.init_calls = 0  # every nvmlInit call, failed ones included
        self._gpus: list[_Gpu] = []
        self._by_address: dict[int, _Gpu] = {}
        for index in range(count):
            handle = ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + 0x100 * index), pynvml.c_nvmlDevice_t)
            gpu = _Gpu(index, handle, default_gpu(index, seed), [])
            gpu.set(source, {})
            self._gpus.append(gpu)
            self._by_address[_HANDLE_BASE + 0x100 * index] = gpu
        if "all" in data:
            for gpu in self._gpus:
                gpu.set(f"{source}: all", _object(f"{source}: all", data["all"]))
        for key, overrides in _object(f"{source}: gpus", data.get("gpus", {})).items():
            index = _index(f"{source}: gpus", key, count)
            self._gpus[index].set(f"{source}: gpus.{key}", _object(f"{source}: gpus.{key}", overrides))

        self._file_events: list[tuple[int, int]] = []
        events = data.get("events", [])
        if not isinstance(events, list):
            raise ConfigError(f"{source}: events: expected a list")
        for n, raw in enumerate(events):
            event = _object(f"{source}: events[{n}]", raw)
            gpu_index, xid = event.get("gpu"), event.get("xid")
            if set(event) != {"gpu", "xid"} or not isinstance(gpu_index, int) or not isinstance(xid, int):
                raise ConfigError(
                    f'{source}: events[{n}]: expected {{"gpu": INDEX, "xid": CODE}}, got {raw!r}'
                )
            if not 0 <= gpu_index < count or xid < 0:
                raise ConfigError(f"{source}: events[{n}]: gpu must be below {count} and xid >= 0")
            self._file_events.append((gpu_index, xid))
        self._event_sets: dict[int, _EventSetState] = {}
        driver = data.get("driver_version", "550.90.07")
        if not isinstance(driver, str) or not 0 < len(driver) <= 80:
            raise ConfigError(f"{source}: driver_version: expected a version string, got {driver!r}")
        self._driver_version = driver
        self._gpm_samples: dict[int, _GpmSampleState] = {}
        self._gpm_next = 0

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, description: Mapping[str, object], *, source: str = "<dict>") -> FakeNvml:
        return cls(description, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> FakeNvml:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"fake GPU file {path}: {exc.strerror or exc}") from exc
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"fake GPU file {path}: not JSON: {exc}") from exc
        return cls(_object(str(path), data), source=str(path))

    # ---- test controls ------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return len(self._gpus)

    @property
    def initialized(self) -> bool:
        with self._cond:
            return self._refcount > 0

    @property
    def open_event_sets(self) -> int:
        with self._cond:
            return sum(1 for s in self._event_sets.values() if not s.freed)

    @property
    def queued_events(self) -> int:
        """XIDs queued on live event sets and not yet handed out by nvmlEventSetWait_v2."""
        with self._cond:
            return sum(len(s.queue) for s in self._event_sets.values() if not s.freed)

    @property
    def open_gpm_samples(self) -> int:
        """GPM samples allocated by nvmlGpmSampleAlloc and not yet freed."""
        with self._cond:
            return len(self._gpm_samples)

    def update(self, index: int, overrides: Mapping[str, object]) -> None:
        """Change GPU ``index`` while running, with the file's FIELDS format."""
        with self._cond:
            self._gpus[index].set(f"{self.source}: update({index})", overrides)
            self._cond.notify_all()  # a waiter re-checks for a GPU that was just lost

    def value(self, index: int, name: str) -> Value:
        """What the fake holds for a GPU field (a ``FakeError`` where it will raise)."""
        with self._cond:
            values = self._gpus[index].values
            if name == "pcie_link_gen_max_system" and values[name] is None:
                return values["pcie_link_gen_max"]
            return values[name]

    def set_init_error(self, name: str | None) -> None:
        """Make later nvmlInit calls fail with this NVML error (None: succeed)."""
        parsed = None if name is None else _error(f"{self.source}: set_init_error", name)
        with self._cond:
            self._init_error = parsed

    def inject_xid(self, index: int, code: int) -> int:
        """An XID on GPU ``index``, queued on every live event set registered for XIDs on it.

        Like NVML, an XID that no event set is registered for is not kept. Returns how many event
        sets it was queued on.
        """
        with self._cond:
            if not 0 <= index < len(self._gpus):
                raise IndexError(f"no GPU {index} (count {len(self._gpus)})")
            reached = 0
            for state in self._event_sets.values():
                if not state.freed and state.registered.get(index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                    state.queue.append((index, code))
                    reached += 1
            self._cond.notify_all()
            return reached

    # ---- helpers ------------------------------------------------------------------------------

    def _enter(self, function: str) -> None:
        """What every NVML call checks first. Caller holds the lock."""
        if function in self._missing:
            raise _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self._refcount == 0:
            raise _raise(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, function: str, handle: DeviceHandle) -> _Gpu:
        self._enter(function)
        try:
            address = ctypes.cast(handle, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        gpu = self._by_address.get(address or 0)
        if gpu is None:
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpu.values["lost"] is True:
            raise _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    @staticmethod
    def _read(gpu: _Gpu, *names: str) -> list[Any]:
        values = [gpu.values[name] for name in names]
        for value in values:
            if isinstance(value, FakeError):
                raise _raise(value.code)
        return values

    def _one(self, function: str, handle: DeviceHandle, name: str) -> Any:
        with self._cond:
            return self._read(self._device(function, handle), name)[0]

    # ---- NvmlApi: library ---------------------------------------------------------------------

    def nvmlInit(self) -> None:
        with self._cond:
            self.init_calls += 1
            if self._init_error is not None:
                raise _raise(self._init_error.code)
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        with self._cond:
            self._enter("nvmlShutdown")
            self._refcount -= 1
            self._cond.notify_all()

    def nvmlDeviceGetCount(self) -> int:
        with self._cond:
            self._enter("nvmlDeviceGetCount")
            return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> DeviceHandle:
        with self._cond:
            self._enter("nvmlDeviceGetHandleByIndex")
            if not 0 <= index < len(self._gpus):
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gpu = self._gpus[index]
            if gpu.values["lost"] is True:
                raise _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
            return gpu.handle

    # ---- NvmlApi: identity --------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: DeviceHandle, /) -> str:
        value: str = self._one("nvmlDeviceGetUUID", handle, "uuid")
        return value

    def nvmlDeviceGetName(self, handle: DeviceHandle, /) -> str:
        value: str = self._one("nvmlDeviceGetName", handle, "name")
        return value

    def nvmlDeviceGetPciInfo(self, handle: DeviceHandle, /) -> PciInfo:
        bus_id: str = self._one("nvmlDeviceGetPciInfo", handle, "pci_bus_id")
        domain, bus, rest = bus_id.split(":")
        info = pynvml.nvmlPciInfo_t()
        info.busId = bus_id.encode()
        info.busIdLegacy = f"{int(domain, 16):04X}:{bus}:{rest}".encode()
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        info.pciDeviceId = _H100_PCI_DEVICE_ID
        info.pciSubSystemId = _H100_PCI_SUBSYSTEM_ID
        result: PciInfo = info
        return result

    # ---- NvmlApi: load, memory, thermals, power, clocks ---------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: DeviceHandle, /) -> Utilization:
        with self._cond:
            gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
            busy, memory = self._read(gpu, "utilization_gpu", "utilization_memory")
        result: Utilization = pynvml.c_nvmlUtilization_t(gpu=busy, memory=memory)
        return result

    def nvmlDeviceGetMemoryInfo(self, handle: DeviceHandle, /) -> MemoryInfo:
        with self._cond:
            gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
            total, used = self._read(gpu, "memory_total", "memory_used")
        result: MemoryInfo = pynvml.c_nvmlMemory_t(total=total, free=max(total - used, 0), used=used)
        return result

    def nvmlDeviceGetTemperature(self, handle: DeviceHandle, sensor: int, /) -> int:
        with self._cond:
            gpu = self._device("nvmlDeviceGetTemperature", handle)
            if sensor != pynvml.NVML_TEMPERATURE_GPU:
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            value: int = self._read(gpu, "temperature")[0]
            return value

    def nvmlDeviceGetFieldValues(
        self, handle: DeviceHandle, fieldIds: Sequence[int], /
    ) -> Sequence[FieldValue]:
        with self._cond:
            gpu = self._device("nvmlDeviceGetFieldValues", handle)
            memory_temperature = gpu.values["memory_temperature"]
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = time.time_ns() // 1000
        for slot, field_id in zip(values, fieldIds, strict=True):
            slot.fieldId = field_id
            slot.timestamp = now_us
            # Per-field status, as NVML does: the call succeeds, a field it cannot read says so.
            if field_id != pynvml.NVML_FI_DEV_MEMORY_TEMP:
                slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            elif isinstance(memory_temperature, FakeError):
                slot.nvmlReturn = memory_temperature.code
            else:
                slot.nvmlReturn = pynvml.NVML_SUCCESS
                slot.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                slot.value.uiVal = memory_temperature
        result: Sequence[FieldValue] = values
        return result

    def nvmlDeviceGetPowerUsage(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetPowerUsage", handle, "power_usage")
        return value

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetEnforcedPowerLimit", handle, "power_limit")
        return value

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetTotalEnergyConsumption", handle, "energy")
        return value

    def _clock(self, function: str, handle: DeviceHandle, clock_type: int, suffix: str) -> int:
        names = {
            pynvml.NVML_CLOCK_GRAPHICS: "sm_clock",
            pynvml.NVML_CLOCK_SM: "sm_clock",
            pynvml.NVML_CLOCK_MEM: "mem_clock",
        }
        with self._cond:
            gpu = self._device(function, handle)
            name = names.get(clock_type)
            if name is None:
                raise _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            value: int = self._read(gpu, name + suffix)[0]
            return value

    def nvmlDeviceGetClockInfo(self, handle: DeviceHandle, clockType: int, /) -> int:
        return self._clock("nvmlDeviceGetClockInfo", handle, clockType, "")

    def nvmlDeviceGetMaxClockInfo(self, handle: DeviceHandle, clockType: int, /) -> int:
        return self._clock("nvmlDeviceGetMaxClockInfo", handle, clockType, "_max")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons")
        return value

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetCurrentClocksThrottleReasons", handle, "clocks_event_reasons")
        return value

    def nvmlDeviceGetPerformanceState(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetPerformanceState", handle, "performance_state")
        return value

    def nvmlDeviceGetComputeRunningProcesses(self, handle: DeviceHandle, /) -> Sequence[ProcessInfo]:
        processes: Processes = self._one("nvmlDeviceGetComputeRunningProcesses", handle, "processes")
        out: list[ProcessInfo] = []
        for pid, memory in processes:
            info = pynvml.c_nvmlProcessInfo_t()
            info.pid = pid
            info.usedGpuMemory = memory
            info.gpuInstanceId = 0xFFFFFFFF  # no MIG: NVML's "invalid instance"
            info.computeInstanceId = 0xFFFFFFFF
            out.append(info)
        return out

    # ---- NvmlApi: memory errors ---------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: DeviceHandle, errorType: int, counterType: int, /) -> int:
        kinds = {
            pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "sbe",
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "dbe",
        }
        counters = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}
        with self._cond:
            gpu = self._device("nvmlDeviceGetTotalEccErrors", handle)
            if errorType not in kinds or counterType not in counters:
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            value: int = self._read(gpu, f"ecc_{kinds[errorType]}_{counters[counterType]}")[0]
            return value

    def nvmlDeviceGetRetiredPages(self, handle: DeviceHandle, sourceFilter: int, /) -> list[int]:
        causes = {
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "retired_pages_sbe",
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "retired_pages_dbe",
        }
        with self._cond:
            gpu = self._device("nvmlDeviceGetRetiredPages", handle)
            if sourceFilter not in causes:
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            count: int = self._read(gpu, causes[sourceFilter])[0]
        # Page addresses, as pynvml returns them: one per retired page.
        return [0x1_0000_0000 + 0x1000 * (sourceFilter * 4096 + n) for n in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: DeviceHandle, /) -> int:
        pending: bool = self._one("nvmlDeviceGetRetiredPagesPendingStatus", handle, "retired_pages_pending")
        return FEATURE_ENABLED if pending else FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: DeviceHandle, /) -> tuple[int, int, int, int]:
        with self._cond:
            gpu = self._device("nvmlDeviceGetRemappedRows", handle)
            corr, unc, pending, failure = self._read(
                gpu,
                "remapped_rows_correctable",
                "remapped_rows_uncorrectable",
                "remapped_rows_pending",
                "remapped_rows_failure",
            )
        return (corr, unc, int(pending), int(failure))

    # ---- NvmlApi: PCIe ------------------------------------------------------------------------

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetCurrPcieLinkGeneration", handle, "pcie_link_gen")
        return value

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetCurrPcieLinkWidth", handle, "pcie_link_width")
        return value

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle, "pcie_link_gen_max")
        return value

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: DeviceHandle, /) -> int:
        with self._cond:
            gpu = self._device("nvmlDeviceGetMaxPcieLinkGeneration", handle)
            if gpu.values["pcie_link_gen_max_system"] is None:
                value: int = self._read(gpu, "pcie_link_gen_max")[0]
            else:
                value = self._read(gpu, "pcie_link_gen_max_system")[0]
            return value

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetMaxPcieLinkWidth", handle, "pcie_link_width_max")
        return value

    def nvmlDeviceGetPcieReplayCounter(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetPcieReplayCounter", handle, "pcie_replay")
        return value

    # ---- NvmlApi: NVLink ----------------------------------------------------------------------

    def _link(self, function: str, handle: DeviceHandle, link: int) -> dict[str, Value]:
        gpu = self._device(function, handle)
        count: int = self._read(gpu, "nvlinks")[0]
        if count == 0:
            raise _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < count:
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        values = gpu.links[link]
        active = values["active"]
        if isinstance(active, FakeError) and active.code == pynvml.NVML_ERROR_NOT_SUPPORTED:
            # A link the part does not have: NVML answers NOT_SUPPORTED to its counters too.
            raise _raise(active.code)
        return values

    def nvmlDeviceGetNvLinkState(self, handle: DeviceHandle, link: int, /) -> int:
        with self._cond:
            active = self._link("nvmlDeviceGetNvLinkState", handle, link)["active"]
            if isinstance(active, FakeError):
                raise _raise(active.code)
            return FEATURE_ENABLED if active else FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: DeviceHandle, link: int, counter: int, /) -> int:
        with self._cond:
            values = self._link("nvmlDeviceGetNvLinkErrorCounter", handle, link)
            name = _NVLINK_COUNTER_FIELDS.get(counter)
            if name is None:
                raise _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            value = values[name]
            if isinstance(value, FakeError):
                raise _raise(value.code)
            assert isinstance(value, int)
            return value

    # ---- NvmlApi: events ----------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> EventSet:
        with self._cond:
            self._enter("nvmlEventSetCreate")
            address = _EVENT_SET_BASE + 0x100 * len(self._event_sets)
            handle = ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlEventSet_t)
            self._event_sets[address] = _EventSetState(handle)
            return handle

    def _event_set(self, event_set: EventSet) -> _EventSetState:
        try:
            address = ctypes.cast(event_set, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        state = self._event_sets.get(address or 0)
        if state is None or state.freed:
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return state

    def nvmlDeviceGetSupportedEventTypes(self, handle: DeviceHandle, /) -> int:
        value: int = self._one("nvmlDeviceGetSupportedEventTypes", handle, "supported_event_types")
        return value

    def nvmlDeviceRegisterEvents(self, handle: DeviceHandle, eventTypes: int, eventSet: EventSet, /) -> None:
        with self._cond:
            gpu = self._device("nvmlDeviceRegisterEvents", handle)
            supported: int = self._read(gpu, "supported_event_types")[0]
            state = self._event_set(eventSet)
            if eventTypes & ~supported:
                raise _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            state.registered[gpu.index] = state.registered.get(gpu.index, 0) | eventTypes

    def _take_file_events(self, state: _EventSetState) -> None:
        keep: list[tuple[int, int]] = []
        for index, xid in self._file_events:
            if state.registered.get(index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                state.queue.append((index, xid))
            else:
                keep.append((index, xid))
        self._file_events = keep

    def nvmlEventSetWait_v2(self, eventSet: EventSet, timeoutms: int, /) -> EventData:
        deadline = time.monotonic() + timeoutms / 1000.0
        with self._cond:
            self._enter("nvmlEventSetWait_v2")
            state = self._event_set(eventSet)
            self._take_file_events(state)
            while not state.queue:
                # NVML's documented answer while a GPU of the set has fallen off the bus.
                if any(self._gpus[i].values["lost"] is True for i in state.registered):
                    raise _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _raise(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(remaining)
                self._enter("nvmlEventSetWait_v2")
                state = self._event_set(eventSet)
            index, xid = state.queue.popleft()
            data = pynvml.c_nvmlEventData_t()
            data.device = self._gpus[index].handle
            data.eventType = pynvml.nvmlEventTypeXidCriticalError
            data.eventData = xid
            data.gpuInstanceId = pynvml.NVML_GPU_INSTANCE_ID_ANY
            data.computeInstanceId = pynvml.NVML_GPU_INSTANCE_ID_ANY
            result: EventData = data
            return result

    def nvmlEventSetFree(self, eventSet: EventSet, /) -> None:
        with self._cond:
            self._enter("nvmlEventSetFree")
            self._event_set(eventSet).freed = True
            self._cond.notify_all()

    # ---- NvmlApi: driver and GPU Performance Monitoring ----------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        with self._cond:
            self._enter("nvmlSystemGetDriverVersion")
            return self._driver_version

    def nvmlGpmQueryDeviceSupport(self, handle: DeviceHandle, /) -> GpmSupport:
        supported: bool = self._one("nvmlGpmQueryDeviceSupport", handle, "gpm_supported")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1 if supported else 0
        result: GpmSupport = support
        return result

    def nvmlGpmSampleAlloc(self) -> GpmSample:
        with self._cond:
            self._enter("nvmlGpmSampleAlloc")
            address = _GPM_SAMPLE_BASE + 0x100 * self._gpm_next
            self._gpm_next += 1
            handle = ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)
            self._gpm_samples[address] = _GpmSampleState(handle)
            return handle

    def _gpm_sample(self, sample: GpmSample) -> _GpmSampleState:
        try:
            address = ctypes.cast(sample, ctypes.c_void_p).value
        except (ctypes.ArgumentError, TypeError):
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        state = self._gpm_samples.get(address or 0)
        if state is None:  # never allocated, or freed already
            raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return state

    def nvmlGpmSampleFree(self, gpmSample: GpmSample, /) -> None:
        with self._cond:
            self._enter("nvmlGpmSampleFree")
            self._gpm_sample(gpmSample)
            del self._gpm_samples[ctypes.cast(gpmSample, ctypes.c_void_p).value or 0]

    def nvmlGpmSampleGet(self, handle: DeviceHandle, gpmSample: GpmSample, /) -> GpmSample:
        with self._cond:
            gpu = self._device("nvmlGpmSampleGet", handle)
            state = self._gpm_sample(gpmSample)
            if self._read(gpu, "gpm_supported")[0] is not True:
                raise _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            state.gpu = gpu.index
            state.values = {metric: gpu.values[name] for metric, name in _GPM_FIELDS.items()}
            return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: GpmMetricsGet, /) -> GpmMetricsGet:
        with self._cond:
            self._enter("nvmlGpmMetricsGet")
            if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
                raise _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            first, second = self._gpm_sample(metricsGet.sample1), self._gpm_sample(metricsGet.sample2)
            if first.gpu is None or first.gpu != second.gpu or first is second:
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
                raise _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            for n in range(metricsGet.numMetrics):
                slot = metricsGet.metrics[n]
                value = second.values.get(slot.metricId)
                if value is None:
                    slot.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                elif isinstance(value, FakeError):
                    slot.nvmlReturn = value.code
                else:
                    assert isinstance(value, int)
                    slot.nvmlReturn = pynvml.NVML_SUCCESS
                    slot.value = float(value)
            return metricsGet
