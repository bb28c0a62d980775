"""The XID collector: kernel lines, NVML events, each XID reported exactly once."""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import jsonschema
import msgspec
import pytest

from agent.clock import FakeClock
from agent.collectors.base import CollectorContext, Paths, RawXid, Support, XidEventSource
from agent.collectors.nvml import NvmlCollector
from agent.collectors.xid import KernelXid, XidCollector, parse_kernel_line
from agent.gpu.events import NvmlXidSource
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession
from agent.report import SCHEMA_ID, Event, Report, encode, json_schema

FIXTURES = Path(__file__).parent / "fixtures" / "kmsg"
BTIME = 1764441000.0  # fixtures/kmsg/proc/stat
START = 1_764_441_600.0  # FakeClock's default start: 600 s after boot
SUPPORTED = Support(True)
BUS_IDS = {"0000:3b:00": 3, "0000:b7:00": 5, "0019:01:00": 0, "0000:61:00": 1, "0000:08:00": 2}


class FakeXidSource:
    """An XidEventSource whose events the test hands in."""

    def __init__(
        self,
        bus_ids: Mapping[str, int] | None = None,
        *,
        support: Support = SUPPORTED,
        start_error: Exception | None = None,
    ) -> None:
        self.bus_ids = dict(bus_ids or {})
        self.support = support
        self.start_error = start_error
        self.queue: list[RawXid] = []
        self.drain_error: Exception | None = None
        self.started = 0
        self.closed = 0

    def supported(self) -> Support:
        return self.support

    def start(self) -> None:
        self.started += 1
        if self.start_error is not None:
            raise self.start_error

    def drain(self) -> list[RawXid]:
        if self.drain_error is not None:
            raise self.drain_error
        out, self.queue = self.queue, []
        return out

    def pci_bus_ids(self) -> Mapping[str, int]:
        return dict(self.bus_ids)

    def close(self) -> None:
        self.closed += 1


def _source(*, support: Support = SUPPORTED, start_error: Exception | None = None) -> FakeXidSource:
    return FakeXidSource(BUS_IDS, support=support, start_error=start_error)


def _ctx(
    kmsg: Path, clock: FakeClock, source: XidEventSource | None, procfs: Path = FIXTURES / "proc"
) -> CollectorContext:
    return CollectorContext(paths=Paths(procfs=procfs, kmsg=kmsg), clock=clock, xid_source=source)


def _rec(seq: int, seconds: float, text: str, prio: int = 3) -> str:
    return f"{prio},{seq},{round(seconds * 1e6)},-;{text}\n"


def _append(path: Path, *records: str) -> None:
    with path.open("a") as f:
        f.write("".join(records))


def _xid_line(code: int, bus: str = "0000:3b:00", tail: str = "pid=1234, GPU has fallen off the bus.") -> str:
    return f"NVRM: Xid (PCI:{bus}): {code}, {tail}"


def _short(events: tuple[Event, ...] | list[Event]) -> list[tuple[str, float, int | None, int | None]]:
    return [(e.kind, round(e.time, 6), e.gpu, e.code) for e in events]


@pytest.fixture
def empty_kmsg(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    path.write_text("")
    return path


@pytest.fixture
def boot_kmsg(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    shutil.copy(FIXTURES / "boot.kmsg", path)
    return path


# --- parsing kernel lines ------------------------------------------------------------------------


def test_parse_xid_with_pid() -> None:
    x = parse_kernel_line("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.")
    assert x == KernelXid(
        "xid", 79, "0000:3b:00", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
    )


def test_parse_xid_with_unknown_pid_and_other_domain() -> None:
    x = parse_kernel_line(
        "NVRM: Xid (PCI:0000:B7:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
        "error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0."
    )
    assert x is not None and (x.kind, x.code, x.pci_bus_id) == ("xid", 48, "0000:b7:00")
    y = parse_kernel_line(
        "NVRM: Xid (PCI:0019:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000)"
    )
    assert y is not None and (y.code, y.pci_bus_id) == (149, "0019:01:00")


def test_parse_xid_without_details_or_pid() -> None:
    x = parse_kernel_line("NVRM: Xid (PCI:0000:01:00): 79")
    assert x is not None and (x.code, x.pci_bus_id) == (79, "0000:01:00")
    z = parse_kernel_line("NVRM: Xid (PCI:0000:34:00): 45, Ch 00000010")
    assert z is not None and z.code == 45


@pytest.mark.parametrize(
    ("message", "code", "bus"),
    [
        # A GPU in MIG mode: the driver names the GPU instance (NVIDIA's A100 memory error
        # management guide quotes this line), and the compute instance where it knows it.
        (
            "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). "
            "RST: No, D-RST: No",
            94,
            "0000:01:00",
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 13, pid=9, name=a, Graphics Exception",
            13,
            "0000:3b:00",
        ),
    ],
)
def test_parse_mig_xid_as_the_gpu_s(message: str, code: int, bus: str) -> None:
    x = parse_kernel_line(message)
    assert x == KernelXid("xid", code, bus, message)


def test_a_mig_xid_goes_out_with_its_gpu(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    collector = XidCollector(_ctx(empty_kmsg, clock, _source(support=Support(False, "no events"))))
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605.0, "NVRM: Xid (PCI:0000:b7:00 GPU-I:05): 94, pid=7194, Contained: x"))
    assert _short(collector.collect().events) == [("xid", START + 5.0, 5, 94)]


def test_parse_sxid_first_line_and_follow_ups() -> None:
    first = parse_kernel_line(
        "nvidia-nvswitch3: SXid (PCI:0000:85:00.0): 12028, Non-fatal, "
        "Link 62 egress non-posted PRIV error (First)"
    )
    assert first is not None
    assert (first.kind, first.code, first.pci_bus_id, first.device, first.detail) == (
        "sxid",
        12028,
        "0000:85:00",
        "nvidia-nvswitch3",
        None,
    )
    fatal = parse_kernel_line(
        "nvidia-nvswitch0: SXid (PCI:0000:00:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
    )
    assert fatal is not None and fatal.detail is None
    follow = parse_kernel_line(
        "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, "
        "Severity 0 Engine instance 46 Sub-engine instance 00"
    )
    assert follow is not None and follow.detail == "Severity 0 Engine instance 46 Sub-engine instance 00"


@pytest.mark.parametrize(
    "message",
    [
        "NVRM: GPU at PCI:0000:3b:00: GPU-c43f0536-e751-7211-d7a7-78c95249ee7d",
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE",
        "Out of memory: Killed process 4242 (NVRM: Xid (PCI:) total-vm:1024kB",
        "nvidia-uvm: reported NVRM: Xid (PCI:0000:3b:00): 31",
        "nvrm: xid (PCI:0000:3b:00): 79",
        "NVRM: Xid (PCI:0000:3b:00): seventy-nine",
        "",
    ],
)
def test_parse_ignores_other_lines(message: str) -> None:
    assert parse_kernel_line(message) is None


# --- the start-up backlog, times and GPU indexes -------------------------------------------------


def test_backlog_recent_events_with_gpu_index_and_unix_time(boot_kmsg: Path) -> None:
    source = _source(support=Support(False, "NVML events not supported on this GPU"))
    collector = XidCollector(_ctx(boot_kmsg, FakeClock(START), source))
    assert collector.supported() == Support(True)
    out = collector.collect()
    assert _short(out.events) == [
        ("xid", BTIME + 400.0002, 3, 79),
        ("xid", BTIME + 410.123456, 5, 48),
        ("xid", BTIME + 410.1235, 5, 63),
        ("xid", BTIME + 450.0, 1, 119),
        ("sxid", BTIME + 500.25, None, 28006),
        ("xid", BTIME + 520.0, 0, 149),
        ("xid", BTIME + 550.0, 2, 31),
        ("sxid", BTIME + 590.0, None, 12028),
    ]
    # Not there: Xid 13 from 480 s before start (history), the Xid written from userspace, the
    # OOM line quoting "NVRM: Xid", and lines that are not XIDs.
    sxid = out.events[4]
    assert sxid.message == (
        "nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 MC TS crumbstore MCTO (First)"
        " | Severity 0 Engine instance 46 Sub-engine instance 00"
        " | Data {0x00140004, 0x00100000, 0x00140004, 0x00000000, "
        "0x00000000, 0x00000000, 0x00000000, 0x00000000}"
    )
    assert out.errors == ("kernel log: 1 malformed records skipped",)
    assert collector.collect().events == ()


def test_without_a_source_gpu_is_unknown_and_bus_id_stays_in_message(boot_kmsg: Path) -> None:
    collector = XidCollector(_ctx(boot_kmsg, FakeClock(START), None))
    first = collector.collect().events[0]
    assert (first.gpu, first.code) == (None, 79)
    assert first.message is not None and "PCI:0000:3b:00" in first.message


def test_bus_id_not_in_map_keeps_gpu_unknown(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    collector = XidCollector(_ctx(empty_kmsg, clock, _source(support=Support(False, "no events"))))
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605, _xid_line(79, bus="0000:99:00")))
    (event,) = collector.collect().events
    assert event.gpu is None and event.message is not None and "0000:99:00" in event.message


def test_lookback_window_is_configurable(boot_kmsg: Path) -> None:
    collector = XidCollector(_ctx(boot_kmsg, FakeClock(START), None), lookback_seconds=30)
    assert [e.code for e in collector.collect().events] == [12028]  # only the one at 590 s


def test_times_follow_btime_read_each_round(empty_kmsg: Path, tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (procfs / "stat").write_text(f"cpu  1 2 3\nbtime {int(BTIME)}\n")
    clock = FakeClock(START)
    collector = XidCollector(_ctx(empty_kmsg, clock, None, procfs=procfs))
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 601.5, _xid_line(79)))
    assert _short(collector.collect().events) == [("xid", BTIME + 601.5, None, 79)]
    # An NTP step after start moves btime: later records convert with the new one.
    (procfs / "stat").write_text(f"cpu  1 2 3\nbtime {int(BTIME) + 2}\n")
    clock.advance(10)
    _append(empty_kmsg, _rec(1, 610.0, _xid_line(79)))
    assert _short(collector.collect().events) == [("xid", BTIME + 612.0, None, 79)]


def test_live_record_with_a_lagging_printk_stamp_is_reported_at_a_possible_time(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    collector = XidCollector(_ctx(empty_kmsg, clock, None))
    clock.advance(10)
    # Logged after the last read, yet stamped 200 s earlier: the printk clock lags the wall clock.
    _append(empty_kmsg, _rec(0, 400.0, _xid_line(79)))
    (event,) = collector.collect().events
    assert event.time == START  # clamped to the earliest moment it can have been logged


def test_without_boot_time_backlog_is_held_back_and_live_times_are_read_times(
    boot_kmsg: Path, tmp_path: Path
) -> None:
    clock = FakeClock(START)
    collector = XidCollector(_ctx(boot_kmsg, clock, None, procfs=tmp_path))
    first = collector.collect()
    assert first.events == ()
    assert any("boot time unavailable" in e and "11 XID/SXID lines" in e for e in first.errors)
    clock.advance(10)
    _append(boot_kmsg, _rec(23, 605, _xid_line(79)))
    second = collector.collect()
    assert _short(second.events) == [("xid", START + 10, None, 79)]
    assert any("event times are when the agent read them" in e for e in second.errors)


def test_overwritten_records_are_reported(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    collector = XidCollector(_ctx(empty_kmsg, clock, None))
    _append(empty_kmsg, _rec(0, 601, _xid_line(79)), _rec(5, 602, _xid_line(48, bus="0000:b7:00")))
    out = collector.collect()
    assert [e.code for e in out.events] == [79, 48]
    assert out.errors == (
        "kernel log: 4 records were overwritten before they could be read; XIDs among them are lost",
    )


# --- exactly once, NVML and the kernel log together ----------------------------------------------


def test_each_event_exactly_once_over_rounds_with_a_growing_log(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    assert source.started == 1
    seen: list[Event] = []

    # Round 1: Xid 79 on GPU 3 in both sources; an SXid only in the kernel log.
    clock.advance(10)
    _append(
        empty_kmsg,
        _rec(0, 604.0, _xid_line(79)),
        _rec(1, 604.5, "nvidia-nvswitch0: SXid (PCI:0000:85:00.0): 12028, Non-fatal, Link 62 egress error"),
    )
    source.queue.append(RawXid(gpu=3, code=79, time=START + 4.01))
    out = collector.collect()
    seen += out.events
    assert _short(out.events) == [("xid", START + 4.01, 3, 79), ("sxid", START + 4.5, None, 12028)]
    assert out.events[0].message == _xid_line(79)  # NVML's time, the kernel's words

    # Round 2: only NVML (a GPU without a kernel line); the kernel log grows with a non-XID.
    clock.advance(10)
    _append(empty_kmsg, _rec(2, 612.0, "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE"))
    source.queue.append(RawXid(gpu=5, code=48, time=START + 12.0, message="from NVML"))
    out = collector.collect()
    seen += out.events
    assert _short(out.events) == [("xid", START + 12.0, 5, 48)]

    # Round 3: a kernel-only Xid 119 is held for NVML; released in round 4.
    clock.advance(10)
    _append(
        empty_kmsg, _rec(3, 625.0, _xid_line(119, bus="0000:61:00", tail="Timeout waiting for RPC from GSP!"))
    )
    assert collector.collect().events == ()
    clock.advance(10)
    out = collector.collect()
    seen += out.events
    assert _short(out.events) == [("xid", START + 25.0, 1, 119)]

    # Nothing more, however many rounds.
    for _ in range(3):
        clock.advance(10)
        assert collector.collect().events == ()
    assert [e.code for e in seen] == [79, 12028, 48, 119]


def test_kernel_line_first_nvml_event_next_round_is_one_event(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 609.9, _xid_line(79)))
    assert collector.collect().events == ()  # held: its NVML twin may still be on its way
    source.queue.append(RawXid(gpu=3, code=79, time=START + 10.05))
    clock.advance(10)
    out = collector.collect()
    assert _short(out.events) == [("xid", START + 10.05, 3, 79)]
    assert out.events[0].message == _xid_line(79)
    clock.advance(10)
    assert collector.collect().events == ()


def test_nvml_event_first_kernel_line_next_round_is_one_event(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    clock.advance(10)
    source.queue.append(RawXid(gpu=3, code=79, time=START + 9.99, message="nvml"))
    out = collector.collect()
    assert _short(out.events) == [("xid", START + 9.99, 3, 79)]
    assert out.events[0].message == "nvml"
    # The driver's line was logged after this round's read of the kernel log.
    _append(empty_kmsg, _rec(0, 610.0, _xid_line(79)))
    clock.advance(10)
    assert collector.collect().events == ()
    clock.advance(10)
    assert collector.collect().events == ()


def test_twins_match_despite_a_drifted_printk_clock(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    clock.advance(30)
    # Stamped four minutes early by a printk clock that drifted over a long uptime.
    _append(empty_kmsg, _rec(0, 385.0, _xid_line(79)))
    source.queue.append(RawXid(gpu=3, code=79, time=START + 25.0))
    assert _short(collector.collect().events) == [("xid", START + 25.0, 3, 79)]
    clock.advance(30)
    assert collector.collect().events == ()


def test_repeated_xids_pair_one_to_one(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    clock.advance(10)
    # Three Xid 13 in one burst, NVML saw two of them.
    _append(
        empty_kmsg,
        *(_rec(i, 605.0 + i * 0.1, _xid_line(13, tail=f"Graphics Exception {i}")) for i in range(3)),
    )
    source.queue += [RawXid(gpu=3, code=13, time=START + 5.0), RawXid(gpu=3, code=13, time=START + 5.1)]
    first = collector.collect()
    assert [(e.code, e.message) for e in first.events] == [
        (13, _xid_line(13, tail="Graphics Exception 0")),
        (13, _xid_line(13, tail="Graphics Exception 1")),
    ]
    clock.advance(10)
    second = collector.collect()
    assert [(e.code, e.gpu, e.message) for e in second.events] == [
        (13, 3, _xid_line(13, tail="Graphics Exception 2"))
    ]


def test_different_gpu_or_code_is_not_a_twin(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605.0, _xid_line(79)), _rec(1, 605.0, _xid_line(48, bus="0000:b7:00")))
    source.queue += [RawXid(gpu=5, code=79, time=START + 5.0), RawXid(gpu=3, code=48, time=START + 5.0)]
    events = list(collector.collect().events)
    clock.advance(10)
    events += collector.collect().events
    assert sorted((e.gpu, e.code) for e in events) == [(3, 48), (3, 79), (5, 48), (5, 79)]


def test_held_line_waits_out_the_window_when_rounds_are_short(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source), window_seconds=5.0)
    clock.advance(1)
    _append(empty_kmsg, _rec(0, 600.5, _xid_line(79)))
    assert collector.collect().events == ()
    for _ in range(3):  # rounds one second apart: still inside the window
        clock.advance(1)
        assert collector.collect().events == ()
    source.queue.append(RawXid(gpu=3, code=79, time=START + 0.6))  # a slow NVML thread
    clock.advance(1)
    assert _short(collector.collect().events) == [("xid", START + 0.6, 3, 79)]


def test_held_line_waits_for_one_more_drain_even_without_a_window(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, clock, source), window_seconds=0.0)
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 610.0, _xid_line(79)))
    # NVML's event for it reaches the queue only after this round's drain.
    assert collector.collect().events == ()
    source.queue.append(RawXid(gpu=3, code=79, time=START + 10.0))
    clock.advance(10)
    assert _short(collector.collect().events) == [("xid", START + 10.0, 3, 79)]


def test_nvml_unsupported_kernel_xids_go_out_at_once(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source(support=Support(False, "NVML events not supported"))
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    assert source.started == 0
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605.0, _xid_line(79)))
    assert _short(collector.collect().events) == [("xid", START + 5.0, 3, 79)]


def test_start_failure_falls_back_to_the_kernel_log(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source(start_error=RuntimeError("nvmlEventSetCreate failed"))
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    assert collector.supported() == Support(True)
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605.0, _xid_line(79)))
    assert [e.code for e in collector.collect().events] == [79]


def test_nvml_events_start_once_nvml_comes_up_after_the_agent(tmp_path: Path) -> None:
    # The GPU operator loads the driver after the agent's DaemonSet pod started: nvmlInit fails at
    # first, the NVML collector picks the GPUs up at its next retry, and XID events follow it.
    clock = FakeClock(START)
    fake = FakeNvml.from_dict({"count": 2, "init_error": "DRIVER_NOT_LOADED"})
    session = NvmlSession(fake, clock, retry_seconds=60.0)
    source = NvmlXidSource(session, wait_timeout_ms=20)
    ctx = CollectorContext(paths=Paths(procfs=FIXTURES / "proc", kmsg=tmp_path / "missing"), clock=clock)
    ctx.nvml, ctx.xid_source = session, source
    xid, gpus = XidCollector(ctx), NvmlCollector(ctx)
    try:
        support = xid.supported()
        assert not support.supported and support.transient and "Driver Not Loaded" in support.reason
        fake.set_init_error(None)
        clock.advance(30)
        assert not xid.supported().supported and fake.init_calls == 1  # nvmlInit paced by the session
        clock.advance(31)
        assert len(gpus.collect().gpus) == 2
        assert xid.supported() == Support(True)
        assert fake.inject_xid(1, 79) == 1
        events: list[Event] = []
        for _ in range(500):
            events.extend(xid.collect().events)
            if events:
                break
            time.sleep(0.01)
        assert [(e.gpu, e.code) for e in events] == [(1, 79)]
        assert fake.init_calls == 2
    finally:
        xid.close()
        session.close()
    assert fake.open_event_sets == 0


def test_a_source_that_is_unsupported_for_good_is_not_asked_again(empty_kmsg: Path) -> None:
    source = _source(support=Support(False, "no GPU supports NVML XID events"))
    collector = XidCollector(_ctx(empty_kmsg, FakeClock(START), source))
    source.support = SUPPORTED
    collector.supported()
    collector.collect()
    assert source.started == 0
    # One that may come up later (NVML not initialized yet) is, every cycle (the runner asks
    # ``supported`` before each ``collect``).
    source = _source(support=Support(False, "NVML init failed: Driver Not Loaded", transient=True))
    collector = XidCollector(_ctx(empty_kmsg, FakeClock(START), source))
    collector.supported()
    assert source.started == 0
    source.support = SUPPORTED
    collector.supported()
    collector.collect()
    collector.supported()
    assert source.started == 1


def test_drain_failure_is_an_error_and_kernel_events_still_go_out(empty_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source(support=Support(True))
    collector = XidCollector(_ctx(empty_kmsg, clock, source))
    source.drain_error = RuntimeError("event thread died")
    clock.advance(10)
    _append(empty_kmsg, _rec(0, 605.0, _xid_line(79)))
    first = collector.collect()
    assert first.errors == ("NVML XID events: RuntimeError: event thread died",)
    clock.advance(10)
    assert [e.code for e in collector.collect().events] == [79]


def test_nvml_only_when_the_kernel_log_is_unreadable(tmp_path: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(tmp_path / "missing", clock, source))
    assert collector.supported() == Support(True)
    source.queue.append(RawXid(gpu=-1, code=79, time=float("nan"), message="odd"))
    source.queue.append(RawXid(gpu=2, code=31, time=START - 1))
    out = collector.collect()
    assert _short(out.events) == [("xid", START - 1, 2, 31), ("xid", START, None, 79)]


# --- supported(), close() ------------------------------------------------------------------------


def test_unsupported_without_either_source(tmp_path: Path) -> None:
    collector = XidCollector(_ctx(tmp_path / "kmsg", FakeClock(START), None))
    support = collector.supported()
    assert not support.supported
    assert support.reason == (
        f"no kernel log ({tmp_path / 'kmsg'} is not readable: No such file or directory) "
        "and NVML events unsupported (no NVML event source)"
    )


def test_unsupported_names_both_reasons(tmp_path: Path) -> None:
    source = _source(support=Support(False, "driver too old for events"))
    collector = XidCollector(_ctx(Path("/dev/null"), FakeClock(START), source))
    reason = collector.supported().reason
    assert "not the kernel log (1:11)" in reason and "driver too old for events" in reason


def test_close_closes_reader_and_source(empty_kmsg: Path) -> None:
    source = _source()
    collector = XidCollector(_ctx(empty_kmsg, FakeClock(START), source))
    collector.close()
    collector.close()
    assert source.closed == 1


# --- bounds and the schema -----------------------------------------------------------------------


def test_storm_is_bounded_and_the_rare_code_survives(tmp_path: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(tmp_path / "missing", clock, source))
    source.queue += [RawXid(gpu=2, code=13, time=START + i * 0.001) for i in range(1500)]
    source.queue.append(RawXid(gpu=4, code=79, time=START + 1.4995))
    out = collector.collect()
    assert len(out.events) == 1024
    assert [e.time for e in out.events] == sorted(e.time for e in out.events)
    assert (4, 79) in [(e.gpu, e.code) for e in out.events]
    assert out.errors == (
        "477 events dropped over the bound of 1024 per report (the first of each kind, GPU and code kept): "
        "xid 13 gpu 2 x477",
    )
    assert collector.collect().events == ()


def test_events_validate_against_the_published_schema(boot_kmsg: Path) -> None:
    clock = FakeClock(START)
    source = _source()
    collector = XidCollector(_ctx(boot_kmsg, clock, source))
    clock.advance(10)
    _append(boot_kmsg, _rec(23, 605.0, _xid_line(13, tail="x" * 5000)))
    source.queue.append(RawXid(gpu=1, code=94, time=START + 5, message="y" * 3000))
    events = list(collector.collect().events)
    clock.advance(10)
    events += collector.collect().events
    assert {e.kind for e in events} == {"xid", "sxid"}
    assert max(len(e.message or "") for e in events) == 2048
    report = Report(
        schema=SCHEMA_ID,
        node="gpu-0042",
        time=clock.time(),
        seq=0,
        boot_id="b",
        gpus=[],
        nics=[],
        events=events,
    )
    document = msgspec.json.decode(encode(report))
    jsonschema.validate(document, json_schema())
    assert len(document["events"]) == len(events) == 10
