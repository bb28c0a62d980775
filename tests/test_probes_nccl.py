"""NCCL probes: the nccl-tests binary (faked by scripts the tests write) and the CuPy backend (faked)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.clock import FakeClock, SystemClock
from agent.gpu.fake import FakeNvml
from agent.gpu.session import NvmlSession
from agent.probes.base import Cancel
from agent.probes.idle import IdleGuard
from agent.probes.nccl import (
    CupyBackend,
    NcclLocalProbe,
    NcclPairProbe,
    NcclTestsBinary,
    bus_factor,
    decode_unique_id,
    encode_unique_id,
)
from agent.probes.protocol import Assignment
from agent.report import Probe

FIXTURE = Path(__file__).parent / "fixtures" / "nccl_tests" / "oci_a100x16_nccl2.21.5.txt"
GIB = 1 << 30


def guard(count: int = 8) -> IdleGuard:
    return IdleGuard(NvmlSession(FakeNvml({"count": count})))


def local(size: int = 10737418240, deadline_in: float = 30.0, node: str = "node-a") -> Assignment:
    now = time.time()
    return Assignment(
        id="l-1",
        kind="nccl_allreduce_local",
        node=node,
        role="local",
        not_before=now,
        deadline=now + deadline_in,
        size_bytes=size,
    )


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "all_reduce_perf"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---- nccl-tests binary ----------------------------------------------------------------------------


def test_binary_output_is_parsed_into_the_result(tmp_path: Path) -> None:
    argv = tmp_path / "argv"
    binary = script(tmp_path, f'echo "$@" > {argv}\ncat {FIXTURE}\n')
    probe = NcclLocalProbe(
        clock=SystemClock(), guard=guard(8), binary=NcclTestsBinary(binary, SystemClock()), cupy=None
    )
    result = probe.run(local(), Cancel())
    assert result.ok, result.error
    assert argv.read_text().split() == [
        "-b",
        "10737418240",
        "-e",
        "10737418240",
        "-g",
        "8",
        "-w",
        "5",
        "-n",
        "20",
    ]
    # The mean of the row's out-of-place and in-place busbw, as nccl-tests averages them.
    assert result.busbw_bytes_per_second == pytest.approx((222.88e9 + 218.96e9) / 2)
    assert result.size_bytes == 10737418240 and result.peer is None


def test_a_hanging_binary_is_killed_with_its_process_group_at_the_deadline(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    binary = script(tmp_path, f"sleep 60 &\necho $! > {pidfile}\nwait\n")
    probe = NcclLocalProbe(
        clock=SystemClock(), guard=guard(), binary=NcclTestsBinary(binary, SystemClock()), cupy=None
    )
    started = time.monotonic()
    result = probe.run(local(deadline_in=0.5), Cancel())
    assert time.monotonic() - started < 5
    assert not result.ok and result.error == "deadline exceeded: all_reduce_perf killed"
    child = int(pidfile.read_text())
    for _ in range(100):  # the kernel reaps the orphaned grandchild asynchronously
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        threading.Event().wait(0.02)
    else:
        pytest.fail("the binary's child survived the kill")


def test_a_failing_binary_reports_its_last_line(tmp_path: Path) -> None:
    binary = script(tmp_path, "echo 'gpu-1: Test NCCL failure common.cu:958 unhandled cuda error'\nexit 1\n")
    probe = NcclLocalProbe(
        clock=SystemClock(), guard=guard(), binary=NcclTestsBinary(binary, SystemClock()), cupy=None
    )
    result = probe.run(local(), Cancel())
    assert not result.ok
    assert (
        result.error
        == "all_reduce_perf exited with status 1: gpu-1: Test NCCL failure common.cu:958 unhandled cuda error"
    )


def test_truncated_binary_output_fails_the_probe(tmp_path: Path) -> None:
    binary = script(tmp_path, f"head -n 24 {FIXTURE}\n")
    probe = NcclLocalProbe(
        clock=SystemClock(), guard=guard(), binary=NcclTestsBinary(binary, SystemClock()), cupy=None
    )
    result = probe.run(local(), Cancel())
    assert not result.ok and result.error is not None and "cut short" in result.error


def test_cancel_kills_the_binary(tmp_path: Path) -> None:
    binary = script(tmp_path, "exec sleep 60\n")
    cancel = Cancel()
    threading.Timer(0.2, cancel.set, args=("stepped aside: a job started",)).start()
    probe = NcclLocalProbe(
        clock=SystemClock(), guard=guard(), binary=NcclTestsBinary(binary, SystemClock()), cupy=None
    )
    result = probe.run(local(), cancel)
    assert not result.ok and result.error == "stepped aside: a job started"


def test_find_uses_path_or_the_explicit_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert NcclTestsBinary.find(None, SystemClock()) is None
    binary = script(tmp_path, "exit 0\n")
    found = NcclTestsBinary.find(None, SystemClock())
    assert found is not None and found.path == binary
    assert NcclTestsBinary.find(tmp_path / "missing", SystemClock()) is None


def test_without_any_backend_the_kinds_are_unsupported() -> None:
    g = guard()
    assert not NcclLocalProbe(clock=SystemClock(), guard=g, binary=None, cupy=None).supported().supported
    assert not NcclPairProbe(clock=SystemClock(), guard=g, binary=None, cupy=None).supported().supported
    no_gpus = IdleGuard(None)
    support = NcclLocalProbe(clock=SystemClock(), guard=no_gpus, binary=None, cupy=None).supported()
    assert not support.supported and "no GPUs" in support.reason


# ---- CuPy -----------------------------------------------------------------------------------------


class FakeComm:
    def __init__(self, world: FakeNccl, nranks: int, unique_id: tuple[int, ...], rank: int) -> None:
        self.world, self.nranks, self.unique_id, self.rank = world, nranks, unique_id, rank
        self.calls = 0
        self.destroyed = False

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: PLR0917
        assert (datatype, op) == (FakeNccl.NCCL_FLOAT32, FakeNccl.NCCL_SUM)
        assert sendbuf != recvbuf
        self.world.counts.add(count)
        self.calls += 1

    def destroy(self) -> None:
        self.destroyed = True


class FakeNccl:
    """A fake of the ``cupy.cuda.nccl`` surface the probes call, not CuPy.

    Stands for ``get_unique_id()``, ``NcclCommunicator(ndev, commId, rank)``,
    ``NcclCommunicator.initAll(devices)`` (``init_all``), ``groupStart()``/``groupEnd()``, and a
    communicator's ``allReduce(send, recv, count, NCCL_FLOAT32, NCCL_SUM, stream)`` and
    ``destroy()``. Each ``groupEnd`` after a round of all-reduces advances the clock by
    ``seconds_per_op``: the time the GPUs would have taken.
    """

    NCCL_FLOAT32 = 7
    NCCL_SUM = 0

    def __init__(
        self, clock: FakeClock, seconds_per_op: float, unique_id: tuple[int, ...] | None = None
    ) -> None:
        self.clock = clock
        self.seconds_per_op = seconds_per_op
        self._uid = unique_id or tuple((i * 37) % 256 - 128 for i in range(128))
        self.comms: list[FakeComm] = []
        self.counts: set[int] = set()
        self.in_group = False
        self.algo_at_init: str | None = None

    def get_unique_id(self) -> tuple[int, ...]:
        return self._uid

    def groupStart(self) -> None:
        self.in_group = True

    def groupEnd(self) -> None:
        self.in_group = False
        if any(c.calls for c in self.comms):
            self.clock.advance(self.seconds_per_op)

    def NcclCommunicator(self, ndev: int, commId: tuple[int, ...], rank: int) -> FakeComm:
        assert self.in_group, "several ranks from one thread must be created inside one NCCL group"
        self.algo_at_init = os.environ.get("NCCL_ALGO")
        comm = FakeComm(self, ndev, commId, rank)
        self.comms.append(comm)
        return comm

    def init_all(self, devices: list[int]) -> list[FakeComm]:
        uid = self.get_unique_id()
        self.comms = [FakeComm(self, len(devices), uid, r) for r in devices]
        return list(self.comms)


class FakeDevices:
    """Stands for ``cupy.cuda.Device``, ``cupy.ones`` buffers and streams."""

    def __init__(self, count: int) -> None:
        self._count = count
        self.allocated: list[tuple[int, int]] = []
        self.synced: list[int] = []
        self.released = False

    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def use(self, index: int) -> Iterator[None]:
        assert 0 <= index < self._count
        yield

    def alloc(self, index: int, nbytes: int) -> int:
        self.allocated.append((index, nbytes))
        return 0x10000 * len(self.allocated)

    def stream(self, index: int) -> int:
        return 0

    def synchronize(self, index: int) -> None:
        self.synced.append(index)

    def release(self) -> None:
        self.released = True


def test_cupy_local_busbw_is_algbw_times_the_bus_factor() -> None:
    clock = FakeClock()
    nccl = FakeNccl(clock, seconds_per_op=0.01)
    devices = FakeDevices(8)
    backend = CupyBackend(nccl, devices, clock)
    probe = NcclLocalProbe(clock=clock, guard=guard(8), binary=None, cupy=backend)
    result = probe.run(local(size=GIB), Cancel())
    assert result.ok, result.error
    # algbw = 1 GiB / 10 ms; busbw = algbw x 2(8-1)/8.
    assert result.busbw_bytes_per_second == pytest.approx(GIB / 0.01 * 14 / 8)
    assert nccl.counts == {GIB // 4}
    assert all(c.calls == 25 and c.destroyed for c in nccl.comms)  # 5 warm-up + 20 timed
    assert devices.released and len(devices.allocated) == 16


def test_one_gpu_has_no_bus_bandwidth() -> None:
    assert bus_factor(1) == 0
    clock = FakeClock()
    backend = CupyBackend(FakeNccl(clock, 0.01), FakeDevices(1), clock)
    result = NcclLocalProbe(clock=clock, guard=guard(1), binary=None, cupy=backend).run(
        local(size=GIB), Cancel()
    )
    assert result.ok and result.busbw_bytes_per_second is None


def test_unique_id_hex_round_trip() -> None:
    uid = tuple(range(-128, 0))
    text = encode_unique_id(uid)
    assert len(text) == 256 and decode_unique_id(text) == uid


class MemoryRendezvous:
    """The aggregator's rendezvous endpoints, in memory."""

    def __init__(self) -> None:
        self.ids: dict[str, str] = {}
        self.lock = threading.Lock()
        self.fetches = 0

    def publish_unique_id(self, assignment_id: str, node: str, unique_id: str) -> None:
        with self.lock:
            self.ids[assignment_id] = unique_id

    def fetch_unique_id(self, assignment_id: str, node: str) -> str | None:
        with self.lock:
            self.fetches += 1
            return self.ids.get(assignment_id)


def pair(node: str, peer: str, rank: int, deadline_in: float = 30.0) -> Assignment:
    now = time.time()
    return Assignment(
        id="pair-7",
        kind="nccl_allreduce_pair",
        node=node,
        role="client" if rank == 0 else "server",
        not_before=now,
        deadline=now + deadline_in,
        size_bytes=GIB,
        peer=peer,
        rank=rank,
    )


def test_cupy_pair_hands_the_unique_id_over_and_uses_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    rendezvous = MemoryRendezvous()
    clocks = [FakeClock(), FakeClock()]
    fakes = [FakeNccl(clocks[0], 0.02), FakeNccl(clocks[1], 0.02, unique_id=tuple([5] * 128))]
    probes = [
        NcclPairProbe(
            clock=clocks[i],
            guard=guard(4),
            binary=None,
            cupy=CupyBackend(fakes[i], FakeDevices(4), clocks[i]),
        )
        for i in range(2)
    ]
    results: dict[int, Probe] = {}
    # Rank 1 starts first and must wait for rank 0's id (polling the rendezvous).
    t1 = threading.Thread(
        target=lambda: results.__setitem__(
            1, probes[1].run(pair("node-b", "node-a", 1), Cancel(), rendezvous)
        )
    )
    t1.start()
    results[0] = probes[0].run(pair("node-a", "node-b", 0), Cancel(), rendezvous)
    t1.join(10)
    for rank in (0, 1):
        r = results[rank]
        assert r.ok, r.error
        # 2 nodes x 4 GPUs = 8 ranks: busbw = (1 GiB / 20 ms) x 2(8-1)/8.
        assert r.busbw_bytes_per_second == pytest.approx(GIB / 0.02 * 14 / 8)
    assert [c.rank for c in fakes[0].comms] == [0, 1, 2, 3]
    assert [c.rank for c in fakes[1].comms] == [4, 5, 6, 7]
    assert {c.nranks for c in fakes[0].comms + fakes[1].comms} == {8}
    # Both nodes' communicators were built from rank 0's id, not from rank 1's own.
    assert {c.unique_id for c in fakes[1].comms} == {fakes[0].get_unique_id()}
    assert fakes[0].algo_at_init == fakes[1].algo_at_init == "Ring"


def test_pair_without_the_peer_ends_at_the_deadline() -> None:
    clock = SystemClock()
    fake = FakeNccl(FakeClock(), 0.02)
    probe = NcclPairProbe(
        clock=clock, guard=guard(2), binary=None, cupy=CupyBackend(fake, FakeDevices(2), clock)
    )
    result = probe.run(pair("node-b", "node-a", 1, deadline_in=0.7), Cancel(), MemoryRendezvous())
    assert not result.ok and result.error == "deadline exceeded waiting for the peer's NCCL unique id"
    assert result.peer == "node-a"
