"""XIDs from NVML's event API: delivered once each, none lost, and the thread stops on close."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.collectors.base import RawXid, XidEventSource
from agent.gpu.events import NvmlXidSource
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession

FIXTURES = Path(__file__).parent / "fixtures" / "gpus"


def source_for(
    fake: FakeNvml, clock: FakeClock | None = None, *, max_queued: int = 4096
) -> tuple[NvmlXidSource, NvmlSession]:
    session = NvmlSession(fake, clock or FakeClock())
    return NvmlXidSource(session, wait_timeout_ms=20, max_queued=max_queued), session


@pytest.fixture
def running() -> Iterator[tuple[FakeNvml, NvmlXidSource, FakeClock]]:
    fake = FakeNvml.from_dict({})
    clock = FakeClock()
    source, session = source_for(fake, clock)
    source.start()
    yield fake, source, clock
    source.close()
    session.close()


def drain_until(source: NvmlXidSource, count: int, timeout: float = 5.0) -> list[RawXid]:
    got: list[RawXid] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got.extend(source.drain())
        time.sleep(0.005)
    return got


def test_is_an_xid_event_source() -> None:
    source: XidEventSource = source_for(FakeNvml.from_dict({}))[0]
    assert source.supported().supported


def test_injected_xids_arrive_once_each_with_gpu_and_time(
    running: tuple[FakeNvml, NvmlXidSource, FakeClock],
) -> None:
    fake, source, clock = running
    fake.inject_xid(3, 79)
    fake.inject_xid(0, 13)
    got = drain_until(source, 2)
    assert sorted((x.gpu, x.code) for x in got) == [(0, 13), (3, 79)]
    assert all(x.time == clock.time() for x in got)
    clock.advance(10)
    fake.inject_xid(7, 94)
    later = drain_until(source, 1)
    assert [(x.gpu, x.code, x.time) for x in later] == [(7, 94, clock.time())]
    time.sleep(0.05)
    assert source.drain() == []


def test_many_xids_none_lost(running: tuple[FakeNvml, NvmlXidSource, FakeClock]) -> None:
    fake, source, _ = running
    sent = [(n % 8, 31 + n % 50) for n in range(600)]

    def storm() -> None:
        for gpu, code in sent:
            fake.inject_xid(gpu, code)

    threads = [threading.Thread(target=storm) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = drain_until(source, 2 * len(sent))
    assert sorted((x.gpu, x.code) for x in got) == sorted(sent * 2)


def test_events_in_the_file_are_delivered_once() -> None:
    fake = FakeNvml.from_file(FIXTURES / "ecc_dbe_row_remap.json")
    source, session = source_for(fake)
    source.start()
    try:
        got = drain_until(source, 2)
        assert [(x.gpu, x.code) for x in got] == [(2, 48), (2, 63)]
        time.sleep(0.05)
        assert source.drain() == []
    finally:
        source.close()
        session.close()


def test_close_stops_the_thread_promptly_and_frees_the_set() -> None:
    fake = FakeNvml.from_dict({})
    session = NvmlSession(fake, FakeClock())
    source = NvmlXidSource(session)  # the default wait timeout the agent runs with
    before = set(threading.enumerate())
    source.start()
    assert fake.open_event_sets == 1
    threads = [t for t in threading.enumerate() if t not in before]
    assert len(threads) == 1 and threads[0].daemon
    start = time.monotonic()
    source.close()
    assert time.monotonic() - start < 1.0
    assert not threads[0].is_alive()
    assert fake.open_event_sets == 0
    source.close()  # twice is harmless
    session.close()
    assert not fake.initialized


def test_lost_gpu_does_not_stop_the_other_gpus_xids(
    running: tuple[FakeNvml, NvmlXidSource, FakeClock],
) -> None:
    fake, source, _ = running
    fake.inject_xid(5, 79)
    fake.update(5, {"lost": True})
    assert [(x.gpu, x.code) for x in drain_until(source, 1)] == [(5, 79)]
    time.sleep(0.05)  # the wait now answers GPU_IS_LOST; the thread backs off and keeps going
    fake.inject_xid(2, 119)
    assert [(x.gpu, x.code) for x in drain_until(source, 1)] == [(2, 119)]


def test_a_full_queue_keeps_the_newest() -> None:
    fake = FakeNvml.from_dict({})
    source, session = source_for(fake, max_queued=10)
    source.start()
    try:
        for code in range(25):
            fake.inject_xid(1, code)
        deadline = time.monotonic() + 5
        while fake.queued_events and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the last one handed out reaches the source's queue
        assert [x.code for x in source.drain()] == list(range(15, 25))
    finally:
        source.close()
        session.close()


def test_pci_bus_ids_are_normalized() -> None:
    source, _ = source_for(FakeNvml.from_dict({"count": 2, "gpus": {"1": {"pci_bus_id": "0001:3B:00.0"}}}))
    assert dict(source.pci_bus_ids()) == {"0000:18:00": 0, "0001:3b:00": 1}


def test_unsupported_when_init_fails() -> None:
    fake = FakeNvml.from_file(FIXTURES / "driver_not_loaded.json")
    source, _ = source_for(fake)
    support = source.supported()
    assert not support.supported and support.reason == "NVML init failed: Driver Not Loaded"
    assert support.transient  # the driver may be loaded later: the XID collector asks again
    source.start()  # a no-op, not an exception
    assert source.drain() == [] and fake.open_event_sets == 0
    assert dict(source.pci_bus_ids()) == {}
    source.close()


def test_unsupported_when_no_gpu_supports_xid_events() -> None:
    fake = FakeNvml.from_dict({"all": {"supported_event_types": 0}})
    source, _ = source_for(fake)
    support = source.supported()
    assert not support.supported and "no GPU supports" in support.reason
    source.start()
    assert fake.open_event_sets == 0
    # The PCI map is still there for the kernel-log XID reader.
    assert len(source.pci_bus_ids()) == 8


def test_registers_only_gpus_that_support_xids() -> None:
    fake = FakeNvml.from_dict({"gpus": {"6": {"supported_event_types": 0}}})
    source, session = source_for(fake)
    source.start()
    try:
        assert fake.inject_xid(6, 79) == 0
        assert fake.inject_xid(4, 79) == 1
        assert [(x.gpu, x.code) for x in drain_until(source, 1)] == [(4, 79)]
    finally:
        source.close()
        session.close()
