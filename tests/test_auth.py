"""Bearer-token authentication: the static token file and Kubernetes TokenReview (against a double)."""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from agent.clock import FakeClock
from agent.errors import ConfigError
from agent.report import encode
from aggregator.auth import (
    NODE_NAME_EXTRA,
    AuthError,
    AuthUnavailable,
    Identity,
    StaticTokens,
    TokenReviewAuthenticator,
    parse_token_file,
)
from aggregator.config import Config
from aggregator.metrics import Metrics
from aggregator.service import REPORTS_PATH, SERVER_KWARGS, create_app
from tests.test_service import NOW, FakePipeline, make_report

# -- static tokens --------------------------------------------------------------------------------


class Ticker:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def test_static_tokens_map_each_token_to_its_node(tmp_path: Path) -> None:
    path = write(
        tmp_path / "tokens",
        "# fleet\n\ngpu-0001  s3cret-one-0123456789\n  gpu-0002\ts3cret-two-0123456789  \n"
        "gpu-0001 s3cret-one-rotated-01234\n",
    )
    tokens = StaticTokens(path)
    assert len(tokens) == 3
    assert await tokens.authenticate("s3cret-one-0123456789") == Identity("gpu-0001", "static:gpu-0001")
    assert await tokens.authenticate("s3cret-two-0123456789") == Identity("gpu-0002", "static:gpu-0002")
    # Two tokens for one node: rotation without a gap.
    assert (await tokens.authenticate("s3cret-one-rotated-01234")).node == "gpu-0001"
    for guess in ("s3cret-one-012345678", "s3cret-one-0123456789x", "", "gpu-0001"):
        with pytest.raises(AuthError) as err:
            await tokens.authenticate(guess)
        assert err.value.status == 401


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("gpu-0001\n", "line 1: expected 'node-name token', got 1 fields"),
        ("# ok\ngpu-0001 a b\n", "line 2: expected 'node-name token', got 3 fields"),
        ("GPU_0001 tok-0123456789abcdef\n", "line 1: 'GPU_0001' is not a valid node name"),
        (
            "gpu-0001 same-token-0123456789\ngpu-0002 same-token-0123456789\n",
            "line 2: the token of gpu-0002 is already the token of gpu-0001 (line 1)",
        ),
    ],
)
def test_bad_token_files_name_the_line(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match="tokens") as err:
        parse_token_file(text, "tokens")
    assert says in str(err.value)


def test_unusable_token_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        StaticTokens(tmp_path / "missing")
    with pytest.raises(ConfigError, match="holds no"):
        StaticTokens(write(tmp_path / "empty", "# nobody yet\n"))


async def test_static_tokens_reload_on_change_and_keep_the_last_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "tokens", "gpu-0001 first-token-0123456789\n")
    ticker = Ticker()
    tokens = StaticTokens(path, recheck_seconds=5.0, monotonic=ticker)

    # Replaced atomically, the way a Secret volume updates.
    write(tmp_path / "tokens.new", "gpu-0001 second-token-0123456789\n").replace(path)
    ticker.now = 1.0  # within the recheck interval: not looked at yet
    assert (await tokens.authenticate("first-token-0123456789")).node == "gpu-0001"
    ticker.now = 6.0
    assert (await tokens.authenticate("second-token-0123456789")).node == "gpu-0001"
    with pytest.raises(AuthError):
        await tokens.authenticate("first-token-0123456789")

    # Half-written or broken: the previous tokens stay in force, and it is said once.
    write(path, "gpu-0001\n")
    for step in range(3):
        ticker.now = 12.0 + 6.0 * step
        assert (await tokens.authenticate("second-token-0123456789")).node == "gpu-0001"
    assert [r.getMessage() for r in caplog.records].count(
        "token file unusable, keeping the previous tokens"
    ) == 1
    path.unlink()
    ticker.now = 40.0
    assert (await tokens.authenticate("second-token-0123456789")).node == "gpu-0001"

    write(path, "gpu-0003 third-token-0123456789\n")
    ticker.now = 50.0
    assert (await tokens.authenticate("third-token-0123456789")).node == "gpu-0003"


# -- a TokenReview double -------------------------------------------------------------------------

AGENT_SA = "system:serviceaccount:gpuwarden:gpuwarden-agent"
AGGREGATOR_SA_TOKEN = "aggregator-sa-token"


@dataclass
class ApiServer:
    """The TokenReview endpoint of a Kubernetes API server, with canned answers per token."""

    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    reviews: list[dict[str, Any]] = field(default_factory=list)
    callers: list[str] = field(default_factory=list)
    fail_with: int | None = None

    def app(self) -> web.Application:
        async def review(request: web.Request) -> web.Response:
            self.callers.append(request.headers.get("Authorization", ""))
            if self.fail_with is not None:
                return web.json_response({"kind": "Status", "code": self.fail_with}, status=self.fail_with)
            if not request.headers.get("Authorization", "").startswith("Bearer "):
                return web.json_response({"kind": "Status", "code": 401}, status=401)
            body = await request.json()
            self.reviews.append(body)
            assert body["apiVersion"] == "authentication.k8s.io/v1"
            assert body["kind"] == "TokenReview"
            status = self.answers.get(
                body["spec"]["token"], {"authenticated": False, "error": "invalid bearer token"}
            )
            return web.json_response({**body, "status": status}, status=201)

        app = web.Application()
        app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", review)
        return app

    def bound(
        self, token: str, node: str, *, user: str = AGENT_SA, audiences: list[str] | None = None
    ) -> None:
        self.answers[token] = {
            "authenticated": True,
            "user": {
                "username": user,
                "uid": "0b1d-uid",
                "groups": ["system:serviceaccounts", "system:authenticated"],
                "extra": {
                    "authentication.kubernetes.io/pod-name": ["gpuwarden-agent-x7k2p"],
                    NODE_NAME_EXTRA: [node],
                },
            },
            "audiences": ["gpuwarden"] if audiences is None else audiences,
        }


@pytest.fixture
def api() -> ApiServer:
    return ApiServer()


@pytest.fixture
async def api_url(aiohttp_server: Any, api: ApiServer) -> str:
    server = await aiohttp_server(api.app())
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
def sa_token(tmp_path: Path) -> Path:
    return write(tmp_path / "sa-token", AGGREGATOR_SA_TOKEN + "\n")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def reviewer(api_url: str, sa_token: Path, clock: FakeClock, registry: CollectorRegistry) -> Any:
    auth = TokenReviewAuthenticator(
        api_url,
        sa_token,
        audience="gpuwarden",
        agent_namespace="gpuwarden",
        agent_service_account="gpuwarden-agent",
        clock=clock,
        cache_seconds=60.0,
        metrics=Metrics(registry),
    )
    yield auth
    await auth.close()


def reviews(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("gpuwarden_aggregator_token_reviews_total", {"result": result})
    assert value is not None
    return value


async def test_bound_agent_token_is_accepted_for_its_node(
    reviewer: TokenReviewAuthenticator, api: ApiServer
) -> None:
    api.bound("agent-token-1", "gpu-0001")
    assert await reviewer.authenticate("agent-token-1") == Identity("gpu-0001", AGENT_SA)
    assert api.reviews[0]["spec"] == {"token": "agent-token-1", "audiences": ["gpuwarden"]}
    assert api.callers == [f"Bearer {AGGREGATOR_SA_TOKEN}"]


async def test_denied_token_is_401_and_not_cached(
    reviewer: TokenReviewAuthenticator, api: ApiServer, registry: CollectorRegistry
) -> None:
    for _ in range(2):
        with pytest.raises(AuthError, match="invalid bearer token") as err:
            await reviewer.authenticate("forged")
        assert err.value.status == 401
    assert len(api.reviews) == 2
    assert reviews(registry, "denied") == 2


async def test_token_for_another_audience_is_refused(
    reviewer: TokenReviewAuthenticator, api: ApiServer
) -> None:
    # An API server that ignored spec.audiences and answered with its own.
    api.bound("kube-token", "gpu-0001", audiences=["https://kubernetes.default.svc"])
    with pytest.raises(AuthError, match="audience") as err:
        await reviewer.authenticate("kube-token")
    assert err.value.status == 401


async def test_other_service_accounts_are_forbidden(
    reviewer: TokenReviewAuthenticator, api: ApiServer
) -> None:
    api.bound("other-token", "gpu-0001", user="system:serviceaccount:default:builder")
    with pytest.raises(AuthError, match="builder") as err:
        await reviewer.authenticate("other-token")
    assert (err.value.status, err.value.reason) == (403, "forbidden")


async def test_unbound_token_has_no_node(reviewer: TokenReviewAuthenticator, api: ApiServer) -> None:
    api.bound("legacy-token", "gpu-0001")
    del api.answers["legacy-token"]["user"]["extra"][NODE_NAME_EXTRA]
    assert await reviewer.authenticate("legacy-token") == Identity(None, AGENT_SA)


async def test_positive_answers_are_cached_for_the_ttl(
    reviewer: TokenReviewAuthenticator, api: ApiServer, clock: FakeClock, registry: CollectorRegistry
) -> None:
    api.bound("agent-token-1", "gpu-0001")
    for _ in range(5):
        assert (await reviewer.authenticate("agent-token-1")).node == "gpu-0001"
        clock.advance(10.0)
    assert len(api.reviews) == 1
    assert reviews(registry, "cached") == 4
    clock.advance(20.0)  # 60 s since the review
    assert (await reviewer.authenticate("agent-token-1")).node == "gpu-0001"
    assert len(api.reviews) == 2


async def test_revoked_token_is_refused_once_the_cache_expires(
    reviewer: TokenReviewAuthenticator, api: ApiServer, clock: FakeClock
) -> None:
    api.bound("agent-token-1", "gpu-0001")
    await reviewer.authenticate("agent-token-1")
    api.answers.clear()
    clock.advance(61.0)
    with pytest.raises(AuthError):
        await reviewer.authenticate("agent-token-1")


async def test_cache_is_bounded(api_url: str, sa_token: Path, api: ApiServer, clock: FakeClock) -> None:
    auth = TokenReviewAuthenticator(
        api_url,
        sa_token,
        audience="gpuwarden",
        agent_namespace="gpuwarden",
        agent_service_account="gpuwarden-agent",
        clock=clock,
        cache_max_entries=3,
    )
    try:
        for i in range(5):
            api.bound(f"t{i}", f"gpu-{i:04d}")
            await auth.authenticate(f"t{i}")
        await auth.authenticate("t4")  # the newest is still cached
        assert len(api.reviews) == 5
        await auth.authenticate("t0")  # the oldest was evicted
        assert len(api.reviews) == 6
    finally:
        await auth.close()


async def test_api_server_trouble_is_unavailable_not_unauthorized(
    reviewer: TokenReviewAuthenticator, api: ApiServer, registry: CollectorRegistry
) -> None:
    api.bound("agent-token-1", "gpu-0001")
    api.fail_with = 403  # our own service account lacks system:auth-delegator
    with pytest.raises(AuthUnavailable, match="403"):
        await reviewer.authenticate("agent-token-1")
    api.fail_with = 500
    with pytest.raises(AuthUnavailable, match="500"):
        await reviewer.authenticate("agent-token-1")
    assert reviews(registry, "error") == 2
    api.fail_with = None
    assert (await reviewer.authenticate("agent-token-1")).node == "gpu-0001"


async def test_unreachable_api_server_is_unavailable(sa_token: Path, clock: FakeClock) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = TokenReviewAuthenticator(
        f"http://127.0.0.1:{port}",
        sa_token,
        audience="gpuwarden",
        agent_namespace="gpuwarden",
        agent_service_account="gpuwarden-agent",
        clock=clock,
        timeout_s=2.0,
    )
    try:
        with pytest.raises(AuthUnavailable):
            await auth.authenticate("agent-token-1")
    finally:
        await auth.close()


async def test_own_token_is_reread_when_rotated(
    reviewer: TokenReviewAuthenticator, api: ApiServer, sa_token: Path
) -> None:
    api.bound("a", "gpu-0001")
    api.bound("b", "gpu-0002")
    await reviewer.authenticate("a")
    write(sa_token.with_suffix(".new"), "aggregator-sa-token-rotated\n").replace(sa_token)
    await reviewer.authenticate("b")
    assert api.callers == [f"Bearer {AGGREGATOR_SA_TOKEN}", "Bearer aggregator-sa-token-rotated"]


def test_bad_tokenreview_settings_are_config_errors(tmp_path: Path, sa_token: Path, clock: FakeClock) -> None:
    common: dict[str, Any] = {"agent_namespace": "gpuwarden", "agent_service_account": "a", "clock": clock}
    with pytest.raises(ConfigError, match="audience"):
        TokenReviewAuthenticator("https://k8s", sa_token, audience="", **common)
    with pytest.raises(ConfigError, match="https://"):
        TokenReviewAuthenticator("k8s:443", sa_token, audience="gpuwarden", **common)
    with pytest.raises(ConfigError, match="service-account token"):
        TokenReviewAuthenticator("https://k8s", tmp_path / "nope", audience="gpuwarden", **common)
    with pytest.raises(ConfigError, match="CA"):
        TokenReviewAuthenticator(
            "https://k8s", sa_token, audience="gpuwarden", ca_file=write(tmp_path / "ca", "junk"), **common
        )
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        TokenReviewAuthenticator.in_cluster(audience="gpuwarden", environ={}, **common)


# -- in-cluster over TLS, end to end through the service ------------------------------------------


@pytest.fixture
def in_cluster_dir(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A service-account directory (token, ca.crt) and the API server's TLS context."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("openssl not installed: scripts/setup installs it")  # CI must test TLS
        pytest.skip("openssl not installed")
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    cert, key = sa_dir / "ca.crt", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    write(sa_dir / "token", AGGREGATOR_SA_TOKEN)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return sa_dir, ctx


async def test_in_cluster_tokenreview_through_the_service(
    in_cluster_dir: tuple[Path, ssl.SSLContext],
    api: ApiServer,
    aiohttp_client: Any,
    clock: FakeClock,
    registry: CollectorRegistry,
) -> None:
    sa_dir, tls = in_cluster_dir
    api_server = TestServer(api.app())
    await api_server.start_server(ssl=tls)
    try:
        metrics = Metrics(registry)
        auth = TokenReviewAuthenticator.in_cluster(
            audience="gpuwarden",
            agent_namespace="gpuwarden",
            agent_service_account="gpuwarden-agent",
            clock=clock,
            environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_server.port)},
            service_account_dir=sa_dir,
            metrics=metrics,
        )
        pipeline = FakePipeline()
        app = create_app(pipeline, auth, Config(), clock, registry, metrics=metrics, advance_interval_s=None)
        server = TestServer(app)
        await server.start_server(**SERVER_KWARGS)
        client: TestClient[web.Request, web.Application] = await aiohttp_client(server)

        api.bound("token-of-0001", "gpu-0001")
        api.bound("legacy-token", "gpu-0001")
        del api.answers["legacy-token"]["user"]["extra"][NODE_NAME_EXTRA]

        async def send(token: str, node: str, seq: int) -> tuple[int, str]:
            resp = await client.post(
                REPORTS_PATH,
                data=gzip.compress(encode(make_report(node, seq))),
                headers={
                    "Authorization": f"Bearer {token}",
                    "Content-Type": "application/json",
                    "Content-Encoding": "gzip",
                },
            )
            answer = await resp.json()
            return resp.status, answer.get("error", answer.get("status"))

        assert await send("token-of-0001", "gpu-0001", 1) == (200, "accepted")
        assert await send("token-of-0001", "gpu-0001", 2) == (200, "accepted")  # from the cache
        assert await send("token-of-0001", "gpu-0002", 3) == (403, "node_mismatch")
        assert await send("legacy-token", "gpu-0001", 4) == (403, "node_unbound")
        assert await send("forged", "gpu-0001", 5) == (401, "bad_token")
        assert [(r.node, r.seq) for r, _ in pipeline.ingested] == [("gpu-0001", 1), ("gpu-0001", 2)]
        assert len(api.reviews) == 3  # token-of-0001 once, legacy-token, forged
        await client.close()  # closes the authenticator's HTTP session with the app
        assert auth._session is None
    finally:
        await api_server.close()


def test_in_cluster_needs_the_cluster_ca(tmp_path: Path, clock: FakeClock) -> None:
    sa_dir = tmp_path / "sa"
    sa_dir.mkdir()
    write(sa_dir / "token", "t")
    with pytest.raises(ConfigError, match="CA"):  # no ca.crt: refused at start, not per request
        TokenReviewAuthenticator.in_cluster(
            audience="gpuwarden",
            agent_namespace="gpuwarden",
            agent_service_account="gpuwarden-agent",
            clock=clock,
            environ={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"},
            service_account_dir=sa_dir,
        )
