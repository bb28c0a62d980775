"""``nccl_allreduce_local`` and ``nccl_allreduce_pair``: all-reduce bus bandwidth, by what the node has.

Backends, none of them a dependency of the agent:

- **nccl-tests** (``all_reduce_perf`` on ``PATH`` or ``--nccl-tests-path``), for the local probe:
  run as ``all_reduce_perf -b SIZE -e SIZE -g NGPUS -w 5 -n 20`` in its own process group, parsed
  by ``agent.probes.nccl_tests``; the deadline or a starting job kills the whole group.
  Pair probes would need MPI to launch it across two nodes, so the binary serves local probes only.
- **CuPy** (``cupy.cuda.nccl``), for both: in the agent's process, one rank per GPU. Local:
  ``NcclCommunicator.initAll`` over the node's GPUs. Pair: rank 0's node calls ``get_unique_id``
  and publishes it (hex) through the aggregator's rendezvous; the other node fetches it; each node
  creates its ranks ``node_rank * ngpus + i`` in one NCCL group. Both nodes must have the same
  number of GPUs (the aggregator pairs like with like); otherwise NCCL init waits for ranks that
  never come and the deadline ends it.

Pair probes set ``NCCL_ALGO=Ring`` in the agent's environment before NCCL starts, so the network
is what is measured (Tree or NVLS on two nodes can exceed the NIC line rate). NCCL reads it once
per process, so later in-process local probes use Ring too; the nccl-tests child gets the
environment the agent started with.

Bus bandwidth is nccl-tests' definition: algbw = bytes / time per all-reduce, busbw = algbw x
2(n-1)/n with n the total ranks. On one GPU no bus is crossed (the factor is 0), so the result
has ``busbw_bytes_per_second`` null; the probe still proves that NCCL initializes and runs.

If neither backend is present the kind is unsupported: a state of the node, logged once by the
poller, never reported as a failure.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final, Protocol

from agent.clock import Clock
from agent.probes import nccl_tests
from agent.probes.base import Cancel, ProbeFailure, Rendezvous, Support, failed, mono_deadline, passed
from agent.probes.idle import IdleGuard
from agent.probes.protocol import Assignment, ProbeKind
from agent.report import Probe

log = logging.getLogger(__name__)

WARMUP_ITERS: Final = 5
ITERS: Final = 20
RENDEZVOUS_POLL_S: Final = 0.5
_ORIGINAL_ENV: Final = dict(os.environ)  # what the nccl-tests child gets, whatever we set later


def bus_factor(ranks: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n: the share of the data each link carries."""
    if ranks < 1:
        raise ValueError(f"ranks must be positive, got {ranks}")
    return 2.0 * (ranks - 1) / ranks


def busbw(size_bytes: int, seconds_per_op: float, ranks: int) -> float | None:
    """Bus bandwidth in bytes/s; None on one rank (no bus crossed)."""
    if ranks == 1:
        return None
    return size_bytes / seconds_per_op * bus_factor(ranks)


def encode_unique_id(unique_id: tuple[int, ...] | bytes) -> str:
    """An ``ncclUniqueId`` as hex (CuPy hands it out as a tuple of 128 signed chars)."""
    return bytes(b & 0xFF for b in unique_id).hex()


def decode_unique_id(text: str) -> tuple[int, ...]:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ProbeFailure("rendezvous unique_id is not hex") from None
    if len(raw) != 128:
        raise ProbeFailure(f"rendezvous unique_id has {len(raw)} bytes, NCCL's has 128")
    return tuple(b - 256 if b > 127 else b for b in raw)


# ---- nccl-tests ---------------------------------------------------------------------------------


class NcclTestsBinary:
    """``all_reduce_perf`` as a child process, killed (with its process group) on deadline or cancel."""

    def __init__(
        self, path: Path, clock: Clock, *, warmup_iters: int = WARMUP_ITERS, iters: int = ITERS
    ) -> None:
        self.path = path
        self._clock = clock
        self._warmup = warmup_iters
        self._iters = iters
        self._pid: int | None = None

    @classmethod
    def find(cls, explicit: Path | None, clock: Clock) -> NcclTestsBinary | None:
        if explicit is not None:
            return cls(explicit, clock) if os.access(explicit, os.X_OK) else None
        found = shutil.which("all_reduce_perf")
        return cls(Path(found), clock) if found else None

    def pids(self) -> Collection[int]:
        pid = self._pid
        return (pid,) if pid is not None else ()

    def run(self, ngpus: int, size_bytes: int, deadline: float, cancel: Cancel) -> nccl_tests.Result:
        argv = [
            str(self.path),
            *("-b", str(size_bytes), "-e", str(size_bytes), "-g", str(ngpus)),
            *("-w", str(self._warmup), "-n", str(self._iters)),
        ]
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a kill reaches MPI/helper children too
                env=_ORIGINAL_ENV,
            )
        except OSError as exc:
            raise ProbeFailure(f"cannot start {self.path}: {exc}") from exc
        self._pid = proc.pid
        chunks: list[bytes] = []
        assert proc.stdout is not None
        stdout = proc.stdout
        reader = threading.Thread(
            target=lambda: chunks.extend(iter(lambda: stdout.read(65536), b"")), daemon=True
        )
        reader.start()
        stopped: str | None = None
        try:
            while True:
                left = deadline - self._clock.monotonic()
                if cancel.is_set():
                    stopped = cancel.reason
                elif left <= 0:
                    stopped = "deadline exceeded: all_reduce_perf killed"
                if stopped is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                try:
                    proc.wait(timeout=min(0.2, left))
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            self._pid = None
            reader.join(5.0)
            stdout.close()
        if stopped is not None:
            raise ProbeFailure(stopped)
        text = b"".join(chunks).decode("utf-8", "replace")
        if proc.returncode != 0:
            tail = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
            raise ProbeFailure(f"all_reduce_perf exited with status {proc.returncode}: {tail[0][:300]}")
        return nccl_tests.parse(text)


# ---- CuPy ---------------------------------------------------------------------------------------


class NcclComm(Protocol):
    """``cupy.cuda.nccl.NcclCommunicator``."""

    def allReduce(  # noqa: PLR0917 - CuPy's own positional signature
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None: ...
    def destroy(self) -> None: ...


class NcclModule(Protocol):
    """The part of ``cupy.cuda.nccl`` the probes call."""

    NCCL_FLOAT32: int
    NCCL_SUM: int

    def get_unique_id(self) -> tuple[int, ...]: ...
    def groupStart(self) -> None: ...
    def groupEnd(self) -> None: ...
    def NcclCommunicator(self, ndev: int, commId: tuple[int, ...], rank: int) -> NcclComm: ...
    def init_all(self, devices: list[int]) -> Sequence[NcclComm]:
        """``NcclCommunicator.initAll(devices)``."""
        ...


class Devices(Protocol):
    """The CUDA side: ``cupy.cuda.Device``, ``cupy.empty`` and streams."""

    def count(self) -> int: ...
    def use(self, index: int) -> AbstractContextManager[None]: ...
    def alloc(self, index: int, nbytes: int) -> int:
        """A device buffer's address (kept alive until ``release``)."""
        ...

    def stream(self, index: int) -> int: ...
    def synchronize(self, index: int) -> None: ...
    def release(self) -> None: ...


class _CupyNccl:
    """``cupy.cuda.nccl`` seen through ``NcclModule`` (``initAll`` is a static method there)."""

    def __init__(self, module: Any) -> None:
        self._m = module
        self.NCCL_FLOAT32: int = module.NCCL_FLOAT32
        self.NCCL_SUM: int = module.NCCL_SUM

    def get_unique_id(self) -> tuple[int, ...]:
        return tuple(self._m.get_unique_id())

    def groupStart(self) -> None:
        self._m.groupStart()

    def groupEnd(self) -> None:
        self._m.groupEnd()

    def NcclCommunicator(self, ndev: int, commId: tuple[int, ...], rank: int) -> NcclComm:
        comm: NcclComm = self._m.NcclCommunicator(ndev, commId, rank)
        return comm

    def init_all(self, devices: list[int]) -> list[NcclComm]:
        return list(self._m.NcclCommunicator.initAll(devices))


class _CupyDevices:
    def __init__(self, cupy: Any) -> None:
        self._cupy = cupy
        self._buffers: list[Any] = []

    def count(self) -> int:
        return int(self._cupy.cuda.runtime.getDeviceCount())

    @contextlib.contextmanager
    def use(self, index: int) -> Iterator[None]:
        with self._cupy.cuda.Device(index):
            yield

    def alloc(self, index: int, nbytes: int) -> int:
        with self._cupy.cuda.Device(index):
            array = self._cupy.ones((nbytes // 4,), dtype=self._cupy.float32)
        self._buffers.append(array)
        return int(array.data.ptr)

    def stream(self, index: int) -> int:
        with self._cupy.cuda.Device(index):
            return int(self._cupy.cuda.get_current_stream().ptr)

    def synchronize(self, index: int) -> None:
        self._cupy.cuda.Device(index).synchronize()

    def release(self) -> None:
        self._buffers.clear()
        with contextlib.suppress(Exception):
            self._cupy.get_default_memory_pool().free_all_blocks()


class CupyBackend:
    """All-reduce with CuPy's NCCL bindings, timed on the agent's clock after device synchronisation."""

    def __init__(
        self,
        nccl: NcclModule,
        devices: Devices,
        clock: Clock,
        *,
        warmup_iters: int = WARMUP_ITERS,
        iters: int = ITERS,
    ) -> None:
        self.nccl = nccl
        self.devices = devices
        self._clock = clock
        self._warmup = warmup_iters
        self._iters = iters

    @classmethod
    def load(cls, clock: Clock) -> CupyBackend | None:
        """CuPy if it imports and sees a GPU; None otherwise (the backend is simply absent)."""
        try:
            cupy = importlib.import_module("cupy")
            nccl = importlib.import_module("cupy.cuda.nccl")
            devices = _CupyDevices(cupy)
            if devices.count() < 1:
                return None
        except Exception as exc:  # ImportError, a CUDA runtime error: either way, no CuPy here
            log.debug("CuPy NCCL backend unavailable", extra={"error": f"{type(exc).__name__}: {exc}"})
            return None
        return cls(_CupyNccl(nccl), devices, clock)

    def _timed(self, comms: list[Any], ngpus: int, size_bytes: int, deadline: float, cancel: Cancel) -> float:
        """Seconds per all-reduce over ``iters`` after ``warmup`` (both over every local rank)."""
        count = size_bytes // 4
        send = [self.devices.alloc(i, count * 4) for i in range(ngpus)]
        recv = [self.devices.alloc(i, count * 4) for i in range(ngpus)]
        streams = [self.devices.stream(i) for i in range(ngpus)]

        def one() -> None:
            if cancel.is_set():
                raise ProbeFailure(cancel.reason)
            if self._clock.monotonic() >= deadline:
                raise ProbeFailure("deadline exceeded")
            self.nccl.groupStart()
            for i in range(ngpus):
                with self.devices.use(i):
                    comms[i].allReduce(
                        send[i], recv[i], count, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, streams[i]
                    )
            self.nccl.groupEnd()

        def sync() -> None:
            for i in range(ngpus):
                self.devices.synchronize(i)

        for _ in range(self._warmup):
            one()
        sync()
        t0 = self._clock.monotonic()
        for _ in range(self._iters):
            one()
        sync()
        return max(self._clock.monotonic() - t0, 1e-9) / self._iters

    def local(
        self, ngpus: int, size_bytes: int, deadline: float, cancel: Cancel
    ) -> tuple[float | None, float]:
        """(busbw, seconds per op) across this node's GPUs."""
        comms = list(self.nccl.init_all(list(range(ngpus))))
        try:
            seconds = self._timed(comms, ngpus, size_bytes, deadline, cancel)
        finally:
            _destroy(comms)
            self.devices.release()
        return busbw(size_bytes - size_bytes % 4, seconds, ngpus), seconds

    def pair(
        self,
        assignment: Assignment,
        ngpus: int,
        rendezvous: Rendezvous,
        deadline: float,
        cancel: Cancel,
    ) -> tuple[float | None, float]:
        node_rank = assignment.rank
        if node_rank not in (0, 1):
            raise ProbeFailure(f"pair assignment rank {node_rank!r}: expected 0 or 1")
        if node_rank == 0:
            unique_id = self.nccl.get_unique_id()
            rendezvous.publish_unique_id(assignment.id, assignment.node, encode_unique_id(unique_id))
        else:
            unique_id = self._fetch(assignment, rendezvous, deadline, cancel)
        os.environ["NCCL_ALGO"] = "Ring"
        nranks = 2 * ngpus
        comms: list[NcclComm] = []
        self.nccl.groupStart()
        try:
            for i in range(ngpus):
                with self.devices.use(i):
                    comms.append(self.nccl.NcclCommunicator(nranks, unique_id, node_rank * ngpus + i))
        finally:
            self.nccl.groupEnd()
        try:
            seconds = self._timed(comms, ngpus, assignment.size_bytes, deadline, cancel)
        finally:
            _destroy(comms)
            self.devices.release()
        return busbw(assignment.size_bytes - assignment.size_bytes % 4, seconds, nranks), seconds

    def _fetch(
        self, assignment: Assignment, rendezvous: Rendezvous, deadline: float, cancel: Cancel
    ) -> tuple[int, ...]:
        while True:
            text = rendezvous.fetch_unique_id(assignment.id, assignment.node)
            if text is not None:
                return decode_unique_id(text)
            if cancel.wait(min(RENDEZVOUS_POLL_S, deadline - self._clock.monotonic())):
                raise ProbeFailure(cancel.reason)
            if self._clock.monotonic() >= deadline:
                raise ProbeFailure("deadline exceeded waiting for the peer's NCCL unique id")


def _destroy(comms: list[NcclComm]) -> None:
    for comm in comms:
        with contextlib.suppress(Exception):
            comm.destroy()


# ---- the probe kinds ----------------------------------------------------------------------------


class _NcclProbe:
    kind: ProbeKind

    def __init__(
        self, *, clock: Clock, guard: IdleGuard, binary: NcclTestsBinary | None, cupy: CupyBackend | None
    ) -> None:
        self.clock = clock
        self.guard = guard
        self.binary = binary
        self.cupy = cupy

    def child_pids(self) -> Collection[int]:
        return self.binary.pids() if self.binary is not None else ()

    def _result(self, assignment: Assignment, started: float, bw: float | None) -> Probe:
        """``duration_seconds`` is the whole probe (init, warm-up, timed loop): what it cost the node."""
        duration = max(self.clock.time() - started, 0.0)
        return passed(
            self.kind, started, peer=assignment.peer, size=assignment.size_bytes, busbw=bw, duration=duration
        )


class NcclLocalProbe(_NcclProbe):
    kind: ProbeKind = "nccl_allreduce_local"

    def supported(self) -> Support:
        if self.guard.gpu_count < 1:
            return Support(False, "no GPUs visible to NVML")
        if self.binary is None and self.cupy is None:
            return Support(
                False, "neither nccl-tests' all_reduce_perf nor CuPy's NCCL bindings are installed"
            )
        return Support(True)

    def run(self, assignment: Assignment, cancel: Cancel, rendezvous: Rendezvous | None = None) -> Probe:
        started = self.clock.time()
        deadline = mono_deadline(assignment, self.clock)
        ngpus = self.guard.gpu_count
        try:
            if self.binary is not None:
                result = self.binary.run(ngpus, assignment.size_bytes, deadline, cancel)
                bw: float | None = result.largest.busbw_bytes_per_second if ngpus > 1 else None
            else:
                assert self.cupy is not None
                bw, _ = self.cupy.local(ngpus, assignment.size_bytes, deadline, cancel)
        except ProbeFailure as exc:
            return failed(self.kind, started, str(exc), size=assignment.size_bytes)
        except Exception as exc:  # a CUDA/NCCL error from the bindings: a failed probe, reported
            return failed(self.kind, started, f"{type(exc).__name__}: {exc}", size=assignment.size_bytes)
        return self._result(assignment, started, bw)


class NcclPairProbe(_NcclProbe):
    kind: ProbeKind = "nccl_allreduce_pair"

    def supported(self) -> Support:
        if self.guard.gpu_count < 1:
            return Support(False, "no GPUs visible to NVML")
        if self.cupy is None:
            return Support(False, "CuPy's NCCL bindings are not installed (nccl-tests needs MPI for pairs)")
        return Support(True)

    def run(self, assignment: Assignment, cancel: Cancel, rendezvous: Rendezvous | None = None) -> Probe:
        started = self.clock.time()
        deadline = mono_deadline(assignment, self.clock)
        try:
            if self.cupy is None:
                raise ProbeFailure("no CuPy NCCL backend")
            if rendezvous is None:
                raise ProbeFailure("no rendezvous to swap the NCCL unique id through")
            bw, _ = self.cupy.pair(assignment, self.guard.gpu_count, rendezvous, deadline, cancel)
        except ProbeFailure as exc:
            return failed(self.kind, started, str(exc), peer=assignment.peer, size=assignment.size_bytes)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return failed(self.kind, started, error, peer=assignment.peer, size=assignment.size_bytes)
        return self._result(assignment, started, bw)
