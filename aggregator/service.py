"""The aggregator's HTTP service: report ingestion, health checks, metrics and the read API.

Endpoints:

- ``POST /v1/reports``: one report (``Content-Type: application/json``, optionally
  ``Content-Encoding: gzip``) with ``Authorization: Bearer <token>``. 200 ``{"status":
  "accepted"}`` or ``{"status": "duplicate"}`` (same node, boot_id and seq seen before: nothing is
  processed twice, so an agent's retry is harmless). A report that caused decisions is answered
  once they are fsync'd (``aggregator.decisions``): a 200 survives a power loss.
- ``GET /healthz`` (the process answers), ``GET /readyz`` (rules loaded, decision log writable:
  whatever the readiness callable says), ``GET /metrics`` (Prometheus text).
- ``GET /api/v1/nodes``, ``GET /api/v1/nodes/{node}``, ``GET /api/v1/decisions?since=&limit=``.

Every refusal is a JSON body ``{"error": <reason code>, "message": <text for a human>}``; the
reason codes are ``aggregator.metrics.REJECT_REASONS`` and count in
``gpuwarden_aggregator_reports_rejected_total{reason}``:

====  ==========================  =======================================================
401   missing_token, bad_token    no/unknown bearer token (agents keep the report and retry)
403   forbidden                   a valid token that may not send reports
403   node_mismatch, node_unbound the token is another node's, or bound to no node
415   unsupported_media_type      not application/json (or a charset other than UTF-8)
415   unsupported_encoding        a Content-Encoding other than gzip or identity
413   body_too_large              over ``ingest.max_body_bytes`` as received
413   decompressed_too_large      gzip inflating past ``ingest.max_decompressed_bytes``
400   incomplete_body             the connection broke before the whole body arrived
400   bad_gzip, bad_json          not gzip / not JSON (NaN and Infinity are not JSON)
400   wrong_schema_version        ``schema`` is not ``gpuwarden/report/v1``
422   schema_violation            valid JSON that breaks the schema; the message names the field
422   implausible_value           in the schema, but not physically possible (``plausibility_errors``)
503   auth_unavailable            the token could not be checked (Kubernetes API unreachable)
500   internal_error              the pipeline failed on a valid report (logged with its trace)
====  ==========================  =======================================================

Hostile input is bounded before it costs anything: authentication happens before the body is
read, the body is counted while it streams in, and gzip is inflated by a bounded decompressor, so a
bomb is refused after ``max_decompressed_bytes`` of output however far it would expand. None of it
reaches the pipeline. The pipeline is only ever called from the event loop's thread, so it needs
no locks: ingestion and the periodic ``advance`` never run at the same time.

A node's clock does not matter for liveness: the pipeline gets the aggregator's receive time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import signal
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, Protocol

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.clock import Clock
from agent.errors import ReportError
from agent.report import CATALOGUE, SCHEMA_ID, Gpu, Nic, Probe, Report, decode
from aggregator.auth import (
    Authenticator,
    AuthError,
    AuthUnavailable,
    Identity,
    SupportsClose,
    bearer_token,
)
from aggregator.config import Config
from aggregator.decisions import DecisionLog
from aggregator.metrics import Metrics
from aggregator.model import IngestOutcome

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
    "advance_periodically",
    "create_app",
    "gunzip_bounded",
    "plausibility_errors",
    "serve",
]

REPORTS_PATH: Final = "/v1/reports"
EARLIEST_PLAUSIBLE_TIME: Final = 1_577_836_800.0  # 2020-01-01T00:00:00Z, before any gpuwarden
MAX_CLOCK_AHEAD_SECONDS: Final = 86_400.0
# The aiohttp server must hand the handler the body as sent: with its default automatic
# decompression the gzip bomb guard would only ever see inflated bytes. serve() uses these; a test
# server must too (aiohttp_client(app, server_kwargs=SERVER_KWARGS)).
SERVER_KWARGS: Final[dict[str, Any]] = {"auto_decompress": False}

_GZIP_MAGIC: Final = b"\x1f\x8b"
_DEFAULT_DECISIONS_LIMIT: Final = 1000
_MAX_DECISIONS_LIMIT: Final = 10_000
_MESSAGE_MAX_CHARS: Final = 1000
_REJECT_LOG_EVERY_S: Final = 10.0


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


# Problems that keep the aggregator from doing its job (rules not loaded, decision log not
# writable); empty when ready.
Readiness = Callable[[], Sequence[str]]

PIPELINE_KEY: Final = web.AppKey("pipeline", PipelineLike)
METRICS_KEY: Final = web.AppKey("metrics", Metrics)


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
    the node's history would mix two devices.
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


_ACCEPTED_BODY: Final = msgspec.json.encode({"status": IngestOutcome.ACCEPTED.value})
_DUPLICATE_BODY: Final = msgspec.json.encode({"status": IngestOutcome.DUPLICATE.value})


class _RejectLog:
    """Logs refusals at most once per reason every few seconds, with how many went unlogged, so a
    misbehaving or hostile sender cannot flood the log (the metrics count every one)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, reason: str, message: str, extra: dict[str, object], *, exc: bool = False) -> None:
        now = self._clock.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < _REJECT_LOG_EVERY_S:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        log.warning(
            "report refused: %s",
            message,
            extra={"reason": reason, "suppressed_since_last": suppressed, **extra},
            exc_info=exc,
        )


class _Ingest:
    """``POST /v1/reports``: read, decompress, decode, check, ingest; nothing else on this path."""

    def __init__(
        self,
        pipeline: PipelineLike,
        authenticator: Authenticator,
        config: Config,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self._pipeline = pipeline
        self._auth = authenticator
        self._max_body = config.ingest.max_body_bytes
        self._max_inflated = config.ingest.max_decompressed_bytes
        self._clock = clock
        self._metrics = metrics
        self._reject_log = _RejectLog(clock)
        # A 200 is a promise that the report's decisions survive a power loss: wait for their fsync.
        decisions = getattr(pipeline, "decisions", None)
        self._decisions = decisions if isinstance(decisions, DecisionLog) else None

    async def handle(self, request: web.Request) -> web.Response:
        node: str | None = None
        subject: str | None = None
        try:
            identity = await self._authenticate(request)
            subject = identity.subject
            gzipped = self._check_headers(request)
            body = await self._read_body(request)
            started = time.perf_counter()
            report = self._parse(body, gzipped)
            node = report.node
            if identity.node is None:
                raise _Reject(403, "node_unbound", f"the token of {identity.subject} is not bound to a node")
            if identity.node != report.node:
                raise _Reject(
                    403,
                    "node_mismatch",
                    f"the token is for node {identity.node}, the report is from {report.node}",
                )
            problems = plausibility_errors(report, now=self._clock.time())
            if problems:
                raise _Reject(422, "implausible_value", "; ".join(problems)[:_MESSAGE_MAX_CHARS])
            try:
                before = self._decisions.appended if self._decisions is not None else 0
                outcome = self._pipeline.ingest(report, self._clock.time())
            except Exception:
                self._metrics.rejected("internal_error")
                self._reject_log.log(
                    "internal_error",
                    "the pipeline failed to ingest a valid report",
                    {"report_node": node, "report_seq": report.seq},
                    exc=True,
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
        self._reject_log.log(
            rej.reason,
            rej.message,
            {"http_status": rej.status, "report_node": node, "subject": subject, "remote": request.remote},
        )
        resp = _json(rej.status, {"error": rej.reason, "message": rej.message})
        if rej.status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="gpuwarden"'
        if rej.status == 413:
            # The rest of an oversized body is not worth keeping the connection for.
            resp.force_close()
        return resp

    async def _authenticate(self, request: web.Request) -> Identity:
        try:
            return await self._auth.authenticate(bearer_token(request.headers.get("Authorization")))
        except AuthError as exc:
            raise _Reject(exc.status, exc.reason, str(exc)) from exc
        except AuthUnavailable as exc:
            raise _Reject(503, "auth_unavailable", f"the token cannot be checked now: {exc}") from exc

    @staticmethod
    def _check_headers(request: web.Request) -> bool:
        """True if the body is gzip; refuses what this endpoint does not speak."""
        ctype = request.content_type.lower()
        if ctype != "application/json":
            raise _Reject(
                415, "unsupported_media_type", f"Content-Type must be application/json, got {ctype!r}"
            )
        charset = request.charset
        if charset is not None and charset.lower() not in ("utf-8", "utf8"):
            raise _Reject(415, "unsupported_media_type", f"the charset must be UTF-8, got {charset!r}")
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("gzip", "x-gzip"):
            return True
        if encoding in ("", "identity"):
            return False
        raise _Reject(
            415, "unsupported_encoding", f"Content-Encoding must be gzip or absent, got {encoding[:64]!r}"
        )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self._max_body
        length = request.content_length
        if length is not None and length > limit:
            raise _Reject(413, "body_too_large", f"the body is {length} bytes, the limit is {limit} bytes")
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

    def _parse(self, body: bytes, gzipped: bool) -> Report:
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
        try:
            return decode(body)
        except ReportError as exc:
            raise self._classify(body, exc) from None

    @staticmethod
    def _classify(body: bytes, exc: ReportError) -> _Reject:
        """Which refusal a decode error is; only runs for bad reports, never on the hot path."""
        if not isinstance(exc.__cause__, msgspec.ValidationError):
            return _Reject(400, "bad_json", str(exc)[:_MESSAGE_MAX_CHARS])
        # A newer agent's report fails on its first unknown field; what matters is its version.
        try:
            version = msgspec.json.decode(body, type=_Version).schema
        except msgspec.DecodeError:
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


# -- the read API, health and metrics -------------------------------------------------------------


def _bad_request(message: str) -> web.Response:
    return _json(400, {"error": "bad_request", "message": message})


def _pipeline_call(what: str, call: Callable[[], object]) -> web.Response:
    try:
        return _json(200, call())
    except Exception:
        log.exception("read API call failed", extra={"endpoint": what})
        return _json(500, {"error": "internal_error", "message": f"{what} failed"})


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


async def advance_periodically(
    pipeline: PipelineLike, clock: Clock, metrics: Metrics, interval_s: float = 1.0
) -> None:
    """Call ``pipeline.advance(clock.time())`` every ``interval_s`` until cancelled.

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


def create_app(
    pipeline: PipelineLike,
    authenticator: Authenticator,
    config: Config,
    clock: Clock,
    registry: CollectorRegistry,
    *,
    metrics: Metrics | None = None,
    readiness: Readiness | None = None,
    advance_interval_s: float | None = 1.0,
) -> web.Application:
    """The aggregator's web application.

    ``metrics``: pass the ``Metrics`` already given to the pipeline and decision log (it must be
    on ``registry``); by default one is made here. ``readiness`` returns the problems that make the
    aggregator unready. ``advance_interval_s``: how often ``pipeline.advance`` runs while the app
    is up (None: never, for a caller that drives it). Serve it with ``SERVER_KWARGS`` (``serve()``
    does). The authenticator is closed with the app if it has an ``async close()``.
    """
    if metrics is None:
        metrics = Metrics(registry)
    elif metrics.registry is not registry:
        raise ValueError("metrics must be registered on the registry passed to create_app")
    metrics.watch_node_states(pipeline.node_states)

    app = web.Application(client_max_size=config.ingest.max_body_bytes)
    app[PIPELINE_KEY] = pipeline
    app[METRICS_KEY] = metrics
    ingest = _Ingest(pipeline, authenticator, config, clock, metrics)
    app.router.add_post(REPORTS_PATH, ingest.handle)
    app.router.add_routes(_health(registry, readiness))
    app.router.add_routes(_read_api(pipeline))

    if advance_interval_s is not None:
        interval = advance_interval_s

        async def periodic(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(
                advance_periodically(pipeline, clock, metrics, interval), name="gpuwarden-advance"
            )
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        app.cleanup_ctx.append(periodic)

    if isinstance(authenticator, SupportsClose):
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
    """
    handle_signals = stop is None
    stop_event = asyncio.Event() if stop is None else stop
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop_event.set)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s, **SERVER_KWARGS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        log.info("aggregator listening", extra={"host": bound_host, "port": bound_port})
        if on_started is not None:
            on_started(bound_host, bound_port)
        await stop_event.wait()
        log.info("aggregator stopping")
    finally:
        await runner.cleanup()
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
