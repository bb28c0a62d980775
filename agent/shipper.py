"""Delivers reports to the aggregator: gzip over HTTP, in order, through outages.

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
- any other 4xx (a schema error, 413): refused for good. Retrying could never succeed and would
  block every later report, so it is logged with the server's reason, counted, and dropped.
- 307/308 from a sharded aggregator naming the shard that owns the node's pool: sent there at
  once, and later reports too (agent/shardroute.py); back to the configured URL on errors.
- anything else (1xx, other 3xx: a wrong URL, most likely): kept and retried, so a configuration
  mistake fixed by an operator loses nothing.

With several aggregator replicas (``--aggregator`` repeated) ``ShipperFanout`` gives each its
own ``Shipper``: its own spool and sender thread, so a replica that is down or slow never delays
the reports to the others, and each replica sees the same reports in the same order.

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
from typing import Final

from agent import __version__
from agent.clock import Clock
from agent.errors import ConfigError
from agent.report import Report, encode
from agent.shardroute import SHARD_HEADER, ShardRoute
from agent.state import ShipperStats

log = logging.getLogger(__name__)

REPORTS_PATH: Final = "/v1/reports"
# A server asking for an hour's pause would let the spool overflow and silence the node; past this
# the agent retries anyway, and the aggregator can say Retry-After again.
RETRY_AFTER_MAX_S: Final = 300.0
# Enough of an error body to log the server's reason, never a whole HTML error page.
_REASON_MAX_BYTES: Final = 2048
# Bounds the exponent so 2**n stays a small float however long an outage lasts.
_BACKOFF_MAX_EXPONENT: Final = 32


def encode_body(report: Report) -> bytes:
    """The report as it goes on the wire: compact JSON, gzip-compressed."""
    # mtime=0: the same report always compresses to the same bytes.
    return gzip.compress(encode(report), compresslevel=6, mtime=0)


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
    ) -> None:
        """``credentials_final``: a 401 or 403 drops the report instead of retrying (``--once``)."""
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
        item = _Spooled(body=encode_body(report), node=report.node, seq=report.seq)
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
            status, retry_after, reason = self._post(item.body, token)
            if self._route.redirected():  # another shard owns our pool: to it, at once
                status, retry_after, reason = self._post(item.body, token)
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

    def _post(self, body: bytes, token: str | None) -> tuple[int, str | None, str]:
        conn: http.client.HTTPConnection
        target = self._route.learned or self._target
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(
                target.host, target.port, timeout=self._timeout_s, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(target.host, target.port, timeout=self._timeout_s)
        headers = {
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
            "User-Agent": f"gpuwarden-agent/{__version__}",
        }
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request("POST", target.path, body=body, headers=headers)
            resp = conn.getresponse()
            self._route.saw(resp.status, resp.getheader("Location"), resp.getheader(SHARD_HEADER))
            raw = resp.read(_REASON_MAX_BYTES)
            reason = "" if 200 <= resp.status < 300 else raw.decode("utf-8", "replace").strip()
            return resp.status, resp.getheader("Retry-After"), reason
        finally:
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
