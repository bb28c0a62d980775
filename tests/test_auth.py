"""Bearer-token authentication: the static token file and Kubernetes TokenReview (against a double)."""

from __future__ import annotations

import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
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
from aggregator.kube.client import KubeClient
from aggregator.kube.objects import TokenReviewStatus, UserInfo
from aggregator.metrics import Metrics
from aggregator.service import REPORTS_PATH, SERVER_KWARGS, create_app
from tests.kube_double import KubeApiDouble
from tests.test_service import NOW, FakePipeline, make_report
from tests.tls import self_signed

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


# -- TokenReview, against the API-server double (tests/kube_double.py) ----------------------------

AGENT_SA = "system:serviceaccount:gpuwarden:gpuwarden-agent"
AGGREGATOR_SA_TOKEN = "aggregator-sa-token"
AGENT_POD = "gpuwarden-agent-x7k2p"


def agent_token(kube: KubeApiDouble, node: str | None, **kwargs: Any) -> str:
    """A token as the kubelet projects it into an agent pod: audience ``gpuwarden``, bound to the
    pod and to its node (``node`` None: a token bound to nothing, as a legacy secret's)."""
    kwargs.setdefault("audiences", ["gpuwarden"])
    return kube.issue_token(
        kwargs.pop("namespace", "gpuwarden"),
        kwargs.pop("service_account", "gpuwarden-agent"),
        pod=AGENT_POD if node is not None else None,
        node=node,
        **kwargs,
    )


@pytest.fixture
async def kube() -> AsyncIterator[KubeApiDouble]:
    async with KubeApiDouble(token=AGGREGATOR_SA_TOKEN) as api:
        yield api


@pytest.fixture
async def kube_client(kube: KubeApiDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    """The real client, configured from a kubeconfig (the out-of-cluster way)."""
    client = await KubeClient.from_kubeconfig(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    yield client
    await client.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def reviewer_for(kube: KubeClient | Any, clock: FakeClock, **kwargs: Any) -> TokenReviewAuthenticator:
    return TokenReviewAuthenticator(
        kube,
        audience="gpuwarden",
        agent_namespace="gpuwarden",
        agent_service_account="gpuwarden-agent",
        clock=clock,
        **kwargs,
    )


@pytest.fixture
def reviewer(
    kube_client: KubeClient, clock: FakeClock, registry: CollectorRegistry
) -> TokenReviewAuthenticator:
    return reviewer_for(kube_client, clock, cache_seconds=60.0, metrics=Metrics(registry))


def reviews(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("gpuwarden_aggregator_token_reviews_total", {"result": result})
    assert value is not None
    return value


async def test_bound_agent_token_is_accepted_for_its_node(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble
) -> None:
    token = agent_token(kube, "gpu-0001")
    assert await reviewer.authenticate(token) == Identity("gpu-0001", AGENT_SA)
    (review,) = kube.token_reviews
    assert review["spec"] == {"token": token, "audiences": ["gpuwarden"]}
    assert kube.callers == [f"Bearer {AGGREGATOR_SA_TOKEN}"]  # the kubeconfig's credentials


async def test_denied_token_is_401_and_not_cached(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, registry: CollectorRegistry
) -> None:
    for _ in range(2):
        with pytest.raises(AuthError, match="invalid bearer token") as err:
            await reviewer.authenticate("forged")
        assert err.value.status == 401
    assert len(kube.token_reviews) == 2
    assert reviews(registry, "denied") == 2


async def test_token_for_another_audience_is_refused(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble
) -> None:
    # The pod's default token, for the API server itself: not meant for gpuwarden.
    token = agent_token(kube, "gpu-0001", audiences=["https://kubernetes.default.svc.cluster.local"])
    with pytest.raises(AuthError, match="audience") as err:
        await reviewer.authenticate(token)
    assert err.value.status == 401


class AudienceBlindKube:
    """A TokenReview answer that ignored spec.audiences (an authenticator in front of the API
    server that is not audience-aware): authenticated, for audiences of its own."""

    async def create_token_review(self, token: str, audiences: Sequence[str]) -> TokenReviewStatus:
        user = UserInfo(AGENT_SA, extra={NODE_NAME_EXTRA: ("gpu-0001",)})
        return TokenReviewStatus(authenticated=True, user=user, audiences=("https://kubernetes.default.svc",))

    async def close(self) -> None:
        pass


async def test_an_answer_for_other_audiences_is_refused(clock: FakeClock) -> None:
    auth = reviewer_for(AudienceBlindKube(), clock)
    with pytest.raises(AuthError, match="not for audience 'gpuwarden'") as err:
        await auth.authenticate("agent-token")
    assert err.value.status == 401


async def test_other_service_accounts_are_forbidden(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble
) -> None:
    token = agent_token(kube, "gpu-0001", namespace="default", service_account="builder")
    with pytest.raises(AuthError, match="builder") as err:
        await reviewer.authenticate(token)
    assert (err.value.status, err.value.reason) == (403, "forbidden")


async def test_unbound_token_has_no_node(reviewer: TokenReviewAuthenticator, kube: KubeApiDouble) -> None:
    assert await reviewer.authenticate(agent_token(kube, None)) == Identity(None, AGENT_SA)


async def test_positive_answers_are_cached_for_the_ttl(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, clock: FakeClock, registry: CollectorRegistry
) -> None:
    token = agent_token(kube, "gpu-0001")
    for _ in range(5):
        assert (await reviewer.authenticate(token)).node == "gpu-0001"
        clock.advance(10.0)
    assert len(kube.token_reviews) == 1
    assert reviews(registry, "cached") == 4
    clock.advance(20.0)  # 60 s since the review
    assert (await reviewer.authenticate(token)).node == "gpu-0001"
    assert len(kube.token_reviews) == 2


async def test_revoked_token_is_refused_once_the_cache_expires(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, clock: FakeClock
) -> None:
    token = agent_token(kube, "gpu-0001")
    await reviewer.authenticate(token)
    kube.revoke_token(token)  # the agent's pod was deleted
    clock.advance(59.0)
    assert (await reviewer.authenticate(token)).node == "gpu-0001"  # cached
    clock.advance(2.0)
    with pytest.raises(AuthError, match="invalid bearer token"):
        await reviewer.authenticate(token)


async def test_cache_is_bounded(kube_client: KubeClient, kube: KubeApiDouble, clock: FakeClock) -> None:
    auth = reviewer_for(kube_client, clock, cache_max_entries=3)
    tokens = [agent_token(kube, f"gpu-{i:04d}") for i in range(5)]
    for token in tokens:
        await auth.authenticate(token)
    await auth.authenticate(tokens[4])  # the newest is still cached
    assert len(kube.token_reviews) == 5
    await auth.authenticate(tokens[0])  # the oldest was evicted
    assert len(kube.token_reviews) == 6


async def test_api_server_trouble_is_unavailable_not_unauthorized(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, registry: CollectorRegistry, clock: FakeClock
) -> None:
    token = agent_token(kube, "gpu-0001")
    kube.fail_next("POST", "tokenreviews", 403)  # our own service account lacks system:auth-delegator
    with pytest.raises(AuthUnavailable, match="403"):
        await reviewer.authenticate(token)
    clock.advance(1.0)
    kube.fail_next("POST", "tokenreviews", 500)
    with pytest.raises(AuthUnavailable, match="500"):
        await reviewer.authenticate(token)
    assert reviews(registry, "error") == 2
    clock.advance(2.0)
    assert (await reviewer.authenticate(token)).node == "gpu-0001"


async def test_a_shedding_api_server_gets_no_review_per_report_while_it_sheds(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, registry: CollectorRegistry, clock: FakeClock
) -> None:
    # API Priority and Fairness sheds TokenReviews (429). With the cache emptied, every report of
    # every agent would be one more review in the flow our Lease renewals share: instead new
    # reviews wait a second, doubling while the shedding lasts, and agents are told to retry.
    tokens = [agent_token(kube, f"gpu-{i:04d}") for i in range(50)]
    kube.throttle(share=1.0, verbs=("create",), path_regex="tokenreviews")
    for _ in range(20):  # 20 s of every agent reporting once a second
        for token in tokens:
            with pytest.raises(AuthUnavailable):
                await reviewer.authenticate(token)
        clock.advance(1.0)
    posts = sum(1 for r in kube.requests if r[0] == "POST" and "tokenreviews" in r[1])
    assert posts <= 6  # at 0, 1, 3, 7, 15 s (the wait capped at 8 s), not 1,000
    assert reviews(registry, "error") == 50 * 20
    kube.throttle()
    clock.advance(8.0)
    assert (await reviewer.authenticate(tokens[0])).node == "gpu-0000"  # back at the first answer
    clock.advance(0.5)
    assert (await reviewer.authenticate(tokens[1])).node == "gpu-0001"


async def test_reviews_wait_as_long_as_the_api_server_asks(
    reviewer: TokenReviewAuthenticator, kube: KubeApiDouble, clock: FakeClock
) -> None:
    token = agent_token(kube, "gpu-0001")
    kube.throttle(burst=1, retry_after=5, verbs=("create",), path_regex="tokenreviews")
    with pytest.raises(AuthUnavailable):
        await reviewer.authenticate(token)
    clock.advance(4.5)  # past our own first wait (1 s), short of the server's Retry-After
    with pytest.raises(AuthUnavailable, match="backing off"):
        await reviewer.authenticate(token)
    assert sum(1 for r in kube.requests if r[0] == "POST" and "tokenreviews" in r[1]) == 1
    clock.advance(0.5)
    assert (await reviewer.authenticate(token)).node == "gpu-0001"


async def test_unreachable_api_server_is_unavailable(tmp_path: Path, clock: FakeClock) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = write(
        tmp_path / "kubeconfig",
        f"""
apiVersion: v1
kind: Config
clusters: [{{name: gone, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: gone, context: {{cluster: gone, user: u}}}}]
current-context: gone
""",
    )
    client = await KubeClient.from_kubeconfig(kubeconfig, request_timeout=2.0)
    auth = reviewer_for(client, clock, owns_client=True)
    try:
        with pytest.raises(AuthUnavailable):
            await auth.authenticate("agent-token-1")
    finally:
        await auth.close()
    assert auth.closed


async def test_bad_tokenreview_settings_are_config_errors(
    tmp_path: Path, kube_client: KubeClient, clock: FakeClock
) -> None:
    common: dict[str, Any] = {"agent_namespace": "gpuwarden", "agent_service_account": "a", "clock": clock}
    with pytest.raises(ConfigError, match="audience"):
        TokenReviewAuthenticator(kube_client, audience="", **common)
    with pytest.raises(ConfigError, match="cache"):
        TokenReviewAuthenticator(kube_client, audience="gpuwarden", cache_max_entries=0, **common)
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        TokenReviewAuthenticator.in_cluster(audience="gpuwarden", environ={}, **common)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    sa_dir = tmp_path / "sa"
    sa_dir.mkdir()
    with pytest.raises(ConfigError, match="service-account token"):
        TokenReviewAuthenticator.in_cluster(
            audience="gpuwarden", environ=env, service_account_dir=sa_dir, **common
        )
    write(sa_dir / "token", "t")
    write(sa_dir / "ca.crt", "junk")
    with pytest.raises(ConfigError, match="CA"):
        TokenReviewAuthenticator.in_cluster(
            audience="gpuwarden", environ=env, service_account_dir=sa_dir, **common
        )


# -- in-cluster over TLS, end to end through the service ------------------------------------------


@pytest.fixture
def in_cluster_dir(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A service-account directory (token, ca.crt) and the API server's TLS context."""
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    cert, key = sa_dir / "ca.crt", tmp_path / "key.pem"
    self_signed(cert, key)
    write(sa_dir / "token", AGGREGATOR_SA_TOKEN)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return sa_dir, ctx


@pytest.fixture
async def tls_kube(in_cluster_dir: tuple[Path, ssl.SSLContext]) -> AsyncIterator[KubeApiDouble]:
    async with KubeApiDouble(token=AGGREGATOR_SA_TOKEN, ssl_context=in_cluster_dir[1]) as api:
        yield api


def in_cluster_auth(
    kube: KubeApiDouble, sa_dir: Path, clock: FakeClock, **kwargs: Any
) -> TokenReviewAuthenticator:
    """The authenticator as ``gpuwarden aggregator --auth tokenreview`` makes it in a pod whose
    ``KUBERNETES_SERVICE_HOST``/``_PORT`` point at the double."""
    return TokenReviewAuthenticator.in_cluster(
        audience="gpuwarden",
        agent_namespace="gpuwarden",
        agent_service_account="gpuwarden-agent",
        clock=clock,
        environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube.port)},
        service_account_dir=sa_dir,
        **kwargs,
    )


async def test_in_cluster_tokenreview_through_the_service(
    in_cluster_dir: tuple[Path, ssl.SSLContext],
    tls_kube: KubeApiDouble,
    aiohttp_client: Any,
    clock: FakeClock,
    registry: CollectorRegistry,
) -> None:
    sa_dir, _ = in_cluster_dir
    metrics = Metrics(registry)
    auth = in_cluster_auth(tls_kube, sa_dir, clock, metrics=metrics)
    pipeline = FakePipeline()
    app = create_app(pipeline, auth, Config(), clock, registry, metrics=metrics, advance_interval_s=None)
    server = TestServer(app)
    await server.start_server(**SERVER_KWARGS)
    client: TestClient[web.Request, web.Application] = await aiohttp_client(server)

    bound = agent_token(tls_kube, "gpu-0001")
    legacy = agent_token(tls_kube, None)

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

    assert await send(bound, "gpu-0001", 1) == (200, "accepted")
    assert await send(bound, "gpu-0001", 2) == (200, "accepted")  # from the cache
    assert await send(bound, "gpu-0002", 3) == (403, "node_mismatch")
    assert await send(legacy, "gpu-0001", 4) == (403, "node_unbound")
    assert await send("forged", "gpu-0001", 5) == (401, "bad_token")
    assert [(r.node, r.seq) for r, _ in pipeline.ingested] == [("gpu-0001", 1), ("gpu-0001", 2)]
    assert len(tls_kube.token_reviews) == 3  # the bound token once, the legacy one, the forged one
    assert set(tls_kube.callers) == {f"Bearer {AGGREGATOR_SA_TOKEN}"}  # the pod's service account
    await client.close()  # closes the authenticator, and its Kubernetes client, with the app
    assert auth.closed


async def test_own_token_is_reread_when_rotated(
    in_cluster_dir: tuple[Path, ssl.SSLContext], tls_kube: KubeApiDouble, clock: FakeClock
) -> None:
    sa_dir, _ = in_cluster_dir
    auth = in_cluster_auth(tls_kube, sa_dir, clock)
    try:
        await auth.authenticate(agent_token(tls_kube, "gpu-0001"))
        tls_kube.accept_token("aggregator-sa-token-rotated")
        write(sa_dir / "token.new", "aggregator-sa-token-rotated\n").replace(
            sa_dir / "token"
        )  # as the kubelet swaps it
        await auth.authenticate(agent_token(tls_kube, "gpu-0002"))
    finally:
        await auth.close()
    assert tls_kube.callers == [f"Bearer {AGGREGATOR_SA_TOKEN}", "Bearer aggregator-sa-token-rotated"]


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


class ReviewedAs:
    """A TokenReview that authenticates every token as one user, for our audience."""

    def __init__(self, user: UserInfo) -> None:
        self.user = user

    async def create_token_review(self, token: str, audiences: Sequence[str]) -> TokenReviewStatus:
        return TokenReviewStatus(authenticated=True, user=self.user, audiences=("gpuwarden",))

    async def close(self) -> None:
        pass


async def test_configured_viewer_accounts_and_groups_may_read_and_nobody_else(clock: FakeClock) -> None:
    grafana = "system:serviceaccount:monitoring:grafana"
    viewers = {"viewer_service_accounts": [grafana], "viewer_groups": ["sre"]}
    identity = await reviewer_for(ReviewedAs(UserInfo(grafana)), clock, **viewers).authenticate("t")
    assert identity == Identity(None, grafana, "viewer")
    alice = await reviewer_for(ReviewedAs(UserInfo("alice", groups=("sre",))), clock, **viewers).authenticate(
        "t"
    )
    assert alice.role == "viewer" and alice.node is None
    with pytest.raises(AuthError) as err:
        await reviewer_for(ReviewedAs(UserInfo("mallory", groups=("dev",))), clock, **viewers).authenticate(
            "t"
        )
    assert err.value.status == 403
    # The agent's own account stays a node identity, even if it is in a viewer group.
    agent = UserInfo(AGENT_SA, groups=("sre",), extra={NODE_NAME_EXTRA: ("gpu-0001",)})
    assert await reviewer_for(ReviewedAs(agent), clock, **viewers).authenticate("t") == Identity(
        "gpu-0001", AGENT_SA
    )


async def test_static_viewer_lines(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("gpu-0001 tok-gpu-0001-0123456789abcdef\nviewer:grafana tok-viewer-0123456789abcdef\n")
    tokens = StaticTokens(path)
    viewer = await tokens.authenticate("tok-viewer-0123456789abcdef")
    assert viewer == Identity(None, "static:viewer:grafana", "viewer")
    node = await tokens.authenticate("tok-gpu-0001-0123456789abcdef")
    assert node.role == "node" and node.node == "gpu-0001"
