"""The aggregator's HTTP service through aiohttp's test client: ingestion, refusals, metrics, read API."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import logging
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from agent import wire
from agent.clock import FakeClock
from agent.logs import KeyValueFormatter
from agent.report import SCHEMA_ID, Event, Gpu, Nic, NvLink, Probe, Report, encode, to_builtins
from aggregator.auth import AuthUnavailable, Identity, StaticTokens
from aggregator.config import Config, IngestConfig
from aggregator.metrics import REJECT_REASONS, Metrics
from aggregator.model import IngestOutcome
from aggregator.service import (
    EARLIEST_PLAUSIBLE_TIME,
    METRICS_KEY,
    REPORTS_PATH,
    SERVER_KWARGS,
    DecompressedTooLarge,
    create_app,
    gunzip_bounded,
    plausibility_errors,
)

NOW = 1_764_441_600.0
TOKENS = {"gpu-0001": "tok-gpu-0001-a3f9c2e81b7d4e65", "gpu-0002": "tok-gpu-0002-77d0e4b29c1a8f30"}
VIEWER_TOKEN = "tok-viewer-5d1c0e9a7b3f2468"
VIEWER = {"Authorization": f"Bearer {VIEWER_TOKEN}"}  # reads need a viewer (aggregator/auth.py)


# -- a realistic report ---------------------------------------------------------------------------


def make_report(
    node: str = "gpu-0001", seq: int = 1, *, boot_id: str = "boot-a", time_: float = NOW - 2.0
) -> Report:
    """An 8-GPU H100 node with NVLinks and 8 InfiniBand ports, as the agent sends it."""
    gpus = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{node}-{i:02d}",
            model="NVIDIA H100 80GB HBM3",
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            utilization_ratio=0.97,
            memory_used_bytes=71_000_000_000,
            memory_total_bytes=85_899_345_920,
            temperature_celsius=61.0 + i,
            memory_temperature_celsius=70.0,
            power_watts=612.5,
            power_limit_watts=700.0,
            energy_joules_total=9.8e9,
            sm_clock_hz=1.98e9,
            sm_clock_max_hz=1.98e9,
            memory_clock_hz=2.619e9,
            clock_event_reasons=0,
            performance_state=0,
            ecc_sbe_volatile_total=0,
            ecc_dbe_volatile_total=0,
            ecc_sbe_aggregate_total=2,
            ecc_dbe_aggregate_total=0,
            retired_pages_sbe=None,
            retired_pages_dbe=None,
            remapped_rows_correctable=0,
            remapped_rows_uncorrectable=0,
            remapped_rows_pending=False,
            remapped_rows_failure=False,
            pcie_link_gen=5,
            pcie_link_gen_max=5,
            pcie_link_width=16,
            pcie_link_width_max=16,
            pcie_replay_total=0,
            nvlink=tuple(
                NvLink(
                    link=link,
                    active=True,
                    crc_flit_errors_total=0,
                    crc_data_errors_total=0,
                    replay_errors_total=0,
                    recovery_errors_total=0,
                )
                for link in range(18)
            ),
        )
        for i in range(8)
    )
    nics = tuple(
        Nic(
            device=f"mlx5_{i}",
            link_layer="InfiniBand",
            port=1,
            netdev=f"ibp{i}s0",
            state="ACTIVE",
            phys_state="LinkUp",
            rate_bytes_per_second=5e10,
            rx_bytes_total=123_456_789_000 + seq,
            tx_bytes_total=98_765_432_000 + seq,
            rx_packets_total=1_000_000,
            tx_packets_total=900_000,
            counters={"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0, "port_xmit_wait": 1234},
        )
        for i in range(8)
    )
    return Report(
        schema=SCHEMA_ID,
        node=node,
        time=time_,
        seq=seq,
        boot_id=boot_id,
        agent_version="0.1.0",
        interval_seconds=10.0,
        gpus=gpus,
        nics=nics,
        events=(Event(kind="xid", time=time_ - 30.0, gpu=3, code=13, message="Graphics Engine Exception"),),
        probes=(
            Probe(
                kind="nccl_allreduce_local",
                time=time_ - 60.0,
                ok=True,
                size_bytes=1 << 30,
                busbw_bytes_per_second=4.5e11,
                duration_seconds=3.2,
            ),
        ),
    )


def report_doc(**kw: Any) -> dict[str, Any]:
    return to_builtins(make_report(**kw))


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


# -- a fake pipeline ------------------------------------------------------------------------------


class FakePipeline:
    """Records what reaches it; knows duplicates by (node, boot_id, seq) like the real one."""

    def __init__(self) -> None:
        self.ingested: list[tuple[Report, float]] = []
        self.seen: set[tuple[str, str, int]] = set()
        self.advanced: list[float] = []
        self.fail_ingest = False
        self.advance_failures = 0  # how many of the next advance() calls raise
        self.states: dict[str, int] | None = {"healthy": 41, "quarantined": 2, "probation": 1}
        self.decision_log: list[dict[str, Any]] = [
            {"time": NOW - 100.0 + i, "subject": "node", "node": f"gpu-{i:04d}", "state": "suspect"}
            for i in range(5)
        ]

    def ingest(self, report: Report, received: float) -> IngestOutcome:
        if self.fail_ingest:
            raise RuntimeError("pipeline bug")
        key = (report.node, report.boot_id, report.seq)
        if key in self.seen:
            return IngestOutcome.DUPLICATE
        self.seen.add(key)
        self.ingested.append((report, received))
        return IngestOutcome.ACCEPTED

    def advance(self, now: float) -> None:
        self.advanced.append(now)
        if self.advance_failures > 0:
            self.advance_failures -= 1
            raise RuntimeError("detector bug")

    def nodes(self) -> list[dict[str, Any]]:
        return [{"node": report.node, "state": "healthy"} for report, _ in self.ingested]

    def node(self, name: str) -> dict[str, Any] | None:
        for report, received in self.ingested:
            if report.node == name:
                return {"node": name, "state": "healthy", "last_received": received, "reasons": []}
        return None

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]:
        return [d for d in self.decision_log if d["time"] >= since][:limit]

    def node_states(self) -> dict[str, int]:
        if self.states is None:
            raise RuntimeError("node states unavailable")
        return dict(self.states)


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    lines = ["# node tokens", ""] + [f"{node} {token}" for node, token in TOKENS.items()]
    lines.append(f"viewer:dashboards {VIEWER_TOKEN}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pipeline() -> FakePipeline:
    return FakePipeline()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


MakeClient = Callable[..., Any]


@pytest.fixture
def make_client(
    aiohttp_client: Any,
    pipeline: FakePipeline,
    token_file: Path,
    clock: FakeClock,
    registry: CollectorRegistry,
) -> MakeClient:
    async def make(
        *,
        config: Config | None = None,
        authenticator: Any = None,
        readiness: Any = None,
        advance_interval_s: float | None = None,
        registry_: CollectorRegistry | None = None,
    ) -> TestClient[web.Request, web.Application]:
        app = create_app(
            pipeline,
            authenticator or StaticTokens(token_file, recheck_seconds=0.0),
            config or Config(),
            clock,
            registry if registry_ is None else registry_,
            readiness=readiness,
            advance_interval_s=advance_interval_s,
        )
        # The runner's options go to start_server (TestServer drops constructor kwargs).
        server = TestServer(app)
        await server.start_server(**SERVER_KWARGS)
        client: TestClient[web.Request, web.Application] = await aiohttp_client(server)
        return client

    return make


@pytest.fixture
async def client(make_client: MakeClient) -> TestClient[web.Request, web.Application]:
    c: TestClient[web.Request, web.Application] = await make_client()
    return c


def headers(node: str = "gpu-0001", *, gzipped: bool = True, **extra: str) -> dict[str, str]:
    out = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKENS[node]}"}
    if gzipped:
        out["Content-Encoding"] = "gzip"
    out.update(extra)
    return out


async def post_report(
    client: TestClient[web.Request, web.Application], report: Report, node: str | None = None
) -> tuple[int, dict[str, Any]]:
    resp = await client.post(REPORTS_PATH, data=gz(encode(report)), headers=headers(node or report.node))
    return resp.status, await resp.json()


def rejected(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("gpuwarden_aggregator_reports_rejected_total", {"reason": reason})
    assert value is not None
    return value


def counter(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    assert value is not None
    return value


# -- accepted reports -----------------------------------------------------------------------------


async def test_gzip_report_is_ingested_with_the_servers_receive_time(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline, clock: FakeClock
) -> None:
    # The node's clock is an hour behind: liveness must still use the aggregator's clock.
    report = make_report(time_=NOW - 3600.0)
    status, body = await post_report(client, report)
    assert (status, body) == (200, {"status": "accepted"})
    assert pipeline.ingested == [(report, clock.time())]


async def test_plain_json_report_is_accepted(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    report = make_report()
    resp = await client.post(
        REPORTS_PATH,
        data=encode(report),
        headers=headers(gzipped=False, **{"Content-Type": "application/json; charset=utf-8"}),
    )
    assert resp.status == 200
    assert [r for r, _ in pipeline.ingested] == [report]


async def test_multi_member_gzip_is_one_body(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    data = encode(make_report())
    resp = await client.post(REPORTS_PATH, data=gz(data[:100]) + gz(data[100:]), headers=headers())
    assert resp.status == 200
    assert len(pipeline.ingested) == 1


async def test_duplicate_delivery_is_idempotent_and_counted(
    client: TestClient[web.Request, web.Application],
    pipeline: FakePipeline,
    registry: CollectorRegistry,
) -> None:
    report = make_report(seq=7)
    assert await post_report(client, report) == (200, {"status": "accepted"})
    assert await post_report(client, report) == (200, {"status": "duplicate"})
    assert len(pipeline.ingested) == 1
    assert counter(registry, "gpuwarden_aggregator_reports_accepted_total") == 1
    assert counter(registry, "gpuwarden_aggregator_reports_duplicate_total") == 1
    assert counter(registry, "gpuwarden_aggregator_ingest_seconds_count") == 2


# -- refusals -------------------------------------------------------------------------------------


def _body(doc: dict[str, Any]) -> bytes:
    return gz(json.dumps(doc).encode())


def _mutated(path: str, value: Any) -> bytes:
    doc = report_doc()
    target: Any = doc
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    return _body(doc)


def _without(key: str) -> bytes:
    doc = report_doc()
    del doc[key]
    return _body(doc)


def _nan_temperature() -> bytes:
    # Python's json writes NaN (which is not JSON); the aggregator must refuse it.
    doc = report_doc()
    doc["gpus"][0]["temperature_celsius"] = float("nan")
    text = json.dumps(doc)
    assert "NaN" in text
    return gz(text.encode())


def _huge_exponent() -> bytes:
    text = json.dumps(report_doc()).replace('"power_watts": 612.5', '"power_watts": 1e999', 1)
    assert "1e999" in text
    return gz(text.encode())


# (case id, body, header overrides, expected status, expected reason, text the message must hold)
REFUSALS: list[tuple[str, bytes, dict[str, str | None], int, str, str]] = [
    ("no token", _body(report_doc()), {"Authorization": None}, 401, "missing_token", "Bearer"),
    ("basic auth", _body(report_doc()), {"Authorization": "Basic Z3B1OnB3"}, 401, "missing_token", "Bearer"),
    ("empty bearer", _body(report_doc()), {"Authorization": "Bearer "}, 401, "missing_token", "Bearer"),
    (
        "unknown token",
        _body(report_doc()),
        {"Authorization": "Bearer nope-nope"},
        401,
        "bad_token",
        "unknown",
    ),
    (
        "another node's token",
        _body(report_doc()),
        {"Authorization": f"Bearer {TOKENS['gpu-0002']}"},
        403,
        "node_mismatch",
        "gpu-0002",
    ),
    (
        "text/plain",
        _body(report_doc()),
        {"Content-Type": "text/plain"},
        415,
        "unsupported_media_type",
        "json",
    ),
    ("no content type", _body(report_doc()), {"Content-Type": None}, 415, "unsupported_media_type", "json"),
    (
        "latin-1",
        _body(report_doc()),
        {"Content-Type": "application/json; charset=latin-1"},
        415,
        "unsupported_media_type",
        "UTF-8",
    ),
    ("brotli", _body(report_doc()), {"Content-Encoding": "br"}, 415, "unsupported_encoding", "br"),
    (
        "gzip twice",
        _body(report_doc()),
        {"Content-Encoding": "gzip, gzip"},
        415,
        "unsupported_encoding",
        "gzip",
    ),
    ("not gzip", json.dumps(report_doc()).encode(), {}, 400, "bad_gzip", "not gzip"),
    ("truncated gzip", _body(report_doc())[:-20], {}, 400, "bad_gzip", "truncated"),
    ("corrupt gzip", _body(report_doc())[:12] + b"\xff" * 40, {}, 400, "bad_gzip", "gzip"),
    ("not json", gz(b"{this is not json"), {}, 400, "bad_json", "JSON"),
    ("empty body", gz(b""), {}, 400, "bad_json", "JSON"),
    ("NaN literal", _nan_temperature(), {}, 400, "bad_json", "JSON"),
    ("a list", gz(b"[1, 2]"), {}, 422, "schema_violation", "object"),
    (
        "temperature as text",
        _mutated("gpus.2.temperature_celsius", "hot"),
        {},
        422,
        "schema_violation",
        "$.gpus[2].temperature_celsius",
    ),
    (
        "negative counter",
        _mutated("gpus.0.ecc_dbe_volatile_total", -1),
        {},
        422,
        "schema_violation",
        "$.gpus[0].ecc_dbe_volatile_total",
    ),
    (
        "utilization over 1",
        _mutated("gpus.1.utilization_ratio", 1.5),
        {},
        422,
        "schema_violation",
        "$.gpus[1].utilization_ratio",
    ),
    ("unknown field", _mutated("surprise", 1), {}, 422, "schema_violation", "surprise"),
    ("missing seq", _without("seq"), {}, 422, "schema_violation", "seq"),
    ("1e999", _huge_exponent(), {}, 422, "schema_violation", "power_watts"),
    (
        "schema v2",
        _mutated("schema", "gpuwarden/report/v2"),
        {},
        400,
        "wrong_schema_version",
        "gpuwarden/report/v1",
    ),
    (
        "900 celsius",
        _mutated("gpus.3.temperature_celsius", 900.0),
        {},
        422,
        "implausible_value",
        "$.gpus[3].temperature_celsius",
    ),
    ("20 kW", _mutated("gpus.0.power_watts", 20_000.0), {}, 422, "implausible_value", "power_watts"),
    ("1970", _mutated("time", 3600.0), {}, 422, "implausible_value", "before 2020"),
    ("two days ahead", _mutated("time", NOW + 2 * 86400.0), {}, 422, "implausible_value", "ahead"),
    (
        "negative link rate",
        _mutated("nics.0.rate_bytes_per_second", -1.0),
        {},
        422,
        "implausible_value",
        "rate_bytes_per_second",
    ),
    # Counters are 64-bit by their type (agent/report.py): the schema refuses a wider one.
    (
        "2**70 counter",
        _mutated("nics.1.counters.symbol_error", 1 << 70),
        {},
        422,
        "schema_violation",
        "$.nics[1].counters.symbol_error",
    ),
    (
        "2**64 counter",
        _mutated("gpus.4.nvlink.3.replay_errors_total", 1 << 64),
        {},
        422,
        "schema_violation",
        "$.gpus[4].nvlink[3].replay_errors_total",
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
async def test_bad_input_is_refused_and_the_next_report_accepted(
    client: TestClient[web.Request, web.Application],
    pipeline: FakePipeline,
    registry: CollectorRegistry,
    case: tuple[str, bytes, dict[str, str | None], int, str, str],
) -> None:
    _, body, overrides, status, reason, says = case
    hdrs: dict[str, str] = headers()
    for key, value in overrides.items():
        hdrs.pop(key, None)
        if value is not None:
            hdrs[key] = value
    # skip_auto_headers keeps aiohttp from adding a Content-Type of its own when we removed it.
    resp = await client.post(REPORTS_PATH, data=body, headers=hdrs, skip_auto_headers=["Content-Type"])
    assert resp.status == status
    answer = await resp.json()
    assert answer["error"] == reason
    assert says in answer["message"]
    if status == 401:
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert pipeline.ingested == []
    assert rejected(registry, reason) == 1

    good = make_report(seq=99)
    assert await post_report(client, good) == (200, {"status": "accepted"})
    assert [r for r, _ in pipeline.ingested] == [good]


async def test_gzip_bomb_is_refused_without_inflating_it(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    bomb = gzip.compress(b"\0" * (10 << 20), compresslevel=9)
    assert len(bomb) < 20_000  # small enough to pass the body limit: only inflating shows it
    started = time.perf_counter()
    resp = await client.post(REPORTS_PATH, data=bomb, headers=headers())
    elapsed = time.perf_counter() - started
    assert resp.status == 413
    assert (await resp.json())["error"] == "decompressed_too_large"
    assert elapsed < 2.0
    assert pipeline.ingested == []
    assert (await post_report(client, make_report()))[0] == 200


async def test_oversize_body_refused_by_content_length(
    client: TestClient[web.Request, web.Application], registry: CollectorRegistry
) -> None:
    big = b"x" * (Config().ingest.max_body_bytes + 1)
    resp = await client.post(REPORTS_PATH, data=big, headers=headers())
    assert resp.status == 413
    answer = await resp.json()
    assert answer["error"] == "body_too_large"
    assert str(Config().ingest.max_body_bytes) in answer["message"]
    assert (await post_report(client, make_report()))[0] == 200


async def test_oversize_chunked_body_is_counted_while_streaming(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(24):  # 1.5 MiB, no Content-Length
            yield b"\x1f\x8b" + b"z" * (64 * 1024 - 2)

    resp = await client.post(REPORTS_PATH, data=chunks(), headers=headers())
    assert resp.status == 413
    assert (await resp.json())["error"] == "body_too_large"
    assert pipeline.ingested == []
    assert (await post_report(client, make_report()))[0] == 200


async def test_configured_limits_apply(make_client: MakeClient, pipeline: FakePipeline) -> None:
    client = await make_client(config=Config(ingest=IngestConfig(max_body_bytes=1000)))
    body = gz(encode(make_report()))
    assert len(body) > 1000
    resp = await client.post(REPORTS_PATH, data=body, headers=headers())
    assert resp.status == 413

    client = await make_client(
        config=Config(ingest=IngestConfig(max_decompressed_bytes=10_000)), registry_=CollectorRegistry()
    )
    resp = await client.post(REPORTS_PATH, data=body, headers=headers())
    assert resp.status == 413
    assert (await resp.json())["error"] == "decompressed_too_large"
    assert pipeline.ingested == []


async def test_pipeline_failure_is_a_500_and_the_service_goes_on(
    client: TestClient[web.Request, web.Application],
    pipeline: FakePipeline,
    registry: CollectorRegistry,
) -> None:
    pipeline.fail_ingest = True
    resp = await client.post(REPORTS_PATH, data=gz(encode(make_report())), headers=headers())
    assert resp.status == 500
    assert (await resp.json())["error"] == "internal_error"
    assert rejected(registry, "internal_error") == 1
    pipeline.fail_ingest = False
    assert (await post_report(client, make_report()))[0] == 200


class _Fixed:
    """An authenticator with a fixed answer."""

    def __init__(self, answer: Identity | Exception) -> None:
        self.answer = answer

    async def authenticate(self, token: str) -> Identity:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("body", ["report", "garbage", "bomb"])
async def test_unbound_identity_may_not_report(
    make_client: MakeClient, pipeline: FakePipeline, body: str
) -> None:
    # Refused before the body is read: whatever a reader's token sends, nothing is inflated or
    # decoded for it (a gzip bomb is not a 413 after inflating it, garbage not a 400).
    client = await make_client(authenticator=_Fixed(Identity(node=None, subject="system:admin")))
    data = {"report": gz(encode(make_report())), "garbage": b"garbage", "bomb": gz(b"\0" * (64 << 20))}[body]
    resp = await client.post(REPORTS_PATH, data=data, headers=headers())
    assert resp.status == 403
    assert (await resp.json())["error"] == "node_unbound"
    assert pipeline.ingested == []


async def test_auth_backend_down_is_a_503_so_agents_retry(
    make_client: MakeClient, pipeline: FakePipeline
) -> None:
    client = await make_client(authenticator=_Fixed(AuthUnavailable("API server unreachable")))
    resp = await client.post(REPORTS_PATH, data=gz(encode(make_report())), headers=headers())
    assert resp.status == 503
    assert (await resp.json())["error"] == "auth_unavailable"
    assert pipeline.ingested == []


async def test_static_token_file_is_reread_when_it_changes(
    client: TestClient[web.Request, web.Application], token_file: Path, pipeline: FakePipeline
) -> None:
    assert (await post_report(client, make_report()))[0] == 200
    new_token = "tok-gpu-0001-rotated-5e1f0c9d"
    token_file.write_text(f"gpu-0001 {new_token}\ngpu-0002 {TOKENS['gpu-0002']}\n")
    old = await client.post(REPORTS_PATH, data=gz(encode(make_report(seq=2))), headers=headers())
    assert old.status == 401
    new = await client.post(
        REPORTS_PATH,
        data=gz(encode(make_report(seq=3))),
        headers=headers(Authorization=f"Bearer {new_token}"),
    )
    assert new.status == 200
    assert [r.seq for r, _ in pipeline.ingested] == [1, 3]


async def test_refusals_are_logged_without_flooding(
    client: TestClient[web.Request, web.Application],
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aggregator.service")
    for _ in range(50):
        resp = await client.post(REPORTS_PATH, data=gz(b"{"), headers=headers())
        assert resp.status == 400
    refusals = [r for r in caplog.records if r.getMessage().startswith("report refused")]
    assert len(refusals) == 1
    assert refusals[0].__dict__["reason"] == "bad_json"
    assert rejected(registry, "bad_json") == 50


# -- plausibility and bounded gunzip, directly ----------------------------------------------------


def test_a_real_report_is_plausible() -> None:
    assert plausibility_errors(make_report(), now=NOW) == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["gpus"][0].update(temperature_celsius=-60.0), "$.gpus[0].temperature_celsius"),
        (lambda d: d["gpus"][0].update(memory_temperature_celsius=201.0), "memory_temperature_celsius"),
        (lambda d: d["gpus"][5].update(power_watts=-1.0), "$.gpus[5].power_watts"),
        (lambda d: d["gpus"][0].update(power_limit_watts=10_001.0), "power_limit_watts"),
        (lambda d: d["gpus"][0].update(sm_clock_hz=5e12), "sm_clock_hz"),
        (lambda d: d["gpus"][0].update(energy_joules_total=-5.0), "energy_joules_total"),
        (lambda d: d["nics"][2].update(rate_bytes_per_second=2e13), "$.nics[2].rate_bytes_per_second"),
        (lambda d: d.update(time=EARLIEST_PLAUSIBLE_TIME - 1), "$.time"),
        (lambda d: d.update(interval_seconds=7 * 86400.0), "$.interval_seconds"),
        (lambda d: d["events"][0].update(time=NOW + 3 * 86400), "$.events[0].time"),
        (lambda d: d["probes"][0].update(duration_seconds=-1.0), "$.probes[0].duration_seconds"),
        (lambda d: d["probes"][0].update(busbw_bytes_per_second=1e14), "busbw_bytes_per_second"),
        (lambda d: d["gpus"][1].update(index=0), "$.gpus[1].index"),
        (lambda d: d["gpus"][1].update(uuid=d["gpus"][0]["uuid"]), "$.gpus[1].uuid"),
        (lambda d: d["gpus"][0]["nvlink"][1].update(link=0), "nvlink[1].link"),
        (lambda d: d["nics"][1].update(device="mlx5_0"), "$.nics[1]"),
    ],
)
def test_implausible_values_are_named(change: Callable[[dict[str, Any]], None], field: str) -> None:
    doc = copy.deepcopy(report_doc())
    change(doc)
    report = msgspec.convert(doc, Report)  # the schema accepts it; only plausibility refuses it
    errors = plausibility_errors(report, now=NOW)
    assert len(errors) == 1, errors
    assert field in errors[0]


def test_unknown_uuids_may_repeat_and_a_known_one_still_may_not() -> None:
    # Two GPUs whose UUID NVML would not give (RESET_REQUIRED, UNKNOWN) both say "": unknown, not
    # one GPU twice, so the node's report (its NICs, its events) still goes in.
    doc = copy.deepcopy(report_doc())
    doc["gpus"][2]["uuid"] = doc["gpus"][5]["uuid"] = ""
    assert plausibility_errors(msgspec.convert(doc, Report), now=NOW) == []
    doc["gpus"][6]["uuid"] = doc["gpus"][0]["uuid"]
    errors = plausibility_errors(msgspec.convert(doc, Report), now=NOW)
    assert len(errors) == 1 and "$.gpus[6].uuid" in errors[0]


def test_non_finite_values_of_a_constructed_report_are_refused() -> None:
    base = make_report()
    gpus = (msgspec.structs.replace(base.gpus[0], temperature_celsius=float("nan")), *base.gpus[1:])
    report = msgspec.structs.replace(base, gpus=gpus, time=float("inf"))
    errors = plausibility_errors(report, now=NOW)
    assert any("$.time" in e and "finite" in e for e in errors)
    assert any("$.gpus[0].temperature_celsius" in e for e in errors)


def test_future_check_needs_a_server_clock() -> None:
    # Replay has no server clock: a trace from a fast node clock is still usable.
    report = make_report(time_=NOW + 5 * 86400)
    assert plausibility_errors(report, now=None) == []
    assert plausibility_errors(report, now=NOW) != []


def test_gunzip_bounded_limits_output_exactly() -> None:
    data = b"a" * 1000
    assert gunzip_bounded(gz(data), 1000) == data
    with pytest.raises(DecompressedTooLarge):
        gunzip_bounded(gz(data), 999)
    with pytest.raises(DecompressedTooLarge):
        gunzip_bounded(gz(data[:600]) + gz(data[600:] + b"b"), 1000)


def test_gunzip_bounded_never_holds_more_than_the_limit() -> None:
    # 100 members of 10 MiB of zeros: 1 GiB inflated from about 1 MB.
    bomb = gzip.compress(b"\0" * (10 << 20), compresslevel=9) * 100
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(DecompressedTooLarge):
            gunzip_bounded(bomb, 4 << 20)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    assert elapsed < 1.0


def test_gunzip_bounded_refuses_trailing_garbage_and_zlib() -> None:
    with pytest.raises(ValueError, match="gzip"):
        gunzip_bounded(gz(b"{}") + b"garbage!", 100)
    with pytest.raises(ValueError, match="gzip"):
        gunzip_bounded(zlib.compress(b"{}"), 100)


# -- metrics --------------------------------------------------------------------------------------


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> float:
    for family in families.values():
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels or ''}")


async def test_metrics_endpoint_counts_and_reads_the_pipeline(
    client: TestClient[web.Request, web.Application],
) -> None:
    await post_report(client, make_report(seq=1))
    await post_report(client, make_report(seq=2))
    await post_report(client, make_report(seq=2))
    await client.post(REPORTS_PATH, data=gz(b"nope"), headers=headers())
    await client.post(REPORTS_PATH, data=gz(encode(make_report())), headers=headers("gpu-0002"))
    assert client.app is not None
    metrics = client.app[METRICS_KEY]
    metrics.decision("rule", "quarantined")

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    fams = _families(await resp.text())
    assert _value(fams, "gpuwarden_aggregator_reports_accepted_total") == 2
    assert _value(fams, "gpuwarden_aggregator_reports_duplicate_total") == 1
    assert _value(fams, "gpuwarden_aggregator_reports_rejected_total", {"reason": "bad_json"}) == 1
    assert _value(fams, "gpuwarden_aggregator_reports_rejected_total", {"reason": "node_mismatch"}) == 1
    # Every reason is exported from the start, so a first refusal is a rate, not a new series.
    for reason in REJECT_REASONS:
        _value(fams, "gpuwarden_aggregator_reports_rejected_total", {"reason": reason})
    assert _value(fams, "gpuwarden_aggregator_ingest_seconds_count") == 3
    assert _value(fams, "gpuwarden_aggregator_nodes", {"state": "healthy"}) == 41
    assert _value(fams, "gpuwarden_aggregator_nodes", {"state": "quarantined"}) == 2
    assert _value(fams, "gpuwarden_aggregator_nodes", {"state": "suspect"}) == 0
    assert (
        _value(fams, "gpuwarden_aggregator_decisions_total", {"detector": "rule", "state": "quarantined"})
        == 1
    )


async def test_a_failing_node_state_source_does_not_break_the_scrape(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    pipeline.states = None
    resp = await client.get("/metrics")
    assert resp.status == 200
    fams = _families(await resp.text())
    assert "gpuwarden_aggregator_nodes" not in fams
    assert "gpuwarden_aggregator_reports_accepted" in fams


def test_metrics_must_share_the_registry(pipeline: FakePipeline, token_file: Path, clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="registry"):
        create_app(
            pipeline,
            StaticTokens(token_file),
            Config(),
            clock,
            CollectorRegistry(),
            metrics=Metrics(CollectorRegistry()),
        )


# -- health, readiness, the periodic task ---------------------------------------------------------


async def test_healthz_and_readyz(make_client: MakeClient) -> None:
    problems: list[str] = []
    client = await make_client(readiness=lambda: problems)
    assert (await client.get("/healthz")).status == 200
    resp = await client.get("/readyz")
    assert (resp.status, await resp.json()) == (200, {"status": "ready"})

    problems.append("decision log /var/lib/gpuwarden/decisions.jsonl is not writable")
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert (await resp.json())["problems"] == problems


async def test_readyz_is_not_ready_when_the_check_raises(make_client: MakeClient) -> None:
    def broken() -> list[str]:
        raise OSError("disk gone")

    client = await make_client(readiness=broken)
    resp = await client.get("/readyz")
    assert resp.status == 503
    assert "disk gone" in (await resp.json())["problems"][0]


async def test_advance_runs_periodically_and_survives_failures(
    make_client: MakeClient, pipeline: FakePipeline, registry: CollectorRegistry, clock: FakeClock
) -> None:
    pipeline.advance_failures = 2
    client = await make_client(advance_interval_s=0.01)
    deadline = time.monotonic() + 5.0
    while len(pipeline.advanced) < 5 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert len(pipeline.advanced) >= 5
    assert set(pipeline.advanced) == {clock.time()}
    assert counter(registry, "gpuwarden_aggregator_detection_cycle_failures_total") == 2
    assert counter(registry, "gpuwarden_aggregator_detection_cycle_seconds_count") >= 5

    await client.close()
    stopped_at = len(pipeline.advanced)
    await asyncio.sleep(0.05)
    assert len(pipeline.advanced) == stopped_at


# -- the read API ---------------------------------------------------------------------------------


async def test_nodes_and_node(client: TestClient[web.Request, web.Application], clock: FakeClock) -> None:
    await post_report(client, make_report("gpu-0001"))
    await post_report(client, make_report("gpu-0002"))
    resp = await client.get("/api/v1/nodes", headers=VIEWER)
    assert resp.status == 200
    assert [n["node"] for n in (await resp.json())["nodes"]] == ["gpu-0001", "gpu-0002"]

    resp = await client.get("/api/v1/nodes/gpu-0002", headers=VIEWER)
    assert resp.status == 200
    assert (await resp.json())["last_received"] == clock.time()

    resp = await client.get("/api/v1/nodes/gpu-9999", headers=VIEWER)
    assert resp.status == 404
    assert (await resp.json())["error"] == "unknown_node"


async def test_decisions_since_and_limit(client: TestClient[web.Request, web.Application]) -> None:
    resp = await client.get("/api/v1/decisions", params={"since": str(NOW - 98.0)}, headers=VIEWER)
    assert resp.status == 200
    assert [d["node"] for d in (await resp.json())["decisions"]] == ["gpu-0002", "gpu-0003", "gpu-0004"]

    resp = await client.get(
        "/api/v1/decisions", params={"since": str(NOW - 100.0), "limit": "2"}, headers=VIEWER
    )
    assert len((await resp.json())["decisions"]) == 2

    resp = await client.get("/api/v1/decisions", headers=VIEWER)
    assert len((await resp.json())["decisions"]) == 5


@pytest.mark.parametrize(
    "query",
    [
        {"since": "yesterday"},
        {"since": "nan"},
        {"since": "inf"},
        {"limit": "0"},
        {"limit": "many"},
        {"limit": "100000"},
    ],
)
async def test_bad_decision_queries_are_400(
    client: TestClient[web.Request, web.Application], query: dict[str, str]
) -> None:
    resp = await client.get("/api/v1/decisions", params=query, headers=VIEWER)
    assert resp.status == 400
    answer = await resp.json()
    assert answer["error"] == "bad_request"
    assert next(iter(query)) in answer["message"]


async def test_read_api_failure_is_a_json_500(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    def broken() -> list[dict[str, Any]]:
        raise RuntimeError("boom")

    pipeline.nodes = broken  # type: ignore[method-assign]
    resp = await client.get("/api/v1/nodes", headers=VIEWER)
    assert resp.status == 500
    assert (await resp.json())["error"] == "internal_error"


# -- the compact encoding and its negotiation ---------------------------------------------------------


def compact_headers(node: str = "gpu-0001", **extra: str) -> dict[str, str]:
    out = {"Content-Type": wire.COMPACT_MEDIA_TYPE, "Authorization": f"Bearer {TOKENS[node]}"}
    out.update(extra)
    return out


async def test_a_compact_report_is_ingested_as_the_same_report(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline, clock: FakeClock
) -> None:
    report = make_report()
    resp = await client.post(REPORTS_PATH, data=wire.encode_compact(report), headers=compact_headers())
    assert (resp.status, await resp.json()) == (200, {"status": "accepted"})
    (got, received), *_ = pipeline.ingested
    assert wire.as_v1(got) == report and received == clock.time()
    assert resp.headers["Accept-Post"] == f"application/json, application/msgpack; layout={wire.LAYOUT}"


@pytest.mark.parametrize("ctype", sorted(wire.COMPACT_MEDIA_TYPES))
async def test_compact_is_taken_gzipd_and_under_each_media_type_name(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline, ctype: str
) -> None:
    report = make_report()
    resp = await client.post(
        REPORTS_PATH,
        data=gz(wire.encode_compact(report)),
        headers=compact_headers(**{"Content-Type": ctype, "Content-Encoding": "gzip"}),
    )
    assert resp.status == 200
    assert [wire.as_v1(r) for r, _ in pipeline.ingested] == [report]


async def test_an_old_json_agent_is_still_accepted_and_told_what_else_is_taken(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    status, body = await post_report(client, make_report(seq=1))
    assert (status, body) == (200, {"status": "accepted"})
    resp = await client.post(REPORTS_PATH, data=gz(encode(make_report(seq=2))), headers=headers())
    assert wire.LAYOUT in resp.headers["Accept-Post"]
    assert [r.seq for r, _ in pipeline.ingested] == [1, 2]


async def test_refusals_carry_accept_post_too(client: TestClient[web.Request, web.Application]) -> None:
    resp = await client.post(REPORTS_PATH, data=b"{}", headers={"Content-Type": "application/json"})
    assert resp.status == 401
    assert wire.LAYOUT in resp.headers["Accept-Post"]


async def test_options_says_what_a_post_may_carry(client: TestClient[web.Request, web.Application]) -> None:
    resp = await client.options(REPORTS_PATH)
    assert resp.status == 204
    assert resp.headers["Accept-Post"] == f"application/json, application/msgpack; layout={wire.LAYOUT}"


async def test_a_compact_report_of_another_layout_is_415(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline, registry: CollectorRegistry
) -> None:
    doc = msgspec.msgpack.decode(wire.encode_compact(make_report()))
    doc["layout"] = "0000000000000000"
    resp = await client.post(REPORTS_PATH, data=msgspec.msgpack.encode(doc), headers=compact_headers())
    assert resp.status == 415
    answer = await resp.json()
    assert answer["error"] == "unsupported_media_type" and "send JSON" in answer["message"]
    assert rejected(registry, "unsupported_media_type") == 1
    assert pipeline.ingested == []


async def test_a_compact_row_with_the_wrong_column_count_is_422_naming_it(
    client: TestClient[web.Request, web.Application], registry: CollectorRegistry
) -> None:
    doc = msgspec.msgpack.decode(wire.encode_compact(make_report()))
    doc["gpus"][5][-1][3].append(0)
    resp = await client.post(REPORTS_PATH, data=msgspec.msgpack.encode(doc), headers=compact_headers())
    assert resp.status == 422
    answer = await resp.json()
    assert answer["error"] == "schema_violation"
    assert "wrong column count" in answer["message"] and "$.gpus[5].nvlink[3]" in answer["message"]
    assert rejected(registry, "schema_violation") == 1


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"\xc1", 400, "bad_msgpack"),
        (encode(make_report()), 400, "bad_msgpack"),  # JSON sent as msgpack
        (msgspec.msgpack.encode({"schema": "gpuwarden/report/v2"}), 400, "wrong_schema_version"),
    ],
)
async def test_bodies_that_are_no_compact_report_are_told_apart(
    client: TestClient[web.Request, web.Application],
    registry: CollectorRegistry,
    data: bytes,
    status: int,
    reason: str,
) -> None:
    resp = await client.post(REPORTS_PATH, data=data, headers=compact_headers())
    assert (resp.status, (await resp.json())["error"]) == (status, reason)
    assert rejected(registry, reason) == 1


async def test_a_compact_report_is_checked_for_plausibility_like_json(
    client: TestClient[web.Request, web.Application],
) -> None:
    report = make_report()
    hot = msgspec.structs.replace(report.gpus[0], temperature_celsius=900.0)
    report = msgspec.structs.replace(report, gpus=(hot, *report.gpus[1:]))
    resp = await client.post(REPORTS_PATH, data=wire.encode_compact(report), headers=compact_headers())
    assert resp.status == 422
    answer = await resp.json()
    assert answer["error"] == "implausible_value" and "$.gpus[0].temperature_celsius" in answer["message"]


async def test_a_refused_report_naming_a_forged_field_logs_one_line(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # msgspec's error quotes the unknown key as sent; it reaches the log's message.
    body = json.loads(encode(make_report()))
    body["evil\n2026-12-07 21:00:00,000 CRITICAL aggregator.service: FORGED admin=1"] = 1
    client = await make_client()
    with caplog.at_level(logging.INFO, logger="aggregator.service"):
        resp = await client.post(REPORTS_PATH, data=gz(json.dumps(body).encode()), headers=headers())
    assert resp.status == 422
    refused = [r for r in caplog.records if "FORGED" in r.getMessage()]
    assert refused
    for record in refused:
        assert "\n" not in KeyValueFormatter("%(levelname)s %(name)s: %(message)s").format(record)


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_two_authorization_headers_are_a_bad_request_whoever_they_name(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline, method: str
) -> None:
    # Authorization is one value (RFC 9110 11.6.2): a proxy that checked the last line while we
    # used the first would see another caller. Refused whichever comes first.
    first, second = (f"Bearer {TOKENS['gpu-0002']}", f"Bearer {TOKENS['gpu-0001']}")
    sent = CIMultiDict(headers())
    del sent["Authorization"]
    sent.add("Authorization", first)
    sent.add("Authorization", second)
    if method == "POST":
        resp = await client.post(REPORTS_PATH, data=gz(encode(make_report())), headers=sent)
    else:
        resp = await client.get("/api/v1/nodes", headers=sent)
    assert resp.status == 400
    assert (await resp.json())["error"] == "duplicate_authorization"
    assert pipeline.ingested == []


async def test_content_encoding_on_two_lines_is_one_list(
    client: TestClient[web.Request, web.Application], pipeline: FakePipeline
) -> None:
    # "identity" then "gzip" is "identity, gzip" (RFC 9110 5.3), which this endpoint does not
    # speak: the same 415 as on one line, not the first line taken and the gzip read as JSON.
    sent = CIMultiDict(headers(gzipped=False))
    sent.add("Content-Encoding", "identity")
    sent.add("Content-Encoding", "gzip")
    resp = await client.post(REPORTS_PATH, data=gz(encode(make_report())), headers=sent)
    assert resp.status == 415
    assert (await resp.json())["error"] == "unsupported_encoding"
    assert pipeline.ingested == []


async def test_a_path_or_method_with_no_route_is_refused_as_json_without_versions(
    client: TestClient[web.Request, web.Application],
) -> None:
    resp = await client.get("/no/such/path", headers=VIEWER)
    assert resp.status == 404 and (await resp.json())["error"] == "not_found"
    resp = await client.get(REPORTS_PATH, headers=VIEWER)
    assert resp.status == 405 and (await resp.json())["error"] == "method_not_allowed"
    assert "POST" in resp.headers["Allow"]
    assert resp.headers["Server"] == "gpuwarden"  # not the Python and aiohttp versions
