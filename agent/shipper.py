"""Delivers reports to the aggregator: over one kept-alive HTTP connection, in order, through outages.

``submit`` never blocks the collection loop: it encodes and compresses the report and puts it at
the back of a bounded in-memory spool. One sender thread POSTs the spool's head to
``{url}/v1/reports`` and only moves on once the aggregator has answered for it, so reports arrive
oldest first. While the aggregator is unreachable the spool absorbs the reports (an outage of a
few minutes loses nothing); past its bound the oldest report is dropped and counted, because the
newest state of the node is what the aggregator needs most.

What an answer means for the report at the head:

- 2xx: delivered.
- 401/403: kept. The token is re-read (a projected service-account token rotates) and the sender
  backs off: a fresh token or an RBAC fix cures it without restarting the agent. A one-shot run
  (``credentials_final``) has no later to wait for: the refusal is final, the report is dropped
  and ``refusal()`` gives the status and the aggregator's message at once.
- 408, 429, 5xx, network errors, timeouts: kept, back off, retry (``Retry-After`` is honoured).
- 415 to a compact report: sent again at once as JSON (see the negotiation below).
- any other 4xx (a schema error, 413): refused for good. Retrying could never succeed and would
  block every later report, so it is logged with the server's reason, counted, and dropped.
- 307/308 from a sharded aggregator naming the shard that owns the node's pool: sent there at
  once, and later reports too (agent/shardroute.py); back to the configured URL on errors.
- anything else (1xx, other 3xx: a wrong URL, most likely): kept and retried, so a configuration
  mistake fixed by an operator loses nothing.

With several aggregator replicas (``--aggregator`` repeated) ``ShipperFanout`` gives each its
own ``Shipper``: its own spool and sender thread, so a replica that is down or slow never delays
the reports to the others, and each replica sees the same reports in the same order.

The encoding is negotiated per aggregator (docs/spec.md, "Compact encoding"): reports go as
gzip'd JSON until an answer's ``Accept-Post`` names ``application/msgpack`` with this build's
column layout (``agent.wire.LAYOUT``); from then on they go compact, and back to JSON as soon as an
answer stops naming it (an older aggregator rolled in) or a compact report is answered 415, which
resends that report as JSON at once rather than dropping it as any other 4xx, and is remembered:
offers are not believed for ``COMPACT_HOLD_OFF_S`` after it, so an aggregator that offers what it
then refuses costs one extra request every few minutes, not one per report. A report spooled
compact while the aggregator changed is re-encoded as JSON before it is sent.

One connection per aggregator is kept alive between reports (HTTP/1.1; over TLS the session is
resumed on reconnect): a TLS handshake per report costs both ends more CPU than the report itself
(docs/performance.md, "Wire format"). It is dropped on any error, on ``Connection: close``, on an
answer too long to read to its end; a request that fails on a reused connection (the server
closed it while idle, ``server.idle_timeout_seconds``) is sent once more at once on a fresh one
before it counts as a failure.

Backoff is exponential with full jitter, capped. Delivery is at least once: a request that timed
out may have reached the aggregator, which tells duplicates apart by ``(node, boot_id, seq)``.
"""

from __future__ import annotations

import email.utils
import gzip
import http.client
import json
import logging
import math
import os
import random
import ssl
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC
from enum import Enum
from pathlib import Path
from typing import Final, Literal

from agent import __version__
from agent.clock import Clock
from agent.errors import ConfigError, ReportError
from agent.report import Report, encode
from agent.shardroute import SHARD_HEADER, Endpoint, ShardRoute
from agent.state import ShipperStats
from agent.wire import (
    ACCEPT_POST_HEADER,
    COMPACT_MEDIA_TYPE,
    JSON_MEDIA_TYPE,
    LAYOUT,
    as_v1,
    decode_compact,
    encode_compact,
)

log = logging.getLogger(__name__)

REPORTS_PATH: Final = "/v1/reports"
# A server asking for an hour's pause would let the spool overflow and silence the node; past this
# the agent retries anyway, and the aggregator can say Retry-After again.
RETRY_AFTER_MAX_S: Final = 300.0
# Enough of an error body to log the server's reason, never a whole HTML error page.
_REASON_MAX_BYTES: Final = 2048
# An answer is read to its end so the connection can carry the next report; one longer than this
# (no aggregator answer is: a proxy's error page) costs the connection instead.
_DRAIN_MAX_BYTES: Final = 64 * 1024
# Whether compact reports are gzip'd: docs/performance.md ("Wire format") has the measurements.
COMPACT_GZIP: Final = False

# After a 415 to a compact report, how long the aggregator's offers of it are not believed.
COMPACT_HOLD_OFF_S: Final = 600.0

WireChoice = Literal["auto", "json"]
# Bounds the exponent so 2**n stays a small float however long an outage lasts.
_BACKOFF_MAX_EXPONENT: Final = 32


def encode_body(report: Report, *, compact: bool = False) -> bytes:
    """The report as it goes on the wire: JSON, gzip-compressed; or the compact msgpack encoding
    (``agent.wire``), gzip'd only if ``COMPACT_GZIP``."""
    if compact:
        body = encode_compact(report)
        return _gzip(body) if COMPACT_GZIP else body
    return _gzip(encode(report))


def _gzip(data: bytes) -> bytes:
    # mtime=0: the same report always compresses to the same bytes.
    return gzip.compress(data, compresslevel=6, mtime=0)


def _as_json_body(body: bytes) -> bytes:
    """A compact body re-encoded as JSON (the aggregator no longer takes the compact form)."""
    raw = gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body
    return encode_body(as_v1(decode_compact(raw)))


def offers_compact(accept_post: str | None) -> bool:
    """Whether an ``Accept-Post`` value names ``application/msgpack`` in this build's layout."""
    if not accept_post:
        return False
    for media_range in accept_post.split(","):
        kind, *params = (part.strip() for part in media_range.split(";"))
        if kind.lower() != COMPACT_MEDIA_TYPE:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "layout" and value.strip().strip('"') == LAYOUT:
                return True
    return False


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or an HTTP-date), or None.

    ``now`` is unix seconds, the reference for an HTTP-date. A date in the past means no wait.
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int | None
    path: str


def _parse_url(url: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"aggregator URL {url!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"aggregator URL {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ConfigError(f"aggregator URL {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"aggregator URL {url!r} must not carry credentials (use --token-file)")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"aggregator URL {url!r} must be a base URL without ?query or #fragment "
            f"(reports go to <url>{REPORTS_PATH})"
        )
    return _Target(
        scheme=parts.scheme,
        host=parts.hostname,
        port=port,
        path=parts.path.rstrip("/") + REPORTS_PATH,
    )


class _Outcome(Enum):
    SENT = "sent"
    REJECTED = "rejected"  # refused for good: drop it
    UNAUTHORIZED = "unauthorized"  # keep, re-read the token, back off
    RETRY = "retry"  # keep, back off


@dataclass(frozen=True)
class _Answer:
    outcome: _Outcome
    status: int | None = None
    reason: str = ""
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Refusal:
    """The aggregator refused the agent's credentials (a final 401 or 403)."""

    url: str
    status: int
    reason: str

    def __str__(self) -> str:
        return f"aggregator {self.url} refused the agent's token: HTTP {self.status}: {_said(self.reason)}"


def _said(body: str) -> str:
    """The aggregator's message from its error body (``{"error": code, "message": text}``), or
    the body as it is from anything else (a proxy's page)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body or "(no message)"
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        code = data.get("error")
        return f"{data['message']} ({code})" if isinstance(code, str) else data["message"]
    return body


@dataclass(frozen=True)
class _Spooled:
    body: bytes
    node: str
    seq: int
    compact: bool = False


@dataclass(frozen=True)
class _Reply:
    status: int
    retry_after: str | None
    reason: str
    accept_post: str | None


class _TlsConnection(http.client.HTTPSConnection):
    """An HTTPS connection that resumes the previous connection's TLS session, if it has one."""

    def __init__(
        self,
        host: str,
        port: int | None,
        *,
        timeout: float,
        context: ssl.SSLContext,
        session: ssl.SSLSession | None,
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls = context
        self._session = session
        # What the handshake gave, read before the socket goes (getresponse() closes it on
        # Connection: close, and a closed socket has no session to give).
        self.session: ssl.SSLSession | None = None
        self.resumed = False

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self.host, session=self._session)

    def note_session(self) -> None:
        sock = self.sock
        if isinstance(sock, ssl.SSLSocket):
            self.resumed = self.resumed or bool(sock.session_reused)
            # TLS 1.3 sends its tickets after the handshake: the session is resumable once read.
            self.session = sock.session or self.session

    def close(self) -> None:
        self.note_session()
        super().close()


def _classify(status: int) -> _Outcome:
    if 200 <= status < 300:
        return _Outcome.SENT
    if status in (401, 403):
        return _Outcome.UNAUTHORIZED
    if status in (408, 429):
        return _Outcome.RETRY
    if 400 <= status < 500:
        return _Outcome.REJECTED
    return _Outcome.RETRY


class _TokenSource:
    """The bearer token, re-read whenever its file changes or the server refuses it.

    The kubelet replaces a projected token atomically (a symlink swap), so a change of inode,
    mtime or size means a new token. A file that is briefly missing or empty mid-rotation keeps
    the last good token in use rather than stopping delivery.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._token = ""
        self._key: tuple[int, int, int] | None = None
        self._warned = False

    def load(self) -> None:
        """First read, at start: every problem is a configuration error."""
        try:
            st = os.stat(self._path)
            text = self._path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read token file {self._path}: {exc}") from exc
        token = text.strip()
        problem = self._problem(token)
        if problem:
            raise ConfigError(f"token file {self._path} {problem}")
        self._token = token
        self._key = (st.st_ino, st.st_mtime_ns, st.st_size)

    def invalidate(self) -> None:
        self._key = None

    def current(self) -> str:
        try:
            st = os.stat(self._path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._key:
                return self._token
            token = self._path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            self._warn_once("token file unreadable, keeping the last token", str(exc))
            return self._token
        problem = self._problem(token)
        if problem:
            # Not remembering the key makes the next send look again.
            self._warn_once("token file unusable, keeping the last token", problem)
            return self._token
        if token != self._token:
            log.info("bearer token reloaded", extra={"token_file": str(self._path)})
        self._token = token
        self._key = key
        self._warned = False
        return token

    @staticmethod
    def _problem(token: str) -> str:
        if not token:
            return "is empty"
        if any(ch in token for ch in "\r\n\0"):
            return "holds more than one line"
        return ""

    def _warn_once(self, message: str, error: str) -> None:
        if not self._warned:
            log.warning(message, extra={"token_file": str(self._path), "error": error})
            self._warned = True


class Shipper:
    """Sends reports to the aggregator from one background thread.

    ``start()`` reads the token file (a ``ConfigError`` if it cannot) and starts the sender.
    ``submit()`` queues a report without blocking. ``flush()`` waits until the spool is empty.
    ``close()`` keeps delivering what is spooled for up to its timeout, then stops.

    ``backoff_wait`` replaces the pause between failed attempts (tests record the delays with it);
    by default the pause is an ``Event`` wait that ``close()`` cuts short.
    """

    def __init__(
        self,
        url: str,
        token_file: Path | None,
        clock: Clock,
        *,
        timeout_s: float = 5.0,
        max_spool_reports: int = 360,
        max_spool_bytes: int = 32 * 1024 * 1024,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        rng: random.Random | None = None,
        ca_file: Path | None = None,
        backoff_wait: Callable[[float], None] | None = None,
        credentials_final: bool = False,
        wire: WireChoice = "auto",
    ) -> None:
        """``credentials_final``: a 401 or 403 drops the report instead of retrying (``--once``).
        ``wire``: "auto" negotiates the compact encoding (module docstring), "json" never uses it."""
        self._target = _parse_url(url)
        self._url = url
        # Sharded aggregators redirect to the shard that owns the node's pool (agent/shardroute.py).
        self._route = ShardRoute(self._target.scheme, REPORTS_PATH)
        if not timeout_s > 0:
            raise ConfigError(f"shipper timeout must be positive, got {timeout_s}")
        if max_spool_reports < 1:
            raise ConfigError(f"spool must hold at least one report, got {max_spool_reports}")
        if max_spool_bytes < 1:
            raise ConfigError(f"spool byte bound must be positive, got {max_spool_bytes}")
        if not 0 < backoff_base_s <= backoff_max_s:
            raise ConfigError(f"backoff needs 0 < base <= max, got base={backoff_base_s} max={backoff_max_s}")
        self._ssl: ssl.SSLContext | None = None
        if self._target.scheme == "https":
            try:
                self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load CA file {ca_file}: {exc}") from exc
        elif ca_file is not None:
            raise ConfigError(f"a CA file was given but aggregator URL {url!r} is not https")
        self._clock = clock
        self._token = _TokenSource(token_file) if token_file is not None else None
        self._timeout_s = timeout_s
        self._max_reports = max_spool_reports
        self._max_bytes = max_spool_bytes
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._rng = rng if rng is not None else random.Random()
        self._backoff_wait = backoff_wait
        self._credentials_final = credentials_final
        self._refusal: Refusal | None = None
        if wire not in ("auto", "json"):
            raise ConfigError(f"wire encoding must be auto or json, got {wire!r}")
        self._negotiate = wire == "auto"
        # Learned from the aggregator's answers; JSON until one says otherwise.
        self._compact = False
        self._refused_until = -math.inf  # monotonic time; see COMPACT_HOLD_OFF_S
        # The kept-alive connection (sender thread only), and what it has cost.
        self._conn: http.client.HTTPConnection | None = None
        self._conn_target: Endpoint | _Target = self._target  # where ``_conn`` goes
        self._tls_session: ssl.SSLSession | None = None
        self._connections = 0
        self._tls_resumed = 0

        # One lock guards the spool, the in-flight report and the counters.
        self._cond = threading.Condition()
        self._spool: deque[_Spooled] = deque()
        self._spool_bytes = 0
        # The report being POSTed is out of the spool; if the spool overflows meanwhile it is
        # "doomed": the oldest report, dropped unless this last attempt delivers it.
        self._inflight: _Spooled | None = None
        self._inflight_doomed = False
        self._sent = 0
        self._rejected = 0
        self._failed_attempts = 0
        self._spooled = 0
        self._dropped = 0
        self._last_success: float | None = None
        self._closing = False
        self._abort = False
        # Set by close() to cut a backoff pause short.
        self._interrupt = threading.Event()
        self._thread: threading.Thread | None = None
        self._consecutive_failures = 0

    # -- the caller's side -------------------------------------------------------------------

    def start(self) -> None:
        """Read the token file and start the sender thread (once; later calls do nothing)."""
        if self._thread is not None:
            return
        if self._token is not None:
            self._token.load()
        thread = threading.Thread(target=self._run, name="gpuwarden-shipper", daemon=True)
        self._thread = thread
        thread.start()
        log.info("shipping reports", extra={"aggregator": self._url, "max_spool": self._max_reports})

    def submit(self, report: Report) -> None:
        """Queue one report for delivery; never blocks on the network."""
        compact = self._compact
        item = _Spooled(
            body=encode_body(report, compact=compact), node=report.node, seq=report.seq, compact=compact
        )
        with self._cond:
            if self._closing:
                self._dropped += 1
                log.warning(
                    "report submitted after close, dropped",
                    extra={"report_node": item.node, "report_seq": item.seq},
                )
                return
            self._spool.append(item)
            self._spool_bytes += len(item.body)
            self._spooled += 1
            self._enforce_bound_locked()
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every spooled report is delivered or refused; False if time ran out.

        Starts the sender if ``start()`` was not called, so a one-shot run can just submit and
        flush.
        """
        self.start()
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while self._spool or self._inflight is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._abort:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting reports, keep delivering the spool for up to ``timeout_s``, then stop.

        A request already on the wire cannot be interrupted; it ends within the request timeout.
        """
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
            # Shutting down is worth one prompt try rather than waiting out a long backoff.
            self._interrupt.set()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, timeout_s))
            if thread.is_alive():
                with self._cond:
                    self._abort = True
                    self._interrupt.set()
                    self._cond.notify_all()
                thread.join(self._timeout_s + 1.0)
        with self._cond:
            left = len(self._spool) + (1 if self._inflight is not None else 0)
        if left:
            log.warning("shipper closed with reports undelivered", extra={"undelivered": left})

    def refusal(self) -> Refusal | None:
        """The last final refusal of the credentials (only with ``credentials_final``)."""
        with self._cond:
            return self._refusal

    def connections_opened(self) -> int:
        """Connections (TCP, and TLS handshakes over https) opened so far."""
        with self._cond:
            return self._connections

    def tls_sessions_resumed(self) -> int:
        """Reconnects whose TLS session was resumed (an abbreviated handshake)."""
        with self._cond:
            return self._tls_resumed

    def sends_compact(self) -> bool:
        """Whether reports now go in the compact encoding (what the aggregator last offered)."""
        return self._compact

    def stats(self) -> ShipperStats:
        with self._cond:
            return ShipperStats(
                sent_total=self._sent,
                rejected_total=self._rejected,
                failed_attempts_total=self._failed_attempts,
                spooled_total=self._spooled,
                dropped_total=self._dropped,
                spool_depth=len(self._spool) + (1 if self._inflight is not None else 0),
                last_success_time=self._last_success,
            )

    # -- the spool bound ---------------------------------------------------------------------

    def _over_bound_locked(self) -> bool:
        count = len(self._spool)
        size = self._spool_bytes
        if self._inflight is not None and not self._inflight_doomed:
            count += 1
            size += len(self._inflight.body)
        return count > self._max_reports or size > self._max_bytes

    def _enforce_bound_locked(self) -> None:
        while self._over_bound_locked():
            if self._inflight is not None and not self._inflight_doomed:
                self._inflight_doomed = True
                continue
            # The report just submitted always stays, even if it alone is over the byte bound.
            if len(self._spool) <= 1:
                return
            old = self._spool.popleft()
            self._spool_bytes -= len(old.body)
            self._dropped += 1
            self._log_dropped(old)

    def _log_dropped(self, item: _Spooled) -> None:
        log.warning(
            "spool full, oldest report dropped",
            extra={"report_node": item.node, "report_seq": item.seq, "dropped_total": self._dropped},
        )

    # -- the sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._send_loop()
        finally:
            self._drop_connection()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._spool and not self._closing:
                    self._cond.wait()
                if self._abort or not self._spool:
                    self._cond.notify_all()
                    return
                item = self._spool.popleft()
                self._spool_bytes -= len(item.body)
                self._inflight = item
                self._inflight_doomed = False
            answer = self._attempt(item)
            delay = self._settle(item, answer)
            if delay is not None and not self._pause(delay):
                return

    def _settle(self, item: _Spooled, answer: _Answer) -> float | None:
        """Book the answer for ``item``; the pause before the next attempt, or None for none."""
        with self._cond:
            doomed = self._inflight_doomed
            self._inflight = None
            self._inflight_doomed = False
            delay: float | None = None
            if answer.outcome is _Outcome.SENT:
                self._sent += 1
                self._last_success = self._clock.time()
            elif answer.outcome is _Outcome.REJECTED:
                self._rejected += 1
            elif answer.outcome is _Outcome.UNAUTHORIZED and self._credentials_final:
                self._rejected += 1
                self._refusal = Refusal(self._url, answer.status or 0, answer.reason)
            else:
                self._failed_attempts += 1
                if doomed:
                    self._dropped += 1
                    self._log_dropped(item)
                else:
                    self._spool.appendleft(item)
                    self._spool_bytes += len(item.body)
                delay = self._retry_delay(answer)
            self._cond.notify_all()
        self._log_answer(item, answer, delay)
        if delay is None:
            self._consecutive_failures = 0
        return delay

    def _retry_delay(self, answer: _Answer) -> float:
        self._consecutive_failures += 1
        exponent = min(self._consecutive_failures - 1, _BACKOFF_MAX_EXPONENT)
        cap = min(self._backoff_max_s, self._backoff_base_s * 2.0**exponent)
        delay = self._rng.uniform(0.0, cap)
        if answer.retry_after_s is not None:
            delay = max(delay, min(answer.retry_after_s, RETRY_AFTER_MAX_S))
        return delay

    def _pause(self, delay: float) -> bool:
        """Wait out a backoff; False when close() has run out of time and the sender must stop."""
        if self._backoff_wait is not None:
            self._backoff_wait(delay)
        else:
            self._interrupt.wait(delay)
        with self._cond:
            if self._abort:
                return False
            self._interrupt.clear()
            return True

    def _log_answer(self, item: _Spooled, answer: _Answer, delay: float | None) -> None:
        extra: dict[str, object] = {
            "report_node": item.node,
            "report_seq": item.seq,
            "http_status": answer.status,
            "server_reason": answer.reason,
        }
        if answer.outcome is _Outcome.SENT:
            if self._consecutive_failures:
                extra["failed_attempts"] = self._consecutive_failures
                log.info("aggregator reachable again", extra=extra)
            else:
                log.debug("report delivered", extra=extra)
        elif answer.outcome is _Outcome.REJECTED:
            log.error("aggregator refused report, dropped", extra=extra)
        elif answer.outcome is _Outcome.UNAUTHORIZED and self._credentials_final:
            log.error("aggregator refused the agent's token, report dropped", extra=extra)
        else:
            extra["retry_in_s"] = round(delay or 0.0, 3)
            extra["consecutive_failures"] = self._consecutive_failures
            # One warning when delivery starts failing; the retries of an outage go to debug.
            if self._consecutive_failures == 1:
                log.warning("report not delivered, will retry", extra=extra)
            else:
                log.debug("report not delivered, will retry", extra=extra)

    def _attempt(self, item: _Spooled) -> _Answer:
        token = self._token.current() if self._token is not None else None
        try:
            if item.compact and not self._compact:
                item = self._as_json(item)
            reply = self._post(item, token)
            if reply.status == 415 and item.compact:
                # The aggregator does not take this compact form after all (it was replaced by one
                # of another build): the same report as JSON, now, and JSON for a while.
                self._compact = False
                self._refused_until = self._clock.monotonic() + COMPACT_HOLD_OFF_S
                item = self._as_json(item)
                reply = self._post(item, token)
            if self._route.redirected():  # another shard owns our pool: to it, at once
                reply = self._post(item, token)
            status, retry_after, reason = reply.status, reply.retry_after, reply.reason
        except (OSError, http.client.HTTPException) as exc:
            # Connection refused, reset, DNS failure, timeout (TimeoutError is an OSError).
            self._route.failed(f"{type(exc).__name__}: {exc}")
            return _Answer(_Outcome.RETRY, reason=f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            # The sender thread must outlive anything; the report stays for the next try.
            log.exception("unexpected error sending report", extra={"report_seq": item.seq})
            return _Answer(_Outcome.RETRY, reason=f"{type(exc).__name__}: {exc}")
        outcome = _classify(status)
        if outcome is _Outcome.UNAUTHORIZED and self._token is not None:
            self._token.invalidate()
        return _Answer(
            outcome,
            status=status,
            reason=reason,
            retry_after_s=parse_retry_after(retry_after, self._clock.time()),
        )

    def _as_json(self, item: _Spooled) -> _Spooled:
        """``item`` re-encoded as JSON; the in-flight report's size in the spool bound follows."""
        try:
            body = _as_json_body(item.body)
        except (OSError, EOFError, ReportError) as exc:  # our own bytes: never, but never fatal
            raise http.client.HTTPException(f"cannot re-encode a spooled report: {exc}") from exc
        json_item = _Spooled(body=body, node=item.node, seq=item.seq, compact=False)
        with self._cond:
            if self._inflight is item:
                self._inflight = json_item
        return json_item

    def _post(self, item: _Spooled, token: str | None) -> _Reply:
        headers = {
            "Content-Type": COMPACT_MEDIA_TYPE if item.compact else JSON_MEDIA_TYPE,
            "User-Agent": f"gpuwarden-agent/{__version__}",
        }
        if not item.compact or COMPACT_GZIP:
            headers["Content-Encoding"] = "gzip"
        if token:
            headers["Authorization"] = f"Bearer {token}"
        for retry in (False, True):
            conn, reused = self._connection()
            try:
                conn.request("POST", self._conn_target.path, body=item.body, headers=headers)
                resp = conn.getresponse()
                self._route.saw(resp.status, resp.getheader("Location"), resp.getheader(SHARD_HEADER))
                raw = resp.read(_DRAIN_MAX_BYTES + 1)
            except (OSError, http.client.HTTPException):
                self._drop_connection()
                # A kept-alive connection the server closed while it idled fails on first use:
                # that is no failure of the aggregator, so once more on a fresh connection.
                if reused and not retry:
                    continue
                raise
            if not reused and isinstance(conn, _TlsConnection) and self._conn_target == self._target:
                self._note_tls(conn)
            if len(raw) > _DRAIN_MAX_BYTES or not resp.isclosed() or resp.will_close or conn.sock is None:
                # Connection: close, HTTP/1.0, or an answer not read to its end.
                self._drop_connection()
            reason = "" if 200 <= resp.status < 300 else raw[:_REASON_MAX_BYTES].decode("utf-8", "replace")
            accept_post = resp.getheader(ACCEPT_POST_HEADER)
            if self._negotiate:
                believed = self._clock.monotonic() >= self._refused_until
                self._compact = believed and offers_compact(accept_post)
            return _Reply(resp.status, resp.getheader("Retry-After"), reason.strip(), accept_post)
        raise AssertionError("unreachable: the second try returns or raises")

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """The kept-alive connection, or a new one; and whether it has carried a request before.
        A connection is to one place: when a shard's redirect (or the fall-back from one) changes
        where reports go, the kept one is dropped."""
        target = self._route.learned or self._target
        if self._conn is not None and target == self._conn_target:
            return self._conn, True
        self._drop_connection()
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = _TlsConnection(
                target.host,
                target.port,
                timeout=self._timeout_s,
                context=self._ssl,
                # A TLS session resumes only with the server that issued it.
                session=self._tls_session if target == self._target else None,
            )
        else:
            conn = http.client.HTTPConnection(target.host, target.port, timeout=self._timeout_s)
        # Connecting is left to the request, so a refused connection fails the attempt like before.
        self._conn = conn
        self._conn_target = target
        with self._cond:
            self._connections += 1
        return conn, False

    def _note_tls(self, conn: _TlsConnection) -> None:
        """After a new connection's first answer: was its session resumed, and keep the session
        for the next reconnect."""
        conn.note_session()
        if conn.resumed:
            with self._cond:
                self._tls_resumed += 1
        if conn.session is not None:
            self._tls_session = conn.session

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class ShipperFanout:
    """Every report to every aggregator replica: one ``Shipper`` (one spool, one thread) per URL.

    ``stats()`` sums the counters over the replicas (a report delivered to two replicas counts
    twice), reports the deepest spool, and the oldest of the replicas' last successes: an alert on
    delivery staleness then fires when any replica stops taking reports.
    """

    def __init__(self, shippers: Sequence[Shipper]) -> None:
        if not shippers:
            raise ConfigError("a fan-out needs at least one aggregator")
        self.shippers = list(shippers)

    def start(self) -> None:
        for shipper in self.shippers:
            shipper.start()

    def submit(self, report: Report) -> None:
        for shipper in self.shippers:
            shipper.submit(report)

    def flush(self, timeout_s: float) -> bool:
        """True when every replica has its spool delivered within ``timeout_s`` (shared)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        ok = True
        for shipper in self.shippers:
            ok = shipper.flush(max(0.0, deadline - time.monotonic())) and ok
        return ok

    def close(self, timeout_s: float = 5.0) -> None:
        # Closing one by one would give the last replica what the first left of the timeout.
        threads = [
            threading.Thread(target=shipper.close, args=(timeout_s,), daemon=True)
            for shipper in self.shippers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def refusal(self) -> Refusal | None:
        """The first replica's final refusal of the credentials, if any refused them."""
        return next((r for s in self.shippers if (r := s.refusal()) is not None), None)

    def stats(self) -> ShipperStats:
        all_stats = [shipper.stats() for shipper in self.shippers]
        successes = [s.last_success_time for s in all_stats]
        return ShipperStats(
            sent_total=sum(s.sent_total for s in all_stats),
            rejected_total=sum(s.rejected_total for s in all_stats),
            failed_attempts_total=sum(s.failed_attempts_total for s in all_stats),
            spooled_total=sum(s.spooled_total for s in all_stats),
            dropped_total=sum(s.dropped_total for s in all_stats),
            spool_depth=max(s.spool_depth for s in all_stats),
            last_success_time=None if None in successes else min(t for t in successes if t is not None),
        )
