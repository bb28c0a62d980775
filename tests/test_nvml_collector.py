"""The NVML collector against the fake NVML: units, nulls, partial failures, lost GPUs, no driver."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pynvml
import pytest
from msgspec import UNSET

from agent.clock import FakeClock
from agent.collectors.base import Collected, CollectorContext, Problem
from agent.collectors.nvml import NvmlCollector
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession
from agent.report import SCHEMA_ID, Gpu, Report, encode, json_schema
from agent.runner import Agent

FIXTURES = Path(__file__).parent / "fixtures" / "gpus"


def problems(collected: Collected) -> list[Problem]:
    """The NVML collector's errors: every one carries a code."""
    out = [e for e in collected.errors if isinstance(e, Problem)]
    assert len(out) == len(collected.errors), collected.errors
    return out


def collector_for(fake: FakeNvml, clock: FakeClock | None = None) -> NvmlCollector:
    return NvmlCollector(CollectorContext(nvml=NvmlSession(fake, clock or FakeClock(), retry_seconds=60.0)))


def validate(collected: Collected) -> dict[str, Any]:
    """The GPUs as they go on the wire, checked against the published schema."""
    report = Report(
        schema=SCHEMA_ID,
        node="gpu-0001",
        time=1_764_441_600.0,
        seq=0,
        boot_id="b0",
        gpus=list(collected.gpus),
        nics=[],
    )
    wire: dict[str, Any] = json.loads(encode(report))
    jsonschema.validate(wire, json_schema())
    return wire


def by_index(collected: Collected) -> dict[int, Gpu]:
    return {g.index: g for g in collected.gpus}


def test_unsupported_without_a_backend() -> None:
    collector = NvmlCollector(CollectorContext(nvml=None))
    support = collector.supported()
    assert not support.supported and "--gpu-backend none" in support.reason


def test_every_field_in_schema_units() -> None:
    fake = FakeNvml.from_dict(
        {
            "gpus": {
                "2": {
                    "utilization_gpu": 57,
                    "power_usage": 412_345,
                    "energy": 9_876_543_210,
                    "sm_clock": 1755,
                    "ecc_sbe_volatile": 11,
                    "ecc_dbe_volatile": 1,
                    "ecc_sbe_aggregate": 31,
                    "ecc_dbe_aggregate": 3,
                    "remapped_rows_correctable": 4,
                    "remapped_rows_uncorrectable": 2,
                    "remapped_rows_pending": True,
                    "remapped_rows_failure": True,
                    "retired_pages_sbe": 5,
                    "retired_pages_dbe": 2,
                    "retired_pages_pending": True,
                    "clocks_event_reasons": 0x44,
                    "performance_state": 2,
                    "pcie_link_gen": 4,
                    "pcie_link_width": 8,
                    "pcie_replay": 77,
                    "nvlink": {
                        "5": {"active": False, "crc_flit": 6, "crc_data": 7, "replay": 8, "recovery": 9}
                    },
                }
            }
        }
    )
    collected = collector_for(fake).collect()
    assert collected.errors == ()
    wire = validate(collected)
    assert [g["index"] for g in wire["gpus"]] == list(range(8))
    g = by_index(collected)[2]

    def v(name: str) -> Any:
        return fake.value(2, name)

    assert (
        g.uuid == v("uuid") and g.model == v("name") and g.pci_bus_id == v("pci_bus_id") == "00000000:3A:00.0"
    )
    assert g.utilization_ratio == pytest.approx(0.57)
    assert g.memory_used_bytes == v("memory_used") and g.memory_total_bytes == v("memory_total")
    assert g.temperature_celsius == float(v("temperature"))
    assert g.memory_temperature_celsius == float(v("memory_temperature"))
    assert g.power_watts == pytest.approx(412.345)
    assert g.power_limit_watts == pytest.approx(700.0)
    assert g.energy_joules_total == pytest.approx(9_876_543.210)
    assert g.sm_clock_hz == pytest.approx(1755e6)
    assert g.sm_clock_max_hz == pytest.approx(1980e6)
    assert g.memory_clock_hz == pytest.approx(2619e6)
    assert g.clock_event_reasons == 0x44
    assert g.performance_state == 2
    assert (g.ecc_sbe_volatile_total, g.ecc_dbe_volatile_total) == (11, 1)
    assert (g.ecc_sbe_aggregate_total, g.ecc_dbe_aggregate_total) == (31, 3)
    assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (5, 2, True)
    assert (g.remapped_rows_correctable, g.remapped_rows_uncorrectable) == (4, 2)
    assert (g.remapped_rows_pending, g.remapped_rows_failure) == (True, True)
    assert (g.pcie_link_gen, g.pcie_link_gen_max, g.pcie_link_width, g.pcie_link_width_max) == (4, 5, 8, 16)
    assert g.pcie_replay_total == 77
    assert g.nvlink is not UNSET and len(g.nvlink) == 18
    link5 = g.nvlink[5]
    assert (link5.link, link5.active) == (5, False)
    assert (link5.crc_flit_errors_total, link5.crc_data_errors_total) == (6, 7)
    assert (link5.replay_errors_total, link5.recovery_errors_total) == (8, 9)
    assert all(link.active for link in g.nvlink if link.link != 5)

    # A healthy neighbour: H100 has no retired pages (it remaps rows), so those are null.
    h = wire["gpus"][3]
    assert h["retired_pages_sbe"] is None and h["retired_pages_pending"] is None
    assert h["remapped_rows_pending"] is False and h["ecc_dbe_volatile_total"] == 0


def test_not_supported_is_null_and_not_an_error() -> None:
    unsupported = {"error": "NOT_SUPPORTED"}
    fake = FakeNvml.from_dict(
        {
            "gpus": {
                "1": {
                    "temperature": unsupported,
                    "memory_temperature": unsupported,
                    "energy": unsupported,
                    "pcie_replay": unsupported,
                    "utilization_gpu": unsupported,
                    "nvlinks": 0,
                }
            }
        }
    )
    collected = collector_for(fake).collect()
    assert collected.errors == ()
    wire = validate(collected)
    g = wire["gpus"][1]
    for name in (
        "temperature_celsius",
        "memory_temperature_celsius",
        "energy_joules_total",
        "pcie_replay_total",
        "utilization_ratio",
    ):
        assert name in g and g[name] is None, name
    # No NVLink at all: the schema has no null for the list, so it is left out.
    assert "nvlink" not in g
    power_mw = fake.value(1, "power_usage")
    assert isinstance(power_mw, int) and g["power_watts"] == pytest.approx(power_mw / 1000)


def test_one_failing_call_keeps_the_rest_of_the_gpu() -> None:
    fake = FakeNvml.from_dict(
        {
            "gpus": {
                "4": {
                    "power_usage": {"error": "UNKNOWN"},
                    "ecc_dbe_volatile": {"error": "NO_PERMISSION"},
                    "nvlink": {"2": {"crc_flit": {"error": "UNKNOWN"}}},
                }
            }
        }
    )
    collected = collector_for(fake).collect()
    validate(collected)
    g = by_index(collected)[4]
    assert g.power_watts is None and g.ecc_dbe_volatile_total is None
    assert g.power_limit_watts == pytest.approx(700.0)
    assert g.ecc_sbe_volatile_total == 0
    assert g.nvlink is not UNSET and g.nvlink[2].crc_flit_errors_total is None
    assert g.nvlink[2].crc_data_errors_total == 0
    assert len(collected.errors) == 1
    ((error, code, gpu),) = [(e.message, e.code, e.gpu) for e in problems(collected)]
    assert (code, gpu) == ("unreadable", 4)
    assert error.startswith(f"GPU 4 ({fake.value(4, 'uuid')}, 00000000:9A:00.0): 3 unreadable:")
    assert "power: Unknown Error" in error and "ECC DBE volatile: Insufficient Permissions" in error
    assert "nvlink 2 crc flit" in error


def test_lost_gpu_is_left_out_with_an_error_naming_it_and_the_others_go_out() -> None:
    fake = FakeNvml.from_dict({})
    collector = collector_for(fake)
    assert len(collector.collect().gpus) == 8
    fake.update(5, {"lost": True})
    collected = collector.collect()
    validate(collected)
    assert sorted(by_index(collected)) == [0, 1, 2, 3, 4, 6, 7]
    # The words for a human, the code and the index for the aggregator's rules and scheduler.
    assert collected.errors == (
        Problem(f"GPU 5 ({fake.value(5, 'uuid')}, 00000000:AB:00.0): GPU is lost", "gpu_lost", 5),
    )
    # Still lost next cycle: still said.
    assert collector.collect().errors == collected.errors


def test_gpu_lost_before_the_first_cycle() -> None:
    collected = collector_for(FakeNvml.from_file(FIXTURES / "gpu_lost.json")).collect()
    validate(collected)
    assert sorted(by_index(collected)) == [0, 1, 2, 3, 4, 6, 7]  # GPU 5 out, the other seven in
    assert collected.errors == (Problem("GPU 5: GPU is lost", "gpu_lost", 5),)


def test_gpu_lost_in_the_middle_of_a_read() -> None:
    fake = FakeNvml.from_dict({})
    collector = collector_for(fake)
    collector.collect()
    # GPU_IS_LOST from one call (here the PCIe replay counter) loses the whole GPU, not one field.
    fake.update(1, {"pcie_replay": {"error": "GPU_IS_LOST"}})
    collected = collector.collect()
    assert sorted(by_index(collected)) == [0, 2, 3, 4, 5, 6, 7]  # GPU 1 out, the other seven in
    (lost,) = problems(collected)
    assert lost.message.endswith("GPU is lost") and (lost.code, lost.gpu) == ("gpu_lost", 1)


def test_init_failure_reports_an_error_and_retries_on_the_clock() -> None:
    fake = FakeNvml.from_file(FIXTURES / "driver_not_loaded.json")
    clock = FakeClock()
    collector = collector_for(fake, clock)
    assert collector.supported().supported
    first = collector.collect()
    assert first.gpus == () and first.errors == (
        Problem("NVML init failed: Driver Not Loaded", "init_failed"),
    )
    clock.advance(30)
    assert collector.collect().errors == first.errors
    assert fake.init_calls == 1  # not retried every cycle
    fake.set_init_error(None)
    clock.advance(31)
    recovered = collector.collect()
    assert fake.init_calls == 2
    assert recovered.errors == () and len(recovered.gpus) == 8
    validate(recovered)


def test_old_driver_falls_back_and_reports_what_it_can() -> None:
    fake = FakeNvml.from_file(FIXTURES / "old_driver_pcie_card.json")
    collected = collector_for(fake).collect()
    assert collected.errors == ()
    wire = validate(collected)
    g = wire["gpus"][0]
    assert g["model"] == "NVIDIA A10"
    assert g["clock_event_reasons"] == pynvml.nvmlClocksEventReasonGpuIdle  # from the throttle-reasons call
    assert g["pcie_link_gen_max"] == 4  # from nvmlDeviceGetMaxPcieLinkGeneration
    assert g["memory_temperature_celsius"] is None and g["energy_joules_total"] is None
    assert g["remapped_rows_correctable"] is None and g["retired_pages_dbe"] == 0
    assert "nvlink" not in g


def test_max_pcie_generation_is_what_the_gpu_can_reach_in_its_slot() -> None:
    # A Gen5 GPU in a Gen4 host at Gen4 runs as fast as that host allows: not a downtrained link.
    fake = FakeNvml.from_dict({"gpus": {"0": {"pcie_link_gen_max_system": 4, "pcie_link_gen": 4}}})
    g = by_index(collector_for(fake).collect())[0]
    assert (g.pcie_link_gen, g.pcie_link_gen_max) == (4, 4)
    # One trained below it is.
    fake = FakeNvml.from_dict({"gpus": {"0": {"pcie_link_gen_max_system": 5, "pcie_link_gen": 3}}})
    g = by_index(collector_for(fake).collect())[0]
    assert (g.pcie_link_gen, g.pcie_link_gen_max) == (3, 5)


class CountingNvml(FakeNvml):
    """Counts calls by name, to see what the collector reads once and what every cycle."""

    def __init__(self, description: dict[str, object]) -> None:
        super().__init__(description)
        self.calls: dict[str, int] = {}

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("nvmlDevice") and callable(attr):
            calls: dict[str, int] = super().__getattribute__("calls")

            def counted(*args: Any, _fn: Callable[..., Any] = attr, _name: str = name) -> Any:
                calls[_name] = calls.get(_name, 0) + 1
                return _fn(*args)

            return counted
        return attr


def test_static_fields_are_read_once_and_the_power_limit_every_cycle() -> None:
    fake = CountingNvml({})
    collector = collector_for(fake)
    collector.collect()
    fake.update(0, {"power_limit": 350_000, "uuid": "GPU-changed"})
    g = by_index(collector.collect())[0]
    assert fake.calls["nvmlDeviceGetUUID"] == 8
    assert fake.calls["nvmlDeviceGetPciInfo"] == 8
    assert fake.calls["nvmlDeviceGetMaxClockInfo"] == 8
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == 16
    assert g.power_limit_watts == pytest.approx(350.0)
    assert g.uuid != "GPU-changed"


def test_static_fields_that_failed_are_read_again() -> None:
    fake = FakeNvml.from_dict({"gpus": {"0": {"name": {"error": "UNKNOWN"}}}})
    collector = collector_for(fake)
    first = by_index(collector.collect())[0]
    assert first.model is None and first.uuid == fake.value(0, "uuid")
    fake.update(0, {"name": "NVIDIA H100 80GB HBM3"})
    second = collector.collect()
    assert by_index(second)[0].model == "NVIDIA H100 80GB HBM3" and second.errors == ()


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.name)
def test_every_fixture_makes_a_valid_report(path: Path) -> None:
    validate(collector_for(FakeNvml.from_file(path)).collect())


def test_faults_in_fixtures_are_visible() -> None:
    ecc = by_index(collector_for(FakeNvml.from_file(FIXTURES / "ecc_dbe_row_remap.json")).collect())[2]
    assert ecc.ecc_dbe_volatile_total == 2 and ecc.remapped_rows_pending is True
    links = by_index(collector_for(FakeNvml.from_file(FIXTURES / "nvlink_errors.json")).collect())
    assert links[1].nvlink is not UNSET and links[1].nvlink[7].crc_flit_errors_total == 48211
    assert links[6].nvlink is not UNSET and [link.link for link in links[6].nvlink if not link.active] == [
        3,
        4,
    ]
    pcie = by_index(collector_for(FakeNvml.from_file(FIXTURES / "pcie_degraded.json")).collect())[4]
    assert (pcie.pcie_link_gen, pcie.pcie_link_width, pcie.pcie_replay_total) == (3, 8, 5821)
    hot = by_index(collector_for(FakeNvml.from_file(FIXTURES / "thermal_throttle.json")).collect())
    assert hot[0].temperature_celsius == 91.0 and hot[0].clock_event_reasons == 104
    assert hot[3].utilization_ratio == 1.0 and hot[3].power_watts == pytest.approx(688.0)


def test_long_error_lists_fit_the_schema() -> None:
    fake = FakeNvml.from_dict(
        {
            "gpus": {
                "0": {
                    "nvlink": {
                        "*": {n: {"error": "UNKNOWN"} for n in ("crc_flit", "crc_data", "replay", "recovery")}
                    }
                }
            }
        }
    )
    collected = collector_for(fake).collect()
    (problem,) = problems(collected)
    assert len(problem.message) <= 1024 and problem.message.endswith("...")


def test_a_lost_gpu_goes_on_the_wire_with_its_code_and_index() -> None:
    fake = FakeNvml.from_dict({})
    fake.update(5, {"lost": True})
    agent = Agent(node="gpu-0001", collectors=[collector_for(fake)], clock=FakeClock(), boot_id="b0")
    wire: dict[str, Any] = json.loads(encode(agent.cycle().report))
    jsonschema.validate(wire, json_schema())
    (error,) = wire["errors"]
    assert (error["collector"], error["code"], error["gpu"]) == ("nvml", "gpu_lost", 5)
    assert error["message"] == "GPU 5: GPU is lost"  # the words stay, for a human


# --- GPU Performance Monitoring --------------------------------------------------------------------


def test_gpm_fields_come_from_two_samples_in_report_units_and_samples_are_freed() -> None:
    busy = {
        "utilization_memory": 44,
        "gpm_gr_engine_active": 95,
        "gpm_sm_active": 87,
        "gpm_sm_occupancy": 41,
        "gpm_tensor_active": 63,
        "gpm_dram_active": 72,
        "gpm_pcie_tx": 1024,
        "gpm_pcie_rx": 2048,
        "gpm_nvlink_tx": 150_000,
        "gpm_nvlink_rx": 149_000,
    }
    fake = FakeNvml.from_dict({"count": 2, "gpus": {"1": busy}, "driver_version": "550.90.07"})
    collector = collector_for(fake)
    # The first cycle has no earlier sample: GPM fields are null, without an error.
    first = collector.collect()
    assert first.errors == ()
    assert all(g.tensor_active_ratio is None and g.pcie_tx_bytes_per_second is None for g in first.gpus)
    assert {g.driver_version for g in first.gpus} == {"550.90.07"}
    assert fake.open_gpm_samples == 2  # one kept per GPU

    second = collector.collect()
    assert second.errors == ()
    validate(second)
    g = by_index(second)[1]
    assert g.memory_utilization_ratio == pytest.approx(0.44)
    assert g.gr_engine_active_ratio == pytest.approx(0.95)
    assert g.sm_active_ratio == pytest.approx(0.87)
    assert g.sm_occupancy_ratio == pytest.approx(0.41)
    assert g.tensor_active_ratio == pytest.approx(0.63)
    assert g.dram_active_ratio == pytest.approx(0.72)
    assert g.pcie_tx_bytes_per_second == 1024 * 2**20 and g.pcie_rx_bytes_per_second == 2048 * 2**20
    assert g.nvlink_tx_bytes_per_second == 150_000 * 2**20
    assert g.nvlink_rx_bytes_per_second == 149_000 * 2**20
    idle = by_index(second)[0]
    assert idle.tensor_active_ratio == 0.0 and idle.pcie_rx_bytes_per_second == 25 * 2**20
    for _ in range(5):
        collector.collect()
    assert fake.open_gpm_samples == 2  # bounded: the previous sample is freed each cycle

    # A lost GPU's sample is freed; close frees the rest.
    fake.update(1, {"lost": True})
    collector.collect()
    assert fake.open_gpm_samples == 1
    collector.close()
    assert fake.open_gpm_samples == 0


def test_gpm_is_null_and_silent_where_the_gpu_has_none() -> None:
    # Pre-Hopper (the A10 fixture), a driver without the calls, and one metric NVML refuses.
    for description in (
        json.loads((FIXTURES / "old_driver_pcie_card.json").read_text()),
        {"count": 1, "missing_functions": ["nvmlGpmQueryDeviceSupport"]},
    ):
        fake = FakeNvml.from_dict(description)
        collector = collector_for(fake)
        collector.collect()
        collected = collector.collect()
        assert problems(collected) == [], description
        assert all(g.sm_active_ratio is None and g.nvlink_tx_bytes_per_second is None for g in collected.gpus)
        assert fake.open_gpm_samples == 0
    fake = FakeNvml.from_dict({"count": 1, "all": {"gpm_nvlink_tx": {"error": "NOT_SUPPORTED"}}})
    collector = collector_for(fake)
    collector.collect()
    [g] = collector.collect().gpus
    assert g.nvlink_tx_bytes_per_second is None and g.nvlink_rx_bytes_per_second == 0.0


def test_a_failing_gpm_sample_is_an_error_and_frees_what_it_took() -> None:
    fake = FakeNvml.from_dict({"count": 1})
    collector = collector_for(fake)
    collector.collect()
    fake.update(0, {"gpm_tensor_active": {"error": "UNKNOWN"}})
    collected = collector.collect()
    [problem] = problems(collected)
    assert problem.code == "unreadable" and "GPM metric" in problem.message
    assert fake.open_gpm_samples == 1


def test_a_gpu_nvml_no_longer_counts_is_named_as_lost_every_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    c = collector_for(FakeNvml())
    first = c.collect()
    assert len(first.gpus) == 8 and not problems(first)
    # NVML came back from a driver reload counting seven: GPU 7 is gone, not just absent.
    monkeypatch.setattr(NvmlSession, "device_count", property(lambda self: 7))
    for _ in range(2):
        out = c.collect()
        assert [g.index for g in out.gpus] == list(range(7))
        (p,) = problems(out)
        assert (p.code, p.gpu) == ("gpu_lost", 7)
        assert p.message.startswith("vanished: GPU 7 (") and first.gpus[7].uuid in p.message


# --- What the audit against a pynvml double found --------------------------------------------------


def test_a_uuid_that_cannot_be_read_is_the_one_read_earlier_else_unknown() -> None:
    # GPUs 2 and 5 never answer their UUID: both are reported, with "" (unknown), never a guess.
    fake = FakeNvml.from_dict(
        {"gpus": {"2": {"uuid": {"error": "UNKNOWN"}}, "5": {"uuid": {"error": "UNKNOWN"}}}}
    )
    collected = collector_for(fake).collect()
    validate(collected)
    assert {i: g.uuid for i, g in by_index(collected).items() if not g.uuid} == {2: "", 5: ""}
    assert [(p.code, p.gpu) for p in problems(collected)] == [("unreadable", 2), ("unreadable", 5)]

    # GPU 1's UUID was read once (its name was not, so nothing was kept as static), then NVML
    # stops answering it: the UUID read earlier at that index and bus id is the one reported.
    fake = FakeNvml.from_dict({"gpus": {"1": {"name": {"error": "UNKNOWN"}}}})
    collector = collector_for(fake)
    uuid = by_index(collector.collect())[1].uuid
    assert uuid == fake.value(1, "uuid")
    fake.update(1, {"uuid": {"error": "RESET_REQUIRED"}, "name": {"error": "UNKNOWN"}})
    collected = collector.collect()
    assert 1 not in by_index(collected)  # RESET_REQUIRED: see the next test
    fake.update(1, {"uuid": {"error": "UNKNOWN"}})
    collected = collector.collect()
    assert by_index(collected)[1].uuid == uuid
    (problem,) = problems(collected)
    assert problem.gpu == 1 and "uuid: Unknown Error" in problem.message and uuid in problem.message


def test_reset_required_leaves_the_gpu_out_with_its_code_and_stops_reading_it() -> None:
    fake = CountingNvml({"count": 2})
    collector = collector_for(fake)
    uuid = by_index(collector.collect())[1].uuid
    fake.calls.clear()
    # After a fatal error NVML answers RESET_REQUIRED to the GPU's calls, here from the first
    # call of the cycle (utilization) on.
    fake.update(
        1, {"utilization_gpu": {"error": "RESET_REQUIRED"}, "temperature": {"error": "RESET_REQUIRED"}}
    )
    collected = collector.collect()
    validate(collected)
    assert sorted(by_index(collected)) == [0]
    assert collected.errors == (
        Problem(
            f"GPU 1 ({uuid}, 00000000:2A:00.0): GPU requires a reset (NVML_ERROR_RESET_REQUIRED)",
            "reset_required",
            1,
        ),
    )
    # Nothing after the first such answer was asked of GPU 1: GPU 0 alone made these calls.
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 2
    assert fake.calls["nvmlDeviceGetTemperature"] == fake.calls["nvmlDeviceGetPowerUsage"] == 1
    # Reset: it is read again.
    fake.update(1, {"utilization_gpu": 0, "temperature": 40})
    collected = collector.collect()
    assert sorted(by_index(collected)) == [0, 1] and collected.errors == ()


def test_reset_required_from_the_start_makes_the_report_acceptable() -> None:
    # Every GPU of the node needs a reset (an NVSwitch fatal error): no GPU is sent with an empty
    # UUID (eight of those were refused as one UUID eight times); each is named by its code.
    fake = FakeNvml.from_dict({"all": {"uuid": {"error": "RESET_REQUIRED"}}})
    collected = collector_for(fake).collect()
    assert collected.gpus == ()
    assert [(p.code, p.gpu) for p in problems(collected)] == [("reset_required", i) for i in range(8)]


def test_an_unknown_performance_state_is_null() -> None:
    fake = FakeNvml.from_dict({"count": 2, "gpus": {"1": {"performance_state": 32}}})  # NVML_PSTATE_UNKNOWN
    gpus = by_index(collector_for(fake).collect())
    assert gpus[1].performance_state is None and gpus[0].performance_state == 0


def test_the_driver_version_is_read_once_per_cycle_and_its_failure_is_one_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeNvml.from_dict({"count": 4})
    calls = 0

    def failing() -> str:
        nonlocal calls
        calls += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlSystemGetDriverVersion", failing)
    collector = collector_for(fake)
    collected = collector.collect()
    assert len(collected.gpus) == 4 and all(g.driver_version is None for g in collected.gpus)
    assert collected.errors == (Problem("driver version unreadable: Unknown Error", "unreadable"),)
    assert calls == 1
    monkeypatch.undo()
    collected = collector.collect()
    assert collected.errors == () and {g.driver_version for g in collected.gpus} == {"550.90.07"}


def test_a_link_without_nvlink_among_links_with_it_is_skipped_not_the_end() -> None:
    # A part with links 3 and 4 floor-swept: NVML answers NOT_SUPPORTED for them, and the
    # links after them are still there; past the last link it answers INVALID_ARGUMENT.
    missing = {"active": {"error": "NOT_SUPPORTED"}}
    fake = FakeNvml.from_dict(
        {"count": 1, "gpus": {"0": {"nvlink": {"3": missing, "4": missing, "9": {"replay": 5}}}}}
    )
    collector = collector_for(fake)
    collected = collector.collect()
    assert collected.errors == ()
    validate(collected)
    [g] = collected.gpus
    assert g.nvlink is not UNSET
    assert [link.link for link in g.nvlink] == [0, 1, 2, *range(5, 18)]
    assert next(link for link in g.nvlink if link.link == 9).replay_errors_total == 5


def test_a_gpu_without_nvlink_reports_none_and_stops_asking() -> None:
    fake = CountingNvml({"count": 1, "gpus": {"0": {"nvlinks": 0}}})
    collector = collector_for(fake)
    [g] = collector.collect().gpus
    assert g.nvlink is UNSET
    for _ in range(3):
        fake.calls.clear()
        [g] = collector.collect().gpus
        assert g.nvlink is UNSET and "nvmlDeviceGetNvLinkState" not in fake.calls
    # A GPU with NVLink asks only for its own links from then on, none past them.
    fake = CountingNvml({"count": 1, "gpus": {"0": {"nvlinks": 12}}})
    collector = collector_for(fake)
    collector.collect()
    fake.calls.clear()
    [g] = collector.collect().gpus
    assert g.nvlink is not UNSET and len(g.nvlink) == 12
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 12
