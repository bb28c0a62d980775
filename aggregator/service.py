"""The aggregator's HTTP service: report ingestion, health checks, metrics and the read API.

Endpoints:

- ``POST /v1/reports``: one report (``Content-Type: application/json``, or the compact encoding
  ``application/msgpack`` of ``agent.wire``; optionally ``Content-Encoding: gzip``) with
  ``Authorization: Bearer <token>``. Every answer, and ``OPTIONS /v1/reports``, carries
  ``Accept-Post: application/json, application/msgpack; layout=<digest>``: an agent sends the
  compact form only to an aggregator that names its own layout there, so a new agent and an old
  aggregator (or two builds whose columns differ) speak JSON. 200 ``{"status":
  "accepted"}`` or ``{"status": "duplicate"}`` (same node, boot_id and seq seen before: nothing is
  processed twice, so an agent's retry is harmless). A report that caused decisions is answered
  once they are fsync'd (``aggregator.decisions``): a 200 survives a power loss.
- ``GET /healthz`` (the process answers), ``GET /readyz`` (rules loaded, decision log writable:
  whatever the readiness callable says), ``GET /metrics`` (Prometheus text).
- ``GET /api/v1/nodes``, ``GET /api/v1/nodes/{node}``, ``GET /api/v1/decisions?since=&limit=``.

Who may read: every ``GET``/``HEAD`` outside the agents' own ``/v1/`` API (which checks node
tokens itself) needs a *viewer* token (``aggregator.auth``: node placement and evidence are not
for anyone who can reach the port): the read API, ``/api/v1/remediation``, the status page at
``/`` and ``/metrics`` (unless ``server.metrics_public``). An admin token (``--admin-token-file``) reads
too. ``/healthz`` and ``/readyz`` answer anyone (the kubelet's probes carry no token). A missing
or unknown token is 401, a node's token 403.

Every refusal is a JSON body ``{"error": <reason code>, "message": <text for a human>}`` (a path
with no route too: ``not_found``, ``method_not_allowed``, not counted below; only a request
aiohttp's HTTP parser cannot read gets its plain-text 400, counted by aggregator/httplog.py). The
reason codes of ``/v1/reports`` are ``aggregator.metrics.REJECT_REASONS`` and count in
``gpuwarden_aggregator_reports_rejected_total{reason}``:

====  ==========================  =======================================================
401   missing_token, bad_token    no/unknown bearer token (agents keep the report and retry)
400   duplicate_authorization     two Authorization headers (one value: RFC 9110)
403   forbidden                   a valid token that may not send reports
403   node_mismatch, node_unbound the token is another node's, or bound to no node
415   unsupported_media_type      not JSON or msgpack, a JSON charset other than UTF-8, or a
                                  compact report in another build's column layout
415   unsupported_encoding        a Content-Encoding other than gzip or identity
413   body_too_large              over ``ingest.max_body_bytes`` as received
413   decompressed_too_large      gzip inflating past ``ingest.max_decompressed_bytes``
400   incomplete_body             the connection broke before the whole body arrived
400   bad_gzip, bad_json          not gzip / not JSON (NaN and Infinity are not JSON)
400   bad_msgpack                 a compact report that is not msgpack
400   wrong_schema_version        ``schema`` is not ``gpuwarden/report/v1``
422   schema_violation            valid JSON or msgpack that breaks the schema (a compact row with the
                                  wrong number of columns, NaN in msgpack); the message names the field
422   implausible_value           in the schema, but not physically possible (``plausibility_errors``)
422   over_cap                    more NICs, GPUs, NVLinks or probe peers than one node can hold
408   body_timeout                the body did not arrive within ``server.body_timeout_seconds``
429   too_many_requests           this token already has ``server.max_in_flight_per_token`` requests
503   overloaded                  ``server.max_in_flight`` requests in flight (with Retry-After)
503   auth_unavailable            the token could not be checked (Kubernetes API unreachable)
500   internal_error              the pipeline failed on a valid report (logged with its trace)
====  ==========================  =======================================================

With sharding, a report whose pool another shard owns is answered ``307`` with ``Location``
naming that shard (aggregator/shard/router.py): not ingested, not counted as refused.

Hostile input is bounded before it costs anything: authentication happens before the body is
read (and, for ``Expect: 100-continue``, before the body is asked for: a request that would be
refused for its load, token, media type or declared length gets that answer instead of 100),
the body is counted while it streams in, and gzip is inflated by a bounded decompressor, so a
bomb is refused after ``max_decompressed_bytes`` of output however far it would expand. None of it
reaches the pipeline. Load is bounded too (``ServerConfig``): a request beyond ``max_in_flight``
is shed with 503 and Retry-After before its body is read (agents back off and retry), one token
holds at most ``max_in_flight_per_token`` of them, a body must arrive within
``body_timeout_seconds``, an idle connection or one that sends its headers slowly is closed after
``idle_timeout_seconds``, and the listener (aggregator/listener.py) keeps the connection count
below the file limit. Refusals are logged at most once per reason every few seconds, counted.

The pipeline is only ever called from the event loop's thread, so it needs
no locks: ingestion and the periodic ``advance`` never run at the same time. The one piece of work
that leaves the loop, an ``OffloadableStep`` of the periodic cycle (a pool run of the forest, peer
or trend detector), reads only a copy made for it and hands its result back to the loop.

A node's clock does not matter for liveness: the pipeline gets the aggregator's receive time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import operator
import signal
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Final, Protocol, runtime_checkable

import msgspec
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from agent.errors import ReportError
from agent.report import CATALOGUE, SCHEMA_ID, Gpu, Nic, Probe, Report, decode
from agent.wire import (
    ACCEPT_POST_HEADER,
    COMPACT_MEDIA_TYPE,
    COMPACT_MEDIA_TYPES,
    JSON_MEDIA_TYPE,
    LAYOUT,
    LayoutError,
    NotCompactError,
    WrongSchemaError,
    decode_compact,
)
from aggregator import httplog
from aggregator.auth import (
    Authenticator,
    AuthError,
    AuthUnavailable,
    Identity,
    SupportsClose,
    authorization,
    bearer_token,
    reader_token,
)
from aggregator.config import Config, IngestConfig, ServerConfig
from aggregator.decisions import DecisionLog
from aggregator.eventloop import loop_name
from aggregator.listener import Busy, CappedSite, connection_cap, raise_file_limit, tls_context, watch_tls
from aggregator.metrics import LOOP_LAG_WINDOW_SECONDS, Metrics
from aggregator.model import IngestOutcome
from aggregator.ratelog import RateLimitedLog
from aggregator.web import is_page, status_routes
from aggregator.web.status import OtherShards

log = logging.getLogger(__name__)

__all__ = [
    "EARLIEST_PLAUSIBLE_TIME",
    "MAX_CLOCK_AHEAD_SECONDS",
    "METRICS_KEY",
    "PIPELINE_KEY",
    "REPORTS_PATH",
    "SERVER_KWARGS",
    "IngestOutcome",
    "PipelineLike",
    "Readiness",
    "Route",
    "advance_periodically",
    "cap_errors",
    "create_app",
    "gunzip_bounded",
    "plausibility_errors",
    "serve",
    "server_kwargs",
]

REPORTS_PATH: Final = "/v1/reports"
EARLIEST_PLAUSIBLE_TIME: Final = 1_577_836_800.0  # 2020-01-01T00:00:00Z, before any gpuwarden
MAX_CLOCK_AHEAD_SECONDS: Final = 86_400.0
# The aiohttp server must hand the handler the body as sent: with its default automatic
# decompression the gzip bomb guard would only ever see inflated bytes. serve() uses these; a test
# server must too (aiohttp_client(app, server_kwargs=SERVER_KWARGS)).
SERVER_KWARGS: Final[dict[str, Any]] = {"auto_decompress": False}


def server_kwargs(config: ServerConfig) -> dict[str, Any]:
    """``SERVER_KWARGS`` and the keep-alive timeout: aiohttp arms it when a connection opens and
    after each answer, and closes a connection still without a whole request when it fires, so it
    is both the idle and the header deadline. No lingering: after a refusal aiohttp would keep
    reading (and discarding) the rest of the body for 10 s, which a slow sender stretches to 10 s
    of holding the connection after its 408."""
    return {**SERVER_KWARGS, "keepalive_timeout": config.idle_timeout_seconds, "lingering_time": 0.0}


_GZIP_MAGIC: Final = b"\x1f\x8b"
_DEFAULT_DECISIONS_LIMIT: Final = 1000
_MAX_DECISIONS_LIMIT: Final = 10_000
_MESSAGE_MAX_CHARS: Final = 1000


class PipelineLike(Protocol):
    def ingest(self, report: Report, received: float) -> IngestOutcome: ...

    def advance(self, now: float) -> None:
        """Time-driven detection (silence, fleet-wide detectors); called about once a second."""
        ...

    def nodes(self) -> list[dict[str, Any]]:
        """JSON-ready summaries of every known node (``GET /api/v1/nodes``)."""
        ...

    def node(self, name: str) -> dict[str, Any] | None:
        """State, reasons with evidence and recent history of one node; None if unknown."""
        ...

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        """Decision records with ``time >= since``, oldest first, at most ``limit``."""
        ...

    def node_states(self) -> dict[str, int]:
        """Health state -> number of nodes in it (for ``gpuwarden_aggregator_nodes``)."""
        ...


# With sharding (aggregator/shard/router.py): None when this shard owns the report's pool, else
# the answer that sends the agent to the owner.
Route = Callable[[Report], web.Response | None]

# Problems that keep the aggregator from doing its job (rules not loaded, decision log not
# writable); empty when ready.
Readiness = Callable[[], Sequence[str]]

PIPELINE_KEY: Final = web.AppKey("pipeline", PipelineLike)
METRICS_KEY: Final = web.AppKey("metrics", Metrics)
# The server's limits and TLS files travel with the app, so whoever serves it serves it right.
SERVER_CONFIG_KEY: Final = web.AppKey("server_config", ServerConfig)
BUSY_KEY: Final = web.AppKey("busy", Busy)


# -- plausibility ---------------------------------------------------------------------------------


# (field, lowest, highest) of every field the catalogue gives a physical range (agent/report.py),
# per struct. ``not lo <= v <= hi`` is also true for NaN, so one comparison refuses NaN and inf.
# The 64-bit bound of counters is in their type: ``decode`` refuses an oversized one already.
class _Ranges:
    """The ranged fields of one struct type, read all at once (``attrgetter`` works in C)."""

    def __init__(self, struct: type[msgspec.Struct]) -> None:
        self.bounds = tuple(
            (name, info.plausible) for name, info in CATALOGUE[struct].items() if info.plausible is not None
        )
        names = tuple(name for name, _ in self.bounds)
        self.get: Callable[[Any], tuple[Any, ...]] = (
            operator.attrgetter(*names) if len(names) > 1 else lambda obj: (getattr(obj, names[0]),)
        )

    def check(self, errors: list[str], path: str, obj: msgspec.Struct) -> None:
        for (name, (lo, hi)), value in zip(self.bounds, self.get(obj), strict=True):
            if value is not None and not lo <= value <= hi:
                errors.append(f"{path}.{name}: {value!r} is outside the plausible range {lo:g}..{hi:g}")


_GPU_RANGES: Final = _Ranges(Gpu)
_NIC_RANGES: Final = _Ranges(Nic)
_PROBE_RANGES: Final = _Ranges(Probe)


def _check_range(
    errors: list[str], path: str, name: str, value: float | None, bounds: tuple[float, float]
) -> None:
    lo, hi = bounds
    if value is not None and not lo <= value <= hi:
        errors.append(f"{path}.{name}: {value!r} is outside the plausible range {lo:g}..{hi:g}")


def _check_time(errors: list[str], path: str, value: float, latest: float | None) -> None:
    if not math.isfinite(value):
        errors.append(f"{path}: {value!r} is not a finite number of unix seconds")
    elif value < EARLIEST_PLAUSIBLE_TIME:
        errors.append(f"{path}: {value!r} is before 2020 (unix seconds)")
    elif latest is not None and value > latest:
        errors.append(f"{path}: {value!r} is more than a day ahead of the aggregator's clock")


def plausibility_errors(report: Report, *, now: float | None = None) -> list[str]:
    """What in a schema-valid report cannot be true, one message per problem naming the field.

    Ranges are physical limits, generous on purpose: a hot GPU is evidence for the detectors, a
    900 degree one is a broken sender; they are the field catalogue's (agent/report.py), and
    counters fit 64 bits by their type. Times must be after 2020 and, when ``now`` (the server's
    clock) is given, at most a day ahead of it; replay, which has no server clock, passes None.
    GPU indices and UUIDs, NVLink numbers within a GPU and NIC ports must be unique, or
    the node's history would mix two devices. An empty UUID is not one: it is what an agent sends
    for a GPU whose UUID NVML would not give (the schema's "unknown"), and several GPUs needing a
    reset at once must not cost the node its whole report.
    """
    errors: list[str] = []
    latest = None if now is None else now + MAX_CLOCK_AHEAD_SECONDS
    _check_time(errors, "$.time", report.time, latest)
    interval = report.interval_seconds
    if isinstance(interval, float):
        _check_range(errors, "$", "interval_seconds", interval, (1e-3, MAX_CLOCK_AHEAD_SECONDS))

    indices: set[int] = set()
    uuids: set[str] = set()
    for i, gpu in enumerate(report.gpus):
        if gpu.index in indices:
            errors.append(f"$.gpus[{i}].index: GPU {gpu.index} appears twice")
        if gpu.uuid in uuids:
            errors.append(f"$.gpus[{i}].uuid: {gpu.uuid!r} appears twice")
        indices.add(gpu.index)
        if gpu.uuid:
            uuids.add(gpu.uuid)
        _GPU_RANGES.check(errors, f"$.gpus[{i}]", gpu)
        if gpu.nvlink and len({link.link for link in gpu.nvlink}) != len(gpu.nvlink):
            links: set[int] = set()
            for j, link in enumerate(gpu.nvlink):
                if link.link in links:
                    errors.append(f"$.gpus[{i}].nvlink[{j}].link: link {link.link} appears twice")
                links.add(link.link)

    ports: set[tuple[str, int | None]] = set()
    for i, nic in enumerate(report.nics):
        if (nic.device, nic.port) in ports:
            errors.append(f"$.nics[{i}]: device {nic.device!r} port {nic.port} appears twice")
        ports.add((nic.device, nic.port))
        _NIC_RANGES.check(errors, f"$.nics[{i}]", nic)

    for i, event in enumerate(report.events or ()):
        _check_time(errors, f"$.events[{i}].time", event.time, latest)
    for i, probe in enumerate(report.probes or ()):
        _check_time(errors, f"$.probes[{i}].time", probe.time, latest)
        _PROBE_RANGES.check(errors, f"$.probes[{i}]", probe)
    return errors


def cap_errors(report: Report, caps: IngestConfig) -> list[str]:
    """What in a report is more than one node can hold (``ingest.max_*``): a node's state is
    bounded by these, whatever its token sends."""
    errors: list[str] = []
    if len(report.gpus) > caps.max_gpus:
        errors.append(f"$.gpus: {len(report.gpus)} GPUs, a node holds at most {caps.max_gpus}")
    for i, gpu in enumerate(report.gpus):
        if gpu.nvlink and len(gpu.nvlink) > caps.max_nvlinks_per_gpu:
            errors.append(
                f"$.gpus[{i}].nvlink: {len(gpu.nvlink)} links, a GPU has at most {caps.max_nvlinks_per_gpu}"
            )
    if len(report.nics) > caps.max_nics:
        errors.append(f"$.nics: {len(report.nics)} NICs, a node holds at most {caps.max_nics}")
    if report.probes:
        peers = {p.peer for p in report.probes if p.peer is not None}
        if len(peers) > caps.max_probe_peers:
            errors.append(f"$.probes: {len(peers)} peers, a report names at most {caps.max_probe_peers}")
    return errors


# -- body handling --------------------------------------------------------------------------------


class _Reject(Exception):
    """A refusal: the status, the reason code and the message the client gets."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


class DecompressedTooLarge(ValueError):
    """The gzip data inflates past the limit (a gzip bomb, or a report far too big)."""


def gunzip_bounded(data: bytes, limit: int) -> bytes:
    """Inflate gzip ``data`` (one or more members), never producing more than ``limit`` + 1 bytes.

    Raises ``DecompressedTooLarge`` past ``limit`` and ``ValueError`` for data that is not
    complete gzip. Each ``decompress`` call is capped with ``max_length``, so a bomb costs at most
    ``limit`` bytes of memory and the CPU to inflate them, whatever its ratio.
    """
    out: list[bytes] = []
    produced = 0
    pending = data
    while True:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            while pending:
                chunk = inflater.decompress(pending, limit + 1 - produced)
                produced += len(chunk)
                if produced > limit:
                    raise DecompressedTooLarge(f"decompresses to more than {limit} bytes")
                out.append(chunk)
                pending = inflater.unconsumed_tail
                if inflater.eof:
                    break
        except zlib.error as exc:
            raise ValueError(f"not valid gzip data: {exc}") from exc
        if not inflater.eof:
            raise ValueError("gzip data is truncated")
        # Concatenated gzip members are one stream (RFC 1952 section 2.2).
        pending = inflater.unused_data
        if not pending:
            return b"".join(out)


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


# What POST /v1/reports takes, on every answer of it: agents choose their encoding by it.
ACCEPT_POST: Final = f"{JSON_MEDIA_TYPE}, {COMPACT_MEDIA_TYPE}; layout={LAYOUT}"
_ACCEPTED_BODY: Final = msgspec.json.encode({"status": IngestOutcome.ACCEPTED.value})
_DUPLICATE_BODY: Final = msgspec.json.encode({"status": IngestOutcome.DUPLICATE.value})


class _Ingest:
    """``POST /v1/reports``: read, decompress, decode, check, ingest; nothing else on this path."""

    def __init__(
        self,
        pipeline: PipelineLike,
        authenticator: Authenticator,
        config: Config,
        clock: Clock,
        metrics: Metrics,
        *,
        decisions: DecisionLog | None,
        route: Route | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._route = route
        self._auth = authenticator
        self._caps = config.ingest
        self._max_body = config.ingest.max_body_bytes
        self._max_inflated = config.ingest.max_decompressed_bytes
        self._clock = clock
        self._metrics = metrics
        self._reject_log = RateLimitedLog(log, monotonic=clock.monotonic)
        server = config.server
        self._max_in_flight = server.max_in_flight
        self._max_wait = server.max_wait_seconds
        self._max_per_token = server.max_in_flight_per_token
        self._retry_after = str(server.retry_after_seconds)
        self._body_timeout = server.body_timeout_seconds
        self._in_flight = 0
        self._per_token: dict[str, int] = {}  # subject -> requests in flight; only non-zero kept
        # A 200 is a promise that the report's decisions survive a power loss: wait for their fsync
        # (the log the pipeline writes to; None where there is no file to wait for).
        self._decisions = decisions

    async def handle(self, request: web.Request) -> web.Response:
        resp = await self._handle_in_turn(request)
        resp.headers[ACCEPT_POST_HEADER] = ACCEPT_POST
        return resp

    async def expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: a request that would be refused gets its refusal now, before
        its body is sent (RFC 9110 10.1.1); aiohttp's default answers 100 to anything, inviting
        a body of any size from anyone. Checked: the load, the token, the media type and the
        declared length; the rest, as for any request, once the body is in."""
        subject: str | None = None
        try:
            if (shed := self._overloaded()) is not None:
                raise shed
            identity = await self._authenticate(request)
            subject = identity.subject
            self._admit(request, identity)
        except _Reject as rej:
            resp = self._refuse(request, rej, None, subject)
            resp.headers[ACCEPT_POST_HEADER] = ACCEPT_POST
            # The client may or may not send the body it announced (RFC 9110 10.1.1): closing is
            # the one way the next request on the connection is not read as that body.
            resp.force_close()
            return resp
        if request.version != HttpVersion11:
            return None  # HTTP/1.0 has no 100: the expectation is ignored (RFC 9110 10.1.1)
        if request.headers.get("Expect", "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(
                text=f"unknown Expect: {request.headers.get('Expect', '')[:64]!r}"
            )
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started (aiohttp's own handler)
        return None

    def _overloaded(self) -> _Reject | None:
        """The refusal of a request beyond ``max_in_flight``, if this one is."""
        if self._in_flight < self._max_in_flight:
            return None
        return _Reject(503, "overloaded", f"{self._max_in_flight} reports in flight; retry later")

    def _admit(self, request: web.Request, identity: Identity) -> tuple[bool, bool]:
        """What is decided before a byte of the body is read (or, with ``Expect``, asked for): a
        token bound to a node (a reader's costs no gunzip or decode), a media type this endpoint
        speaks and a declared length within the limit. (compact, gzip) of the body."""
        if identity.node is None:
            raise _Reject(403, "node_unbound", f"the token of {identity.subject} is not bound to a node")
        compact, gzipped = self._check_headers(request)
        length = request.content_length
        if length is not None and length > self._max_body:
            raise _Reject(
                413, "body_too_large", f"the body is {length} bytes, the limit is {self._max_body} bytes"
            )
        return compact, gzipped

    async def _handle_in_turn(self, request: web.Request) -> web.Response:
        if (shed := self._overloaded()) is not None:
            # Shed before anything is read: the cheapest answer, and agents retry after the pause.
            return self._refuse(request, shed, None, None)
        self._in_flight += 1
        try:
            # A whole request already buffered would otherwise run to its end without yielding,
            # so a burst would never be seen: each waits its turn here, counted, and how long the
            # turn took is how far behind the loop is. Past max_wait it is shed too, so a burst
            # is answered in about max_wait per loop turn instead of queueing for seconds.
            loop = asyncio.get_running_loop()
            queued_at = loop.time()
            await asyncio.sleep(0)
            waited = loop.time() - queued_at
            if waited > self._max_wait:
                return self._refuse(
                    request,
                    _Reject(503, "overloaded", f"the aggregator is {waited:.2f} s behind; retry later"),
                    None,
                    None,
                )
            return await self._handle(request)
        finally:
            self._in_flight -= 1

    async def _handle(self, request: web.Request) -> web.Response:
        node: str | None = None
        subject: str | None = None
        try:
            identity = await self._authenticate(request)
            subject = identity.subject
            compact, gzipped = self._admit(request, identity)
            held = self._per_token.get(subject, 0)
            if held >= self._max_per_token:
                raise _Reject(
                    429, "too_many_requests", f"{held} reports of this token are in flight; retry later"
                )
            self._per_token[subject] = held + 1
            try:
                body = await self._read_body_in_time(request)
            finally:
                left = self._per_token[subject] - 1
                if left:
                    self._per_token[subject] = left
                else:
                    del self._per_token[subject]
            started = time.perf_counter()
            report = self._parse(body, gzipped, compact)
            node = report.node
            if identity.node != report.node:
                raise _Reject(
                    403,
                    "node_mismatch",
                    f"the token is for node {identity.node}, the report is from {report.node}",
                )
            if self._route is not None and (moved := self._route(report)) is not None:
                return moved  # another shard owns its pool: redirected there, not ingested
            problems = plausibility_errors(report, now=self._clock.time())
            if problems:
                raise _Reject(422, "implausible_value", "; ".join(problems)[:_MESSAGE_MAX_CHARS])
            over = cap_errors(report, self._caps)
            if over:
                raise _Reject(422, "over_cap", "; ".join(over)[:_MESSAGE_MAX_CHARS])
            try:
                before = self._decisions.appended if self._decisions is not None else 0
                outcome = self._pipeline.ingest(report, self._clock.time())
            except Exception:
                self._metrics.rejected("internal_error")
                self._reject_log.warning(
                    "internal_error",
                    "report refused: the pipeline failed to ingest a valid report",
                    extra={"reason": "internal_error", "report_node": node, "report_seq": report.seq},
                    exc_info=True,
                )
                return _json(500, {"error": "internal_error", "message": "the report could not be processed"})
        except _Reject as rej:
            return self._refuse(request, rej, node, subject)
        self._metrics.ingest_seconds(time.perf_counter() - started)
        if self._decisions is not None and self._decisions.appended != before:
            await self._decisions.synced(self._decisions.appended)
        if outcome is IngestOutcome.DUPLICATE:
            self._metrics.duplicate()
            body_out = _DUPLICATE_BODY
        else:
            self._metrics.accepted()
            body_out = _ACCEPTED_BODY
        return web.Response(body=body_out, content_type="application/json")

    def _refuse(
        self, request: web.Request, rej: _Reject, node: str | None, subject: str | None
    ) -> web.Response:
        self._metrics.rejected(rej.reason)
        self._reject_log.warning(
            rej.reason,
            "report refused: %s",
            rej.message,
            extra={
                "reason": rej.reason,
                "http_status": rej.status,
                "report_node": node,
                "subject": subject,
                "remote": request.remote,
            },
        )
        resp = _json(rej.status, {"error": rej.reason, "message": rej.message})
        if rej.status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="gpuwarden"'
        if rej.status in (429, 503):
            resp.headers["Retry-After"] = self._retry_after
        if rej.status == 413 or (rej.status in (408, 429, 503) and not request.content.at_eof()):
            # The rest of a body that was not read is not worth keeping the connection for.
            resp.force_close()
        return resp

    async def _authenticate(self, request: web.Request) -> Identity:
        try:
            return await self._auth.authenticate(bearer_token(authorization(request.headers)))
        except AuthError as exc:
            raise _Reject(exc.status, exc.reason, str(exc)) from exc
        except AuthUnavailable as exc:
            raise _Reject(503, "auth_unavailable", f"the token cannot be checked now: {exc}") from exc

    @staticmethod
    def _check_headers(request: web.Request) -> tuple[bool, bool]:
        """(compact, gzip) of the body; refuses what this endpoint does not speak."""
        ctype = request.content_type.lower()
        compact = ctype in COMPACT_MEDIA_TYPES
        if not compact and ctype != JSON_MEDIA_TYPE:
            raise _Reject(
                415,
                "unsupported_media_type",
                f"Content-Type must be {JSON_MEDIA_TYPE} or {COMPACT_MEDIA_TYPE}, got {ctype[:64]!r}",
            )
        charset = request.charset
        if not compact and charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise _Reject(415, "unsupported_media_type", f"the charset must be UTF-8, got {charset!r}")
        # Two header lines are one list (RFC 9110 5.3): "identity" then "gzip" is "identity, gzip".
        encoding = ", ".join(request.headers.getall("Content-Encoding", ())).strip().lower()
        if encoding in ("gzip", "x-gzip"):
            return compact, True
        if encoding in ("", "identity"):
            return compact, False
        raise _Reject(
            415, "unsupported_encoding", f"Content-Encoding must be gzip or absent, got {encoding[:64]!r}"
        )

    async def _read_body_in_time(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self._body_timeout):
                return await self._read_body(request)
        except TimeoutError:
            raise _Reject(
                408, "body_timeout", f"the body did not arrive within {self._body_timeout:g} seconds"
            ) from None

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self._max_body  # the declared length was checked already (``_admit``)
        # Counted as it arrives too: chunked bodies have no Content-Length, and a sender may lie.
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                chunk = await request.content.readany()
            except (web.RequestPayloadError, ConnectionError) as exc:
                # The sender hung up or broke the framing mid-body; nobody may hear the answer,
                # but it is counted like any other refusal.
                raise _Reject(400, "incomplete_body", f"the body did not arrive whole: {exc}") from None
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise _Reject(413, "body_too_large", f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _parse(self, body: bytes, gzipped: bool, compact: bool) -> Report:
        if gzipped:
            if not body.startswith(_GZIP_MAGIC):
                raise _Reject(400, "bad_gzip", "Content-Encoding is gzip but the body is not gzip data")
            try:
                body = gunzip_bounded(body, self._max_inflated)
            except DecompressedTooLarge:
                raise _Reject(
                    413,
                    "decompressed_too_large",
                    f"the body decompresses to more than {self._max_inflated} bytes",
                ) from None
            except ValueError as exc:
                raise _Reject(400, "bad_gzip", str(exc)) from None
        elif len(body) > self._max_inflated:
            raise _Reject(
                413, "decompressed_too_large", f"the report is over the limit of {self._max_inflated} bytes"
            )
        if compact:
            return self._parse_compact(body)
        try:
            return decode(body)
        except ReportError as exc:
            raise self._classify(body, exc) from None
        except RecursionError:
            raise _Reject(400, "bad_json", "the JSON is nested too deeply") from None
        except Exception as exc:
            # Whatever else the decoder raises on bytes from the network is the sender's fault:
            # never a 500 (with a trace in the log) for a body anyone can send.
            raise _Reject(400, "bad_json", f"the body could not be parsed: {type(exc).__name__}") from None

    @staticmethod
    def _parse_compact(body: bytes) -> Report:
        try:
            return decode_compact(body)
        except LayoutError as exc:
            # The agent falls back to JSON on a 415 (agent/shipper.py).
            raise _Reject(415, "unsupported_media_type", str(exc)[:_MESSAGE_MAX_CHARS]) from None
        except WrongSchemaError as exc:
            raise _Reject(400, "wrong_schema_version", str(exc)[:_MESSAGE_MAX_CHARS]) from None
        except NotCompactError as exc:
            raise _Reject(400, "bad_msgpack", str(exc)[:_MESSAGE_MAX_CHARS]) from None
        except ReportError as exc:
            raise _Reject(422, "schema_violation", str(exc)[:_MESSAGE_MAX_CHARS]) from None
        except RecursionError:
            raise _Reject(400, "bad_msgpack", "the msgpack is nested too deeply") from None
        except Exception as exc:
            # As for JSON: bytes from the network never make a 500.
            raise _Reject(400, "bad_msgpack", f"the body could not be parsed: {type(exc).__name__}") from None

    @staticmethod
    def _classify(body: bytes, exc: ReportError) -> _Reject:
        """Which refusal a decode error is; only runs for bad reports, never on the hot path."""
        if not isinstance(exc.__cause__, msgspec.ValidationError):
            return _Reject(400, "bad_json", str(exc)[:_MESSAGE_MAX_CHARS])
        # A newer agent's report fails on its first unknown field; what matters is its version.
        try:
            version = msgspec.json.decode(body, type=_Version).schema
        except (msgspec.DecodeError, RecursionError):
            version = SCHEMA_ID
        if isinstance(version, str) and version != SCHEMA_ID:
            return _Reject(
                400,
                "wrong_schema_version",
                f"report schema {version[:64]!r} is not supported; this aggregator accepts {SCHEMA_ID!r}",
            )
        return _Reject(422, "schema_violation", str(exc)[:_MESSAGE_MAX_CHARS])


class _Version(msgspec.Struct):
    schema: object = None


async def _options(request: web.Request) -> web.Response:
    """What a POST to /v1/reports may carry, for an agent that asks before it sends."""
    return web.Response(status=204, headers={ACCEPT_POST_HEADER: ACCEPT_POST, "Allow": "OPTIONS, POST"})


# -- the read API, health and metrics -------------------------------------------------------------


# What the router answers when no route matches the path, or none the method: as JSON like every
# other refusal (aiohttp's own is "404: Not Found" as text).
_ROUTING_REASONS: Final = {404: "not_found", 405: "method_not_allowed"}


@web.middleware
async def _routing_refusals(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    refusal = request.match_info.http_exception
    if refusal is None:
        return await handler(request)
    reason = _ROUTING_REASONS.get(refusal.status, "bad_request")
    message = f"no route for {request.method} {request.path[:128]}"
    resp = _json(refusal.status, {"error": reason, "message": message})
    if (allow := refusal.headers.get("Allow")) is not None:
        resp.headers["Allow"] = allow  # 405: the methods there are
    return resp


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """``Server: gpuwarden``: the product, not the versions of Python and aiohttp behind it."""
    response.headers["Server"] = "gpuwarden"


def _bad_request(message: str) -> web.Response:
    return _json(400, {"error": "bad_request", "message": message})


def _pipeline_call(what: str, call: Callable[[], object]) -> web.Response:
    try:
        return _json(200, call())
    except Exception:
        log.exception("read API call failed", extra={"endpoint": what})
        return _json(500, {"error": "internal_error", "message": f"{what} failed"})


_OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
_AGENT_API_PREFIX: Final = "/v1/"  # reports and probes: node tokens, checked by their handlers


def _read_guard(
    authenticator: Authenticator | None,
    *,
    metrics_public: bool,
    status_page_public: bool,
    clock: Clock,
    admin_tokens: Sequence[str],
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware: reads need a viewer or an admin token (see the module docstring). Without an
    authenticator (``gpuwarden replay --serve``: a read-only view of a trace file, no tokens to
    check) every read is open: that command is meant for the operator's own machine."""
    if authenticator is None:

        @web.middleware
        async def open_reads(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            return await handler(request)

        return open_reads
    reject_log = RateLimitedLog(log, monotonic=clock.monotonic)
    admins = [hashlib.sha256(t.encode()).digest() for t in admin_tokens]
    open_paths = _OPEN_PATHS | ({"/metrics"} if metrics_public else set())

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        path = request.path
        if (
            request.method not in ("GET", "HEAD")
            or path in open_paths
            or path.startswith(_AGENT_API_PREFIX)
            or request.match_info.http_exception is not None  # no such route: its 404 tells nothing
            or (status_page_public and is_page(path))
        ):
            return await handler(request)
        try:
            token = reader_token(authorization(request.headers))
            digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
            if any(hmac.compare_digest(digest, a) for a in admins):
                return await handler(request)  # an operator may read whatever a viewer may
            identity = await authenticator.authenticate(token)
        except AuthError as exc:
            reject_log.warning(
                "read_refused", "read refused: %s", exc, extra={"path": path[:128], "remote": request.remote}
            )
            resp = _json(exc.status, {"error": exc.reason, "message": str(exc)})
            if exc.status == 401:
                # A browser on a status page is asked for the token (as the Basic password);
                # programs reading the JSON API are told to send a bearer token.
                scheme = "Basic" if is_page(path) else "Bearer"
                resp.headers["WWW-Authenticate"] = f'{scheme} realm="gpuwarden", charset="UTF-8"'
            return resp
        except AuthUnavailable as exc:
            return _json(
                503, {"error": "auth_unavailable", "message": f"the token cannot be checked now: {exc}"}
            )
        if identity.role != "viewer":
            reject_log.warning(
                "read_forbidden",
                "read refused: not a viewer",
                extra={"path": path[:128], "subject": identity.subject},
            )
            return _json(
                403, {"error": "forbidden", "message": f"{identity.subject} may not read; a viewer may"}
            )
        return await handler(request)

    return guard


def _read_api(pipeline: PipelineLike) -> list[web.RouteDef]:
    async def nodes(request: web.Request) -> web.Response:
        return _pipeline_call("nodes", lambda: {"nodes": pipeline.nodes()})

    async def node(request: web.Request) -> web.Response:
        name = request.match_info["node"]
        try:
            found = pipeline.node(name)
        except Exception:
            log.exception("read API call failed", extra={"endpoint": "node", "node_name": name})
            return _json(500, {"error": "internal_error", "message": "node lookup failed"})
        if found is None:
            return _json(404, {"error": "unknown_node", "message": f"no node named {name[:253]!r}"})
        return _pipeline_call("node", lambda: found)

    async def decisions(request: web.Request) -> web.Response:
        raw_since = request.query.get("since", "0")
        try:
            since = float(raw_since)
        except ValueError:
            since = math.nan
        if not math.isfinite(since):
            return _bad_request(f"since must be unix seconds, got {raw_since[:64]!r}")
        raw_limit = request.query.get("limit", str(_DEFAULT_DECISIONS_LIMIT))
        try:
            limit = int(raw_limit)
        except ValueError:
            limit = 0
        if not 1 <= limit <= _MAX_DECISIONS_LIMIT:
            return _bad_request(
                f"limit must be an integer from 1 to {_MAX_DECISIONS_LIMIT}, got {raw_limit[:64]!r}"
            )
        return _pipeline_call("decisions", lambda: {"decisions": pipeline.decisions_since(since, limit)})

    return [
        web.get("/api/v1/nodes", nodes),
        web.get("/api/v1/nodes/{node}", node),
        web.get("/api/v1/decisions", decisions),
    ]


def _health(registry: CollectorRegistry, readiness: Readiness | None) -> list[web.RouteDef]:
    async def healthz(request: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if readiness is None:
            return _json(200, {"status": "ready"})
        try:
            problems = [str(p) for p in readiness()]
        except Exception as exc:
            log.exception("readiness check failed")
            problems = [f"readiness check failed: {exc!r}"]
        if problems:
            return _json(503, {"status": "not_ready", "problems": problems})
        return _json(200, {"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    return [web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics)]


# -- the application and its periodic task -------------------------------------------------------


@runtime_checkable
class SteppedPipeline(Protocol):
    """A pipeline whose time-driven work can run in steps (``aggregator.pipeline.Pipeline``)."""

    advance_on_ingest: bool

    def advance_steps(self, now: float) -> Iterator[object]: ...


@runtime_checkable
class OffloadableStep(Protocol):
    """A step whose work may run in a worker thread (``aggregator.pipeline.OffloadStep``): ``run``
    reads nothing the event loop writes, and must return before the steps go on."""

    def run(self) -> None: ...


async def advance_periodically(
    pipeline: PipelineLike,
    clock: Clock,
    metrics: Metrics,
    interval_s: float = 1.0,
    executor: Executor | None = None,
) -> None:
    """Call ``pipeline.advance(clock.time())`` every ``interval_s`` until cancelled.

    A pipeline that can advance in steps (``SteppedPipeline``) yields to the event loop between
    them, so reports are answered between two detectors' runs rather than after all of them. A
    step that can leave the loop (``OffloadableStep``: a forest, peer or trend pool run) runs in
    ``executor`` while the loop goes on; the cycle waits for it before its next step, so one such
    run is in flight at a time and the next cycle never starts a second. Without an executor it
    runs on the loop, as the pipeline would run it.
    A failing cycle is logged and counted, never fatal: silence detection must keep running even
    if one detector has a bug. A cycle that overruns its slot is followed by the next one at once,
    without trying to catch up on the missed ones.
    """
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        started = time.perf_counter()
        failed = False
        try:
            if isinstance(pipeline, SteppedPipeline):
                for step in pipeline.advance_steps(clock.time()):
                    if executor is not None and isinstance(step, OffloadableStep):
                        await loop.run_in_executor(executor, step.run)
                    else:
                        await asyncio.sleep(0)
            else:
                pipeline.advance(clock.time())
        except Exception:
            failed = True
            log.exception("detection cycle failed")
        metrics.detection_cycle(time.perf_counter() - started, failed=failed)
        next_at += interval_s
        delay = next_at - loop.time()
        if delay < 0:
            next_at = loop.time()
            delay = 0.0
        await asyncio.sleep(delay)


LOOP_LAG_PROBE_SECONDS: Final = 0.1  # how often the event loop's lag is sampled


async def watch_loop_lag(
    metrics: Metrics,
    interval_s: float = LOOP_LAG_PROBE_SECONDS,
    window_s: float = LOOP_LAG_WINDOW_SECONDS,
) -> None:
    """Sample the event loop's lag until cancelled: how much later than asked a sleep of
    ``interval_s`` wakes up. Every request, the periodic cycle and the Lease renewals share the
    loop, so this is how long any of them may have waited for a callback that hogged it. Each
    sample goes to a histogram; the largest of the last ``window_s`` to a gauge (a histogram
    cannot say what the worst pause was)."""
    loop = asyncio.get_running_loop()
    recent: deque[tuple[float, float]] = deque()  # (when, lag), lags decreasing: a sliding max
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        now = loop.time()
        lag = max(0.0, now - asked)
        while recent and recent[-1][1] <= lag:
            recent.pop()
        recent.append((now, lag))
        while recent[0][0] < now - window_s:
            recent.popleft()
        metrics.loop_lag(lag, worst_recent=recent[0][1])


def create_app(
    pipeline: PipelineLike,
    authenticator: Authenticator | None,
    config: Config,
    clock: Clock,
    registry: CollectorRegistry,
    *,
    metrics: Metrics | None = None,
    readiness: Readiness | None = None,
    advance_interval_s: float | None = 1.0,
    admin_tokens: Sequence[str] = (),
    banner: str | None = None,
    decisions: DecisionLog | None = None,
    route: Route | None = None,
    others: OtherShards | None = None,
    leading: Callable[[], bool] | None = None,
) -> web.Application:
    """The aggregator's web application.

    ``metrics``: pass the ``Metrics`` already given to the pipeline and decision log (it must be
    on ``registry``); by default one is made here. ``readiness`` returns the problems that make the
    aggregator unready. ``advance_interval_s``: how often ``pipeline.advance`` runs while the app
    is up (None: never, for a caller that drives it). Serve it with ``SERVER_KWARGS`` (``serve()``
    does). The authenticator is closed with the app if it has an ``async close()``; without one
    the app is read-only (no ingest route). ``banner``: a line atop every status page.
    ``decisions``: the log the pipeline writes to; a report that caused decisions is answered
    only once they are fsync'd. ``route``: with sharding, sends a report of another shard's pool
    there (aggregator/shard/router.py). ``others``: with sharding, the other shards' nodes for the
    status page (aggregator/shard/fanout.py). ``leading``: whether this replica holds the
    remediation Lease now, for the status page (None: no election).
    """
    if metrics is None:
        metrics = Metrics(registry)
    elif metrics.registry is not registry:
        raise ValueError("metrics must be registered on the registry passed to create_app")
    metrics.watch_node_states(pipeline.node_states)

    busy = Busy()
    guard = _read_guard(
        authenticator,
        metrics_public=config.server.metrics_public,
        status_page_public=config.server.status_page_public,
        clock=clock,
        admin_tokens=admin_tokens,
    )
    app = web.Application(
        client_max_size=config.ingest.max_body_bytes, middlewares=[_routing_refusals, busy.middleware, guard]
    )
    app.on_response_prepare.append(_server_header)
    app[BUSY_KEY] = busy
    app[PIPELINE_KEY] = pipeline
    app[METRICS_KEY] = metrics
    app[SERVER_CONFIG_KEY] = config.server
    if authenticator is not None:
        ingest = _Ingest(pipeline, authenticator, config, clock, metrics, decisions=decisions, route=route)
        app.router.add_post(REPORTS_PATH, ingest.handle, expect_handler=ingest.expect)
        app.router.add_route("OPTIONS", REPORTS_PATH, _options)
    app.router.add_routes(_health(registry, readiness))
    app.router.add_routes(_read_api(pipeline))
    app.router.add_routes(
        status_routes(pipeline, config=config, clock=clock, banner=banner, others=others, leading=leading)
    )

    if advance_interval_s is not None:
        interval = advance_interval_s
        if isinstance(pipeline, SteppedPipeline):
            # The periodic task does the time-driven work; a POST does rules and bookkeeping only.
            pipeline.advance_on_ingest = False

        async def periodic(app: web.Application) -> AsyncIterator[None]:
            # One thread: one offloaded run at a time, and at most one core's worth of competition
            # for the loop. What it runs is numpy (and scikit-learn for the forest), which release the GIL
            # in their compiled loops; the Python between them still takes turns with the loop.
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuwarden-detect")
            task = asyncio.create_task(
                advance_periodically(pipeline, clock, metrics, interval, executor), name="gpuwarden-advance"
            )
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # A run in flight finishes in its thread (it cannot be interrupted); nobody reads it.
            executor.shutdown(wait=False, cancel_futures=True)

        app.cleanup_ctx.append(periodic)

    async def lag(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(watch_loop_lag(metrics), name="gpuwarden-loop-lag")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(lag)

    if authenticator is not None and isinstance(authenticator, SupportsClose):
        closeable = authenticator

        async def close_authenticator(app: web.Application) -> None:
            await closeable.close()

        app.on_cleanup.append(close_authenticator)
    return app


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    stop: asyncio.Event | None = None,
    on_started: Callable[[str, int], None] | None = None,
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve ``app`` on ``host:port`` until ``stop`` is set (default: until SIGINT or SIGTERM).

    ``on_started`` gets the address actually bound (port 0 picks a free one). In-flight requests
    get ``shutdown_timeout_s`` to finish; then the app's cleanup runs (the periodic task stops).
    The app's ``ServerConfig`` sets the limits: the soft file limit is raised to the hard one and
    connections are capped below it (aggregator/listener.py); with ``tls_cert_file`` and
    ``tls_key_file`` it serves HTTPS, reloading the pair when it changes.
    """
    server = app.get(SERVER_CONFIG_KEY) or ServerConfig()
    httplog.install()  # aiohttp's lines for requests it cannot parse: one every few seconds
    handle_signals = stop is None
    stop_event = asyncio.Event() if stop is None else stop
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop_event.set)
    cap = connection_cap(server, raise_file_limit())
    ssl_ctx = None
    reload_task: asyncio.Task[None] | None = None
    if server.tls_cert_file is not None and server.tls_key_file is not None:
        ssl_ctx = tls_context(server.tls_cert_file, server.tls_key_file)
        reload_task = asyncio.create_task(
            watch_tls(ssl_ctx, server.tls_cert_file, server.tls_key_file, server.tls_reload_seconds),
            name="gpuwarden-tls-reload",
        )
    elif server.tls_cert_file is not None or server.tls_key_file is not None:
        raise ValueError("server.tls_cert_file and server.tls_key_file go together")
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s, **server_kwargs(server))
    await runner.setup()
    try:
        site = CappedSite(
            runner,
            host,
            port,
            cap=cap,
            retry_after_s=server.retry_after_seconds,
            busy=app.get(BUSY_KEY) or Busy(),
            ssl_context=ssl_ctx,
        )
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        log.info(
            "aggregator listening",
            extra={
                "host": bound_host,
                "port": bound_port,
                "tls": ssl_ctx is not None,
                "max_connections": cap,
                "event_loop": loop_name(loop),
            },
        )
        if on_started is not None:
            on_started(bound_host, bound_port)
        await stop_event.wait()
        log.info("aggregator stopping")
    finally:
        if reload_task is not None:
            reload_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reload_task
        await runner.cleanup()
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
