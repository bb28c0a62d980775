"""The fake NVML answers like pynvml: same structures, same exception classes, same call shapes."""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path

import pynvml
import pytest

from agent.clock import FakeClock
from agent.errors import ConfigError
from agent.gpu import open_backend
from agent.gpu.api import API_FUNCTIONS, FieldValue, field_value, gpm_metrics_request, handle_key
from agent.gpu.fake import FakeError, FakeNvml
from agent.gpu.session import NvmlSession

FIXTURES = Path(__file__).parent / "fixtures" / "gpus"


def started(description: dict[str, object] | None = None) -> FakeNvml:
    fake = FakeNvml.from_dict(description or {})
    fake.nvmlInit()
    return fake


# ---- the boundary matches the real library -----------------------------------------------------


def test_every_api_function_exists_in_pynvml_and_in_the_fake() -> None:
    assert len(API_FUNCTIONS) >= 36
    for name in sorted(API_FUNCTIONS):
        assert callable(getattr(pynvml, name, None)), f"pynvml has no {name}"
        assert callable(getattr(FakeNvml, name, None)), f"FakeNvml has no {name}"


def test_healthy_h100_defaults() -> None:
    fake = started()
    assert fake.nvmlDeviceGetCount() == 8
    uuids = set()
    for index in range(8):
        h = fake.nvmlDeviceGetHandleByIndex(index)
        assert isinstance(h, pynvml.c_nvmlDevice_t)
        uuids.add(fake.nvmlDeviceGetUUID(h))
        assert fake.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
        assert fake.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
        assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
        assert fake.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
        assert 35 <= fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) <= 45
        assert 40_000 <= fake.nvmlDeviceGetPowerUsage(h) <= 100_000
        memory = fake.nvmlDeviceGetMemoryInfo(h)
        assert isinstance(memory, pynvml.c_nvmlMemory_t)
        assert 79 * 2**30 < memory.total <= 80 * 2**30
        assert memory.free == memory.total - memory.used
        assert fake.nvmlDeviceGetCurrPcieLinkGeneration(h) == 5
        assert fake.nvmlDeviceGetCurrPcieLinkWidth(h) == 16
        assert fake.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
        assert [fake.nvmlDeviceGetNvLinkState(h, link) for link in range(18)] == [1] * 18
        assert fake.nvmlDeviceGetSupportedEventTypes(h) & pynvml.nvmlEventTypeXidCriticalError
    assert len(uuids) == 8
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)


def test_structures_are_pynvmls_own() -> None:
    fake = started()
    h = fake.nvmlDeviceGetHandleByIndex(2)
    pci = fake.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:3A:00.0"
    assert (pci.domain, pci.bus, pci.device) == (0, 0x3A, 0)
    util = fake.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t)
    values = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP])
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t)
    assert values[0].nvmlReturn == pynvml.NVML_SUCCESS
    assert field_value(values[0]) == fake.value(2, "memory_temperature")


def test_seed_changes_uuids() -> None:
    a = started({"seed": "node-a"})
    b = started({"seed": "node-b"})
    assert a.nvmlDeviceGetUUID(a.nvmlDeviceGetHandleByIndex(0)) != b.nvmlDeviceGetUUID(
        b.nvmlDeviceGetHandleByIndex(0)
    )


# ---- errors are pynvml's exception classes ------------------------------------------------------


def test_calls_before_init_raise_uninitialized() -> None:
    fake = FakeNvml.from_dict({})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetHandleByIndex(0)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("DRIVER_NOT_LOADED", pynvml.NVMLError_DriverNotLoaded),
        ("LIBRARY_NOT_FOUND", pynvml.NVMLError_LibraryNotFound),
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", pynvml.NVMLError_LibRmVersionMismatch),
    ],
)
def test_init_error(name: str, cls: type[Exception]) -> None:
    fake = FakeNvml.from_dict({"init_error": name})
    with pytest.raises(cls) as info:
        fake.nvmlInit()
    assert isinstance(info.value, pynvml.NVMLError)
    assert not fake.initialized
    fake.set_init_error(None)
    fake.nvmlInit()
    assert fake.initialized and fake.init_calls == 2


def test_field_error_raises_that_class_and_leaves_other_fields() -> None:
    fake = started(
        {"gpus": {"3": {"temperature": {"error": "NOT_SUPPORTED"}, "power_usage": {"error": "UNKNOWN"}}}}
    )
    h = fake.nvmlDeviceGetHandleByIndex(3)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_Unknown):
        fake.nvmlDeviceGetPowerUsage(h)
    assert fake.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    other = fake.nvmlDeviceGetHandleByIndex(4)
    assert fake.nvmlDeviceGetTemperature(other, pynvml.NVML_TEMPERATURE_GPU) == fake.value(4, "temperature")


def test_lost_gpu_raises_gpu_is_lost_on_every_call() -> None:
    fake = started()
    h = fake.nvmlDeviceGetHandleByIndex(5)
    fake.update(5, {"lost": True})
    for call in (
        lambda: fake.nvmlDeviceGetUUID(h),
        lambda: fake.nvmlDeviceGetMemoryInfo(h),
        lambda: fake.nvmlDeviceGetNvLinkState(h, 0),
        lambda: fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP]),
        lambda: fake.nvmlDeviceGetHandleByIndex(5),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(4))


def test_memory_temperature_error_is_per_field_like_nvml() -> None:
    fake = started({"all": {"memory_temperature": {"error": "NOT_SUPPORTED"}}})
    h = fake.nvmlDeviceGetHandleByIndex(0)
    values = fake.nvmlDeviceGetFieldValues(
        h, [pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_MEMORY_TEMP]
    )
    assert len(values) == 2
    assert values[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_missing_functions_raise_function_not_found() -> None:
    fake = started({"missing_functions": ["nvmlDeviceGetCurrentClocksEventReasons"]})
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert fake.nvmlDeviceGetCurrentClocksThrottleReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle


def test_foreign_handle_is_invalid_argument() -> None:
    fake = started()
    stranger = ctypes.cast(ctypes.c_void_p(0x1234), pynvml.c_nvmlDevice_t)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetUUID(stranger)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)


# ---- memory errors, PCIe and NVLink -------------------------------------------------------------


def test_retired_pages_not_supported_on_h100_and_countable_when_set() -> None:
    fake = started(
        {"gpus": {"1": {"retired_pages_sbe": 3, "retired_pages_dbe": 1, "retired_pages_pending": True}}}
    )
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetRetiredPages(h0, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    h1 = fake.nvmlDeviceGetHandleByIndex(1)
    sbe = fake.nvmlDeviceGetRetiredPages(h1, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = fake.nvmlDeviceGetRetiredPages(h1, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert len(sbe) == 3 and len(dbe) == 1 and not set(sbe) & set(dbe)
    assert fake.nvmlDeviceGetRetiredPagesPendingStatus(h1) == pynvml.NVML_FEATURE_ENABLED


def test_ecc_counters_by_type_and_counter() -> None:
    fake = started({"gpus": {"0": {"ecc_sbe_volatile": 1, "ecc_dbe_volatile": 2, "ecc_sbe_aggregate": 3}}})
    h = fake.nvmlDeviceGetHandleByIndex(0)
    got = {
        (e, c): fake.nvmlDeviceGetTotalEccErrors(h, e, c)
        for e in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        for c in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)
    }
    assert got == {(0, 0): 1, (1, 0): 2, (0, 1): 3, (1, 1): 0}


def test_pcie_gpu_max_and_system_max() -> None:
    fake = started({"gpus": {"0": {"pcie_link_gen_max_system": 4}, "1": {"pcie_link_gen_max": 4}}})
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetGpuMaxPcieLinkGeneration(h0) == 5
    assert fake.nvmlDeviceGetMaxPcieLinkGeneration(h0) == 4
    # Without a separate slot limit, the system maximum follows the GPU's.
    assert fake.nvmlDeviceGetMaxPcieLinkGeneration(h1) == 4


def test_nvlink_links_and_past_the_last_link() -> None:
    fake = started({"gpus": {"0": {"nvlink": {"7": {"crc_flit": 12, "active": False}}}, "1": {"nvlinks": 0}}})
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetNvLinkState(h0, 7) == pynvml.NVML_FEATURE_DISABLED
    assert fake.nvmlDeviceGetNvLinkErrorCounter(h0, 7, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT) == 12
    assert fake.nvmlDeviceGetNvLinkErrorCounter(h0, 6, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT) == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(h0, 18)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetNvLinkState(fake.nvmlDeviceGetHandleByIndex(1), 0)


def test_a_link_the_part_does_not_have_is_not_supported_among_links_it_has() -> None:
    # A floor-swept part: link 3 is missing, the links around it and past it are there.
    fake = started({"gpus": {"0": {"nvlink": {"3": {"active": {"error": "NOT_SUPPORTED"}}}}}})
    h = fake.nvmlDeviceGetHandleByIndex(0)
    for call in (
        lambda: fake.nvmlDeviceGetNvLinkState(h, 3),
        lambda: fake.nvmlDeviceGetNvLinkErrorCounter(h, 3, pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert fake.nvmlDeviceGetNvLinkState(h, 4) == fake.nvmlDeviceGetNvLinkState(h, 17) == 1


def test_nvlink_star_sets_every_link() -> None:
    fake = started({"all": {"nvlinks": 4, "nvlink": {"*": {"replay": 2}}}})
    h = fake.nvmlDeviceGetHandleByIndex(6)
    assert [
        fake.nvmlDeviceGetNvLinkErrorCounter(h, n, pynvml.NVML_NVLINK_ERROR_DL_REPLAY) for n in range(4)
    ] == [2] * 4
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetNvLinkState(h, 4)


# ---- events -------------------------------------------------------------------------------------


def test_event_wait_times_out_with_timeout_error() -> None:
    fake = started()
    event_set = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(
        fake.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, event_set
    )
    start = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 30)
    assert 0.025 <= time.monotonic() - start < 1.0


def test_injected_xid_arrives_with_its_device() -> None:
    fake = started()
    event_set = fake.nvmlEventSetCreate()
    h3 = fake.nvmlDeviceGetHandleByIndex(3)
    fake.nvmlDeviceRegisterEvents(h3, pynvml.nvmlEventTypeXidCriticalError, event_set)
    assert fake.inject_xid(3, 79) == 1
    assert fake.inject_xid(4, 13) == 0  # not registered: NVML does not keep it
    data = fake.nvmlEventSetWait_v2(event_set, 1000)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    assert handle_key(data.device) == handle_key(h3)
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 10)


def test_file_events_are_delivered_once_at_first_wait() -> None:
    fake = started({"events": [{"gpu": 1, "xid": 48}, {"gpu": 2, "xid": 63}]})
    event_set = fake.nvmlEventSetCreate()
    for index in range(8):
        h = fake.nvmlDeviceGetHandleByIndex(index)
        fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    got = [fake.nvmlEventSetWait_v2(event_set, 100).eventData for _ in range(2)]
    assert got == [48, 63]
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(event_set, 10)


def test_register_unsupported_event_types_and_freed_set() -> None:
    fake = started({"gpus": {"0": {"supported_event_types": 0}}})
    event_set = fake.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceRegisterEvents(
            fake.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlEventTypeXidCriticalError, event_set
        )
    fake.nvmlEventSetFree(event_set)
    assert fake.open_event_sets == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlEventSetWait_v2(event_set, 10)


def test_wait_on_a_set_with_a_lost_gpu_says_gpu_is_lost_after_pending_events() -> None:
    fake = started()
    event_set = fake.nvmlEventSetCreate()
    for index in (0, 1):
        fake.nvmlDeviceRegisterEvents(
            fake.nvmlDeviceGetHandleByIndex(index), pynvml.nvmlEventTypeXidCriticalError, event_set
        )
    fake.inject_xid(0, 79)
    fake.update(0, {"lost": True})
    assert fake.nvmlEventSetWait_v2(event_set, 100).eventData == 79
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlEventSetWait_v2(event_set, 100)


# ---- the description file -----------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.name)
def test_every_fixture_loads(path: Path) -> None:
    fake = FakeNvml.from_file(path)
    assert fake.count == json.loads(path.read_text()).get("count", 8)


@pytest.mark.parametrize(
    ("description", "fragment"),
    [
        ({"gpus": {"0": {"temprature": 40}}}, "gpus.0.temprature: unknown field"),
        ({"gpus": {"0": {"temperature": "hot"}}}, "gpus.0.temperature: expected an integer"),
        ({"gpus": {"0": {"temperature": True}}}, "gpus.0.temperature: expected an integer"),
        ({"gpus": {"0": {"lost": 1}}}, "gpus.0.lost: expected true or false"),
        ({"gpus": {"0": {"power_usage": -5}}}, "out of range"),
        ({"gpus": {"0": {"utilization_gpu": 101}}}, "out of range"),
        ({"gpus": {"0": {"power_usage": {"error": "BROKEN"}}}}, "unknown NVML error 'BROKEN'"),
        ({"gpus": {"8": {}}}, "'8' is not an index below 8"),
        ({"gpus": {"0": {"nvlink": {"18": {"active": False}}}}}, "'18' is not an index below 18"),
        ({"gpus": {"0": {"nvlink": {"1": {"crc": 1}}}}}, "nvlink.1.crc: unknown field"),
        ({"gpus": {"0": {"pci_bus_id": "nowhere"}}}, "not a PCI bus id"),
        ({"count": 65}, "count: expected an integer 0..64"),
        ({"cuont": 8}, "unknown key(s) ['cuont']"),
        ({"init_error": "SOMETIMES"}, "init_error: unknown NVML error"),
        ({"missing_functions": ["nvmlDeviceGetFoo"]}, "['nvmlDeviceGetFoo'] are not NvmlApi functions"),
        ({"events": [{"gpu": 9, "xid": 79}]}, "events[0]: gpu must be below 8"),
        ({"events": [{"gpu": 1}]}, "events[0]: expected"),
    ],
)
def test_bad_descriptions_name_the_field(description: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        FakeNvml.from_dict(description, source="node.json")
    assert "node.json" in str(info.value)
    assert fragment in str(info.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fake GPU file .*missing\.json"):
        FakeNvml.from_file(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"count": 8,')
    with pytest.raises(ConfigError, match="not JSON"):
        FakeNvml.from_file(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected an object"):
        FakeNvml.from_file(listed)


def test_pci_bus_id_is_stored_in_nvml_spelling() -> None:
    fake = started({"gpus": {"0": {"pci_bus_id": "0000:3b:00.0"}}})
    assert fake.nvmlDeviceGetPciInfo(fake.nvmlDeviceGetHandleByIndex(0)).busId == "00000000:3B:00.0"


def test_update_and_value() -> None:
    fake = started()
    fake.update(2, {"ecc_dbe_volatile": 7, "temperature": {"error": "NOT_SUPPORTED"}})
    assert fake.value(2, "ecc_dbe_volatile") == 7
    assert fake.value(2, "temperature") == FakeError("NOT_SUPPORTED")
    with pytest.raises(ConfigError, match="unknown field"):
        fake.update(2, {"ecc_dbe_volatile": 9, "nope": 1})
    assert fake.value(2, "ecc_dbe_volatile") == 7  # a bad update changes nothing


# ---- field values and the backend spec ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value_type", "member", "raw", "expected"),
    [
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 41.5, 41.5),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 41, 41),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 2**40, 2**40),
        (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -3, -3),
        (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -7, -7),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 9, 9),
    ],
)
def test_field_value_reads_the_member_its_type_names(
    value_type: int, member: str, raw: float, expected: float
) -> None:
    fv = pynvml.c_nvmlFieldValue_t()
    fv.valueType = value_type
    setattr(fv.value, member, raw)
    typed: FieldValue = fv
    assert field_value(typed) == expected


def test_open_backend_specs(tmp_path: Path) -> None:
    clock = FakeClock()
    assert open_backend("none", clock) is None
    real = open_backend("nvml", clock)
    assert isinstance(real, NvmlSession) and real.api is pynvml and not real.initialized
    fake = open_backend(f"fake:{FIXTURES / 'h100x8.json'}", clock)
    assert isinstance(fake, NvmlSession) and isinstance(fake.api, FakeNvml)
    assert fake.ensure_init() and fake.device_count == 8
    for bad in ("cuda", "nvml:x", "none:", "fake:", ""):
        with pytest.raises(ConfigError, match="--gpu-backend"):
            open_backend(bad, clock)
    with pytest.raises(ConfigError, match="fake GPU file"):
        open_backend(f"fake:{tmp_path / 'absent.json'}", clock)


# ---- GPU Performance Monitoring -----------------------------------------------------------------


def test_gpm_samples_behave_as_nvml_s() -> None:
    fake = FakeNvml.from_dict({"count": 2, "gpus": {"1": {"gpm_supported": False}}})
    fake.nvmlInit()
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlGpmQueryDeviceSupport(h0).isSupportedDevice == 1
    assert fake.nvmlGpmQueryDeviceSupport(h1).isSupportedDevice == 0  # pre-Hopper
    a, b, c = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    assert isinstance(a, pynvml.c_nvmlGpmSample_t) and fake.open_gpm_samples == 3
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlGpmSampleGet(h1, c)
    fake.nvmlGpmSampleGet(h0, a)
    fake.update(0, {"gpm_tensor_active": 40})
    fake.nvmlGpmSampleGet(h0, b)
    ids = [pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, pynvml.NVML_GPM_METRIC_FP64_UTIL]
    got = fake.nvmlGpmMetricsGet(gpm_metrics_request(a, b, ids))
    assert (got.metrics[0].nvmlReturn, got.metrics[0].value) == (pynvml.NVML_SUCCESS, 40.0)
    assert got.metrics[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # a metric it has no field for
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # the second sample was never filled
        fake.nvmlGpmMetricsGet(gpm_metrics_request(a, c, ids))
    for sample in (a, b, c):
        fake.nvmlGpmSampleFree(sample)
    assert fake.open_gpm_samples == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # freed twice
        fake.nvmlGpmSampleFree(a)
    assert fake.nvmlSystemGetDriverVersion() == "550.90.07"
