"""``tcp_pair``: a bulk TCP transfer between two agents, timed at both ends.

Every agent with probes on serves a small endpoint (``--probe-listen``). The aggregator gives the
two ends of a pair the same assignment id: the ``client`` connects to the ``server``'s advertised
address and drives the exchange, line by line (UTF-8, ``\\n``-terminated)::

    client -> server   {the client's signed Assignment, as JSON}
    server -> client   OK                       or   ERR <reason>   (and the server closes)
    client -> server   <warm-up bytes>          min(size/8, 4 MiB): TCP's slow start, not the link
    server -> client   GO
    client -> server   <size_bytes bytes>       the measured transfer
    server -> client   DONE <server seconds>

The server refuses (``ERR``, close) unless the presented assignment is signed with the probe key,
is a ``tcp_pair`` ``client`` assignment whose ``peer`` is this node, has not passed its deadline,
is not early (``not_before`` minus a few seconds of clock slack) and its id was never served
before: nobody without the key can make a node serve bulk traffic, and a captured assignment
cannot be replayed. At most ``max_concurrent`` transfers are served at once; one more is refused
("busy") rather than queued, so a slow peer cannot pile up connections.

Each end times the transfer: the server from the first to the last byte received, the client from
the first byte sent to the ``DONE`` (one round trip more, negligible at probe sizes). Each reports
its own result (the server's ``peer`` is the client's node) in its own next report; the aggregator
joins the two halves by time and peer. Throughput is ``busbw_bytes_per_second`` = bytes / seconds
of the timed transfer; ``duration_seconds`` is the whole probe, handshake and warm-up included
(what the probe cost the node), as for every probe kind.

The deadline is enforced with socket timeouts recomputed before every blocking call: a peer that
stops reading or writing makes the probe fail with "deadline exceeded", never hang.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Final

import msgspec

from agent.clock import Clock
from agent.probes.base import (
    MAX_ERROR,
    NOT_BEFORE_SLACK_S,
    Cancel,
    ProbeFailure,
    Rendezvous,
    Support,
    failed,
    mono_deadline,
    passed,
)
from agent.probes.protocol import Assignment, ProbeKind, verify
from agent.report import Probe

log = logging.getLogger(__name__)

CHUNK: Final = 1 << 20
MAX_LINE: Final = 8192  # an assignment is a few hundred bytes
WARMUP_MAX: Final = 4 << 20
HANDSHAKE_TIMEOUT_S: Final = 10.0  # a connection that says nothing is closed after this
_USED_IDS_MAX: Final = 4096
_ZEROS: Final = bytes(CHUNK)

_decode_assignment = msgspec.json.Decoder(Assignment).decode
_encode = msgspec.json.Encoder().encode


def warmup_bytes(size: int) -> int:
    return min(max(size // 8, 1), WARMUP_MAX)


class _Conn:
    """A socket with deadline-bounded line and byte I/O."""

    def __init__(self, sock: socket.socket, clock: Clock, deadline: float) -> None:
        self.sock = sock
        self.clock = clock
        self.deadline = deadline  # monotonic
        self._buf = b""

    def _arm(self) -> None:
        left = self.deadline - self.clock.monotonic()
        if left <= 0:
            raise ProbeFailure("deadline exceeded")
        self.sock.settimeout(left)

    def send(self, data: bytes) -> None:
        self._arm()
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise ProbeFailure("deadline exceeded") from None

    def line(self) -> str:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise ProbeFailure("peer sent an over-long line")
            self._arm()
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                raise ProbeFailure("deadline exceeded") from None
            if not data:
                raise ProbeFailure("peer closed the connection")
            self._buf += data
        raw, _, self._buf = self._buf.partition(b"\n")
        return raw.decode("utf-8", "replace").strip()

    def drain(self, count: int, cancel: Cancel | None, on_read: Callable[[int], None] | None) -> None:
        """Read and discard exactly ``count`` bytes."""
        left = count
        if self._buf:
            take = min(left, len(self._buf))
            self._buf = self._buf[take:]
            left -= take
        view = bytearray(CHUNK)
        while left > 0:
            if cancel is not None and cancel.is_set():
                raise ProbeFailure(cancel.reason)
            self._arm()
            try:
                n = self.sock.recv_into(view, min(left, CHUNK))
            except TimeoutError:
                raise ProbeFailure("deadline exceeded") from None
            if n == 0:
                raise ProbeFailure(f"peer closed the connection with {left} bytes still to come")
            left -= n
            if on_read is not None:
                on_read(n)

    def pour(self, count: int, cancel: Cancel | None) -> None:
        """Send ``count`` zero bytes."""
        left = count
        while left > 0:
            if cancel is not None and cancel.is_set():
                raise ProbeFailure(cancel.reason)
            n = min(left, CHUNK)
            self.send(_ZEROS[:n] if n < CHUNK else _ZEROS)
            left -= n


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ProbeFailure(f"peer address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class TcpPairProbe:
    """The client side of ``tcp_pair``; the server side is ``TcpProbeServer``."""

    kind: ProbeKind = "tcp_pair"

    def __init__(self, *, node: str, clock: Clock, connect_timeout_s: float = 5.0) -> None:
        self.node = node
        self.clock = clock
        self.connect_timeout_s = connect_timeout_s

    def supported(self) -> Support:
        return Support(True)

    def child_pids(self) -> Collection[int]:
        return ()

    def run(self, assignment: Assignment, cancel: Cancel, rendezvous: Rendezvous | None = None) -> Probe:
        started = self.clock.time()
        begun = self.clock.monotonic()
        peer = assignment.peer
        size = assignment.size_bytes
        if assignment.role != "client":
            # The server side runs in TcpProbeServer when the client connects: nothing to do here.
            return failed(self.kind, started, f"role {assignment.role!r} is not run by the poller", peer=peer)
        deadline = mono_deadline(assignment, self.clock)
        try:
            if assignment.peer_address is None:
                raise ProbeFailure("assignment has no peer_address")
            host, port = parse_address(assignment.peer_address)
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise ProbeFailure("deadline exceeded")
            try:
                sock = socket.create_connection((host, port), timeout=min(left, self.connect_timeout_s))
            except OSError as exc:
                raise ProbeFailure(f"cannot connect to {assignment.peer_address}: {exc}") from exc
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = _Conn(sock, self.clock, deadline)
                conn.send(_encode(assignment) + b"\n")
                answer = conn.line()
                if answer != "OK":
                    raise ProbeFailure(f"peer refused: {answer.removeprefix('ERR ').strip() or 'no reason'}")
                conn.pour(warmup_bytes(size), cancel)
                if (go := conn.line()) != "GO":
                    raise ProbeFailure(f"peer answered {go[:80]!r} after the warm-up")
                t0 = self.clock.monotonic()
                conn.pour(size, cancel)
                done = conn.line()
                seconds = self.clock.monotonic() - t0
                if not done.startswith("DONE"):
                    raise ProbeFailure(f"peer answered {done[:80]!r} instead of DONE")
        except (ProbeFailure, OSError) as exc:
            error = str(exc) if isinstance(exc, ProbeFailure) else f"{type(exc).__name__}: {exc}"
            return failed(self.kind, started, error, peer=peer, size=size)
        seconds = max(seconds, 1e-9)
        duration = self.clock.monotonic() - begun
        return passed(self.kind, started, peer=peer, size=size, busbw=size / seconds, duration=duration)


class TcpProbeServer:
    """Serves the other end of ``tcp_pair`` probes from one accept thread and a few workers.

    ``on_result`` receives the server side's result of every transfer it accepted (refusals are
    logged, not reported: they are someone else's mistake, not a measurement). ``busy`` is asked
    before a transfer is accepted (the idle guard): a node whose GPUs run a job answers ``ERR busy``.
    ``on_read`` is called with each chunk size received; tests use it to make the server slow.
    """

    def __init__(
        self,
        *,
        node: str,
        key: bytes,
        clock: Clock,
        host: str,
        port: int,
        on_result: Callable[[Probe], None],
        busy: Callable[[], str | None] | None = None,
        max_concurrent: int = 2,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        if not 1 <= max_concurrent <= 8:
            raise ValueError(f"max_concurrent must be 1..8, got {max_concurrent}")
        self.node = node
        self._key = key
        self._clock = clock
        self._on_result = on_result
        self._busy = busy
        self._on_read = on_read
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._used: OrderedDict[str, float] = OrderedDict()  # id -> deadline
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
        self._sock.settimeout(0.5)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._accept_loop, name="gpuwarden-probe-server", daemon=True
            )
            self._thread.start()
            log.info("serving tcp_pair probes", extra={"listen": "{}:{}".format(*self.address)})

    def close(self) -> None:
        self._stop.set()
        # Wakes a blocked accept() at once on Linux; the accept timeout covers other systems.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(2.0)
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("probe server accept failed")
                continue
            if not self._slots.acquire(blocking=False):
                _refuse(sock, "busy: too many probes in progress")
                continue
            threading.Thread(
                target=self._serve, args=(sock, addr), name="gpuwarden-probe-conn", daemon=True
            ).start()

    def check(self, assignment: Assignment) -> str | None:
        """Why a presented client assignment is refused, or None (and its id is then used up)."""
        now = self._clock.time()
        if not verify(assignment, self._key):
            return "bad signature"
        if assignment.kind != "tcp_pair" or assignment.role != "client":
            return f"not a tcp_pair client assignment ({assignment.kind}/{assignment.role})"
        if assignment.peer != self.node:
            return f"assignment names peer {assignment.peer!r}, this is {self.node!r}"
        if assignment.deadline <= now:
            return "deadline passed"
        if assignment.not_before - NOT_BEFORE_SLACK_S > now:
            return f"too early: starts in {assignment.not_before - now:.1f} s"
        if assignment.size_bytes <= 0:
            return "size_bytes is not positive"
        with self._lock:
            # An id past its deadline would be refused anyway: forgetting it keeps the memory bounded.
            for old in [i for i, deadline in self._used.items() if deadline <= now]:
                del self._used[old]
            while len(self._used) >= _USED_IDS_MAX:
                self._used.popitem(last=False)
            if assignment.id in self._used:
                return "assignment id already used"
            self._used[assignment.id] = assignment.deadline
        return None

    def _serve(self, sock: socket.socket, addr: object) -> None:
        try:
            with sock:
                self._exchange(sock, addr)
        except Exception:  # a bad peer must not take the server down
            log.exception("probe connection failed", extra={"remote": str(addr)})
        finally:
            self._slots.release()

    def _exchange(self, sock: socket.socket, addr: object) -> None:
        conn = _Conn(sock, self._clock, self._clock.monotonic() + HANDSHAKE_TIMEOUT_S)
        try:
            assignment = _decode_assignment(conn.line())
        except (ProbeFailure, msgspec.DecodeError, msgspec.ValidationError) as exc:
            _refuse(sock, f"bad assignment: {exc}")
            log.warning("probe connection refused", extra={"remote": str(addr), "reason": str(exc)})
            return
        reason = self.check(assignment)
        if reason is None and self._busy is not None:
            busy = self._busy()
            if busy is not None:
                reason = f"busy: {busy}"
        if reason is not None:
            _refuse(sock, reason)
            log.warning(
                "probe assignment refused",
                extra={
                    "remote": str(addr),
                    "assignment": assignment.id,
                    "client": assignment.node,
                    "reason": reason,
                },
            )
            return
        started = self._clock.time()
        begun = self._clock.monotonic()
        size = assignment.size_bytes
        conn.deadline = mono_deadline(assignment, self._clock)
        try:
            conn.send(b"OK\n")
            conn.drain(warmup_bytes(size), None, self._on_read)
            conn.send(b"GO\n")
            # The clock starts when the first byte is in: waiting for it is latency, not bandwidth.
            conn.drain(1, None, self._on_read)
            t0 = self._clock.monotonic()
            conn.drain(size - 1, None, self._on_read)
            seconds = max(self._clock.monotonic() - t0, 1e-9)
            conn.send(f"DONE {seconds:.6f}\n".encode())
        except (ProbeFailure, OSError) as exc:
            error = str(exc) if isinstance(exc, ProbeFailure) else f"{type(exc).__name__}: {exc}"
            self._on_result(failed("tcp_pair", started, error, peer=assignment.node, size=size))
            return
        duration = self._clock.monotonic() - begun
        busbw = (size - 1) / seconds  # the first byte started the clock
        self._on_result(
            passed("tcp_pair", started, peer=assignment.node, size=size, busbw=busbw, duration=duration)
        )


def _refuse(sock: socket.socket, reason: str) -> None:
    with contextlib.suppress(OSError):
        sock.settimeout(1.0)
        sock.sendall(f"ERR {reason}"[:MAX_ERROR].replace("\n", " ").encode() + b"\n")
    with contextlib.suppress(OSError):
        sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
