"""Who is sending this report: bearer tokens, from a static file or Kubernetes TokenReview.

An ``Authenticator`` turns a bearer token into an ``Identity``: the node the credential is bound
to, and a subject for logs. It raises ``AuthError`` for a token it does not accept, and
``AuthUnavailable`` when it cannot tell (the API server is down): the service answers 401/403 for
the first and 503 for the second, so an agent keeps its reports and retries either way.

Roles: a *node* identity (bound to one node) may only send that node's reports; a *viewer* may
read the API, the metrics and the status page, and send nothing. Static viewer tokens are
``viewer:<name> token`` lines in the token file; through TokenReview a viewer is a service
account or group listed in ``auth.viewer_service_accounts`` / ``auth.viewer_groups`` (its token
requested for the same audience: ``kubectl create token NAME --audience gpuwarden``).

Whether the identity may report for the node named in the report is the service's check, not the
authenticator's: a token bound to ``gpu-0042`` can only ever report ``gpu-0042``, which keeps one
compromised node from framing (or hiding) another.

Two implementations:

- ``StaticTokens``: a file of ``node-name token`` lines, re-read when it changes. Tokens are
  compared by SHA-256 digest, so the lookup's timing depends on the digest, never on how many
  leading characters of a guess are right.
- ``TokenReviewAuthenticator``: asks the Kubernetes API server (``TokenReview``) through the
  Kubernetes boundary (``aggregator.kube``), in a pod with the aggregator's own service-account
  token, elsewhere with a kubeconfig's credentials. The reviewed token must be authenticated for our
  audience, belong to the agent's service account, and carry the node it was issued on
  (``authentication.kubernetes.io/node-name``, set on pod-bound tokens since Kubernetes 1.30).
  Positive answers are cached briefly, so 7,500 nodes reporting every 10 s cost the API server
  about 125 reviews a second at most, not 750. A review the API server answers with no verdict
  (429, 5xx, none) holds new reviews back for a second, doubling to ``REVIEW_BACKOFF_MAX_S``
  while it lasts: uncached agents are told to retry (503) meanwhile, cached ones are unaffected.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol, runtime_checkable

from multidict import CIMultiDictProxy

from agent.clock import Clock
from agent.errors import ConfigError, GpuwardenError
from aggregator.kube.api import KubeApi
from aggregator.kube.client import SERVICE_ACCOUNT_DIR, KubeClient
from aggregator.kube.objects import KubeError, KubeForbidden, TokenReviewStatus
from aggregator.metrics import Metrics

log = logging.getLogger(__name__)

__all__ = [
    "NODE_NAME_EXTRA",
    "SERVICE_ACCOUNT_DIR",
    "VIEWER_PREFIX",
    "AuthError",
    "AuthUnavailable",
    "Authenticator",
    "Identity",
    "Role",
    "StaticTokens",
    "SupportsClose",
    "TokenReviewAuthenticator",
    "bearer_token",
    "parse_token_file",
]

NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"
REVIEW_BACKOFF_S: Final = 1.0  # APF answers a shed request with Retry-After: 1
REVIEW_BACKOFF_MAX_S: Final = 8.0

# The report schema's node name pattern: a token file naming anything else could never match.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_NODE_NAME_MAX = 253
# Shorter tokens are guessable; warned about rather than refused so a lab setup still starts.
_WEAK_TOKEN_CHARS: Final = 16


Role = Literal["node", "viewer"]
VIEWER_PREFIX: Final = "viewer:"  # a static token file line for a viewer: ``viewer:<name> token``


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller: the node its credential is bound to (None: not node-bound), and
    what it may do (``node``: send that node's reports; ``viewer``: read)."""

    node: str | None
    subject: str
    role: Role = "node"


class AuthError(GpuwardenError):
    """The token is not accepted. ``status`` 401 (unknown/invalid) or 403 (valid, not allowed)."""

    def __init__(self, message: str, *, reason: str = "bad_token", status: int = 401) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def authorization(headers: CIMultiDictProxy[str]) -> str | None:
    """The request's one ``Authorization`` header (None: none). ``AuthError`` (400,
    ``duplicate_authorization``) for two or more: the field is a single value (RFC 9110 11.6.2),
    and a proxy that checked the last one while we used the first would see another caller."""
    values = headers.getall("Authorization", ())
    if len(values) > 1:
        raise AuthError(
            f"{len(values)} Authorization headers; send one", reason="duplicate_authorization", status=400
        )
    return values[0] if values else None


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; ``AuthError`` (401,
    ``missing_token``) for none or another scheme."""
    if header is None:
        raise AuthError("an Authorization: Bearer <token> header is required", reason="missing_token")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("the Authorization header must be 'Bearer <token>'", reason="missing_token")
    return token


def reader_token(header: str | None) -> str:
    """The token of a read: ``Bearer <token>``, or HTTP Basic with the token as the password (any
    user name), which is how a browser sends it when the status page asks (``WWW-Authenticate:
    Basic``). ``AuthError`` (401, ``missing_token``) for neither."""
    if header is not None and header.strip().lower().startswith("basic "):
        try:
            decoded = base64.b64decode(header.strip()[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise AuthError(
                "the Basic credentials are not base64 of user:token", reason="missing_token"
            ) from None
        token = decoded.partition(":")[2].strip()
        if not token:
            raise AuthError("give the viewer token as the password", reason="missing_token")
        return token
    return bearer_token(header)


class AuthUnavailable(GpuwardenError):
    """The token could not be checked right now (API server unreachable or refusing us)."""


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> Identity:
        """The identity behind ``token``; ``AuthError`` if refused, ``AuthUnavailable`` if unknown."""
        ...


@runtime_checkable
class SupportsClose(Protocol):
    async def close(self) -> None: ...


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def parse_token_file(text: str, source: str) -> dict[bytes, str]:
    """``node-name token`` lines -> {sha256(token): node}; ``ConfigError`` naming the line.

    ``#`` starts a comment line; blank lines are ignored. A node may have several tokens (so a
    token can be rotated without a gap), but a token belongs to exactly one node. A first field
    ``viewer:<name>`` is a viewer's token (the value kept is that field, prefix included).
    """
    by_digest: dict[bytes, str] = {}
    first_line: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ConfigError(f"{source} line {number}: expected 'node-name token', got {len(fields)} fields")
        node, token = fields
        name = node.removeprefix(VIEWER_PREFIX)
        if len(name) > _NODE_NAME_MAX or not _NODE_NAME.match(name):
            raise ConfigError(
                f"{source} line {number}: {node!r} is not a valid node name "
                "(lowercase letters, digits, '-' and '.', as in Kubernetes)"
            )
        digest = _digest(token)
        if digest in by_digest:
            raise ConfigError(
                f"{source} line {number}: the token of {node} is already the token of "
                f"{by_digest[digest]} (line {first_line[digest]}); each node needs its own"
            )
        if len(token) < _WEAK_TOKEN_CHARS:
            log.warning(
                "weak static token: shorter than %d characters",
                _WEAK_TOKEN_CHARS,
                extra={"token_file": source, "line": number, "token_node": node},
            )
        by_digest[digest] = node
        first_line[digest] = number
    return by_digest


class StaticTokens:
    """Tokens from a file, re-read when it changes (checked at most every ``recheck_seconds``).

    A file that cannot be read or parsed at start is a ``ConfigError``. Later, a broken, missing
    or empty file keeps the last good tokens in force and is logged: a half-written file must not
    lock the whole fleet out. Revoking a token means writing a file without it.
    """

    def __init__(
        self,
        path: Path,
        *,
        recheck_seconds: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._recheck_s = recheck_seconds
        self._monotonic = monotonic
        self._tokens: dict[bytes, str] = {}
        self._key: tuple[int, int, int] | None = None
        self._checked_at = monotonic()
        self._last_error: str | None = None
        try:
            key = self._stat_key()
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read token file {path}: {exc}") from exc
        tokens = parse_token_file(text, str(path))
        if not tokens:
            raise ConfigError(f"token file {path} holds no 'node-name token' lines")
        self._tokens = tokens
        self._key = key
        log.info("static tokens loaded", extra={"token_file": str(path), "tokens": len(tokens)})

    def __len__(self) -> int:
        return len(self._tokens)

    def _stat_key(self) -> tuple[int, int, int]:
        st = os.stat(self._path)
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def reload_if_changed(self) -> bool:
        """Re-read the file if its inode, mtime or size changed; True if new tokens are in force."""
        try:
            key = self._stat_key()
            if key == self._key:
                return False
            text = self._path.read_text(encoding="utf-8")
            tokens = parse_token_file(text, str(self._path))
            if not tokens:
                raise ConfigError(f"token file {self._path} holds no 'node-name token' lines")
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            # Once per distinct problem, not once per request.
            if str(exc) != self._last_error:
                log.error(
                    "token file unusable, keeping the previous tokens",
                    extra={"token_file": str(self._path), "error": str(exc)},
                )
            self._last_error = str(exc)
            return False
        self._tokens = tokens
        self._key = key
        self._last_error = None
        log.info("static tokens reloaded", extra={"token_file": str(self._path), "tokens": len(tokens)})
        return True

    async def authenticate(self, token: str) -> Identity:
        now = self._monotonic()
        if now - self._checked_at >= self._recheck_s:
            self._checked_at = now
            self.reload_if_changed()
        # Looking the token up by its SHA-256 digest is the constant-time comparison: how long the
        # lookup takes depends on the digest, and a guess sharing a prefix with a real token
        # shares nothing with its digest, so timing reveals nothing about the token. (A
        # compare_digest against each of 7,500 tokens would cost milliseconds per request.)
        node = self._tokens.get(_digest(token))
        if node is None:
            raise AuthError("unknown bearer token", reason="bad_token")
        if node.startswith(VIEWER_PREFIX):
            return Identity(node=None, subject=f"static:{node}", role="viewer")
        return Identity(node=node, subject=f"static:{node}")


# -- Kubernetes TokenReview -----------------------------------------------------------------------


class TokenReviewAuthenticator:
    """Checks agent tokens with the Kubernetes TokenReview API; see the module docstring.

    The review goes through the Kubernetes boundary (``aggregator.kube``): ``kube`` is any
    ``KubeApi``, e.g. ``KubeClient.from_kubeconfig(...)`` out of a cluster; ``in_cluster`` builds
    one from the pod's service account. With ``owns_client`` the authenticator closes it.
    """

    def __init__(
        self,
        kube: KubeApi,
        *,
        audience: str,
        agent_namespace: str,
        agent_service_account: str,
        clock: Clock,
        cache_seconds: float = 60.0,
        cache_max_entries: int = 50_000,
        max_concurrent: int = 32,
        metrics: Metrics | None = None,
        owns_client: bool = False,
        viewer_service_accounts: Sequence[str] = (),
        viewer_groups: Sequence[str] = (),
    ) -> None:
        if not audience:
            raise ConfigError("a TokenReview audience is required (the agents' projected token audience)")
        if cache_seconds < 0 or cache_max_entries < 1 or max_concurrent < 1:
            raise ConfigError("TokenReview cache and concurrency limits must be positive")
        self._kube: KubeApi | None = kube
        self._owns_client = owns_client
        self._audience = audience
        self._username = f"system:serviceaccount:{agent_namespace}:{agent_service_account}"
        self._viewers = frozenset(viewer_service_accounts)
        self._viewer_groups = frozenset(viewer_groups)
        self._clock = clock
        self._cache_s = cache_seconds
        self._cache_max = cache_max_entries
        # Bounds the API server's load when every agent reconnects at once after a restart.
        self._limit = asyncio.Semaphore(max_concurrent)
        self._metrics = metrics
        # sha256(token) -> (identity, monotonic expiry). Insertion order is expiry order (one TTL
        # for all), so eviction pops from the front.
        self._cache: dict[bytes, tuple[Identity, float]] = {}
        # After a review the API server did not answer with a verdict (429, 5xx, none): no new
        # review until this monotonic time, the wait doubling while it lasts (see authenticate).
        self._hold_until = -math.inf
        self._hold_s = REVIEW_BACKOFF_S
        self._held_because = ""

    @classmethod
    def in_cluster(
        cls,
        *,
        audience: str,
        agent_namespace: str,
        agent_service_account: str,
        clock: Clock,
        environ: Mapping[str, str] | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
        timeout_s: float = 5.0,
        **kwargs: Any,
    ) -> TokenReviewAuthenticator:
        """Configured like client-go's in-cluster config: the pod's service account and the
        ``KUBERNETES_SERVICE_HOST``/``_PORT`` environment (``KubeClient.in_cluster``); ``kwargs``
        go to the constructor. Call it with the event loop running."""
        if timeout_s <= 0:
            raise ConfigError("the TokenReview timeout must be positive")
        if not audience:  # refused before any client is made
            raise ConfigError("a TokenReview audience is required (the agents' projected token audience)")
        kube = KubeClient.in_cluster(
            service_account_dir=service_account_dir, environ=environ, request_timeout=timeout_s
        )
        return cls(
            kube,
            audience=audience,
            agent_namespace=agent_namespace,
            agent_service_account=agent_service_account,
            clock=clock,
            owns_client=True,
            **kwargs,
        )

    @property
    def closed(self) -> bool:
        return self._kube is None

    async def close(self) -> None:
        kube, self._kube = self._kube, None
        if kube is not None and self._owns_client:
            await kube.close()

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.token_review(result)

    def _cached(self, digest: bytes) -> Identity | None:
        entry = self._cache.get(digest)
        if entry is None:
            return None
        identity, expires = entry
        if self._clock.monotonic() >= expires:
            del self._cache[digest]
            return None
        return identity

    def _remember(self, digest: bytes, identity: Identity) -> None:
        if self._cache_s <= 0:
            return
        now = self._clock.monotonic()
        self._cache.pop(digest, None)
        while self._cache:
            oldest = next(iter(self._cache))
            if len(self._cache) < self._cache_max and self._cache[oldest][1] > now:
                break
            del self._cache[oldest]
        self._cache[digest] = (identity, now + self._cache_s)

    async def authenticate(self, token: str) -> Identity:
        digest = _digest(token)
        cached = self._cached(digest)
        if cached is not None:
            self._count("cached")
            return cached
        async with self._limit:
            # Another request with the same token may have filled the cache while we waited.
            cached = self._cached(digest)
            if cached is not None:
                self._count("cached")
                return cached
            if self._clock.monotonic() < self._hold_until:
                # The API server is shedding or failing reviews: each report of an uncached agent
                # would be one more (thousands a second once the cache has emptied), in the same
                # priority-and-fairness flow as our Lease renewals. The agent retries on 503.
                self._count("error")
                raise AuthUnavailable(f"TokenReview backing off after: {self._held_because}")
            try:
                status = await self._review(token)
            except AuthUnavailable as exc:
                self._count("error")
                # As long as the API server asked, if it asked longer (its Retry-After).
                cause = exc.__cause__
                hold = cause.wait_s(self._hold_s) if isinstance(cause, KubeError) else self._hold_s
                self._hold_until = self._clock.monotonic() + hold
                self._hold_s = min(self._hold_s * 2, REVIEW_BACKOFF_MAX_S)
                self._held_because = str(exc)
                raise
            self._hold_s = REVIEW_BACKOFF_S  # a verdict: the API server answers again
            try:
                identity = self._judge(status)
            except AuthError:
                self._count("denied")
                raise
        self._count("authenticated")
        self._remember(digest, identity)
        return identity

    async def _review(self, token: str) -> TokenReviewStatus:
        if self._kube is None:
            raise AuthUnavailable("the TokenReview authenticator is closed")
        try:
            return await self._kube.create_token_review(token, [self._audience])
        except KubeError as exc:
            # An answer that is not a verdict (HTTP 401/403/5xx, or none): the token is neither
            # good nor bad yet, so the agent is told to retry (503), never that it is refused.
            what = f"TokenReview answered HTTP {exc.status}" if exc.status else "TokenReview request failed"
            if isinstance(exc, KubeForbidden):
                log.error(
                    "TokenReview refused by the API server (may the aggregator's service "
                    "account create tokenreviews? see daemonset/base RBAC)",
                    extra={"http_status": exc.status, "error": str(exc)},
                )
            else:
                log.warning("TokenReview failed", extra={"http_status": exc.status, "error": str(exc)})
            raise AuthUnavailable(f"{what}: {exc}") from exc

    def _judge(self, status: TokenReviewStatus) -> Identity:
        if not status.authenticated or status.user is None:
            raise AuthError(
                f"token not authenticated by Kubernetes{': ' + status.error if status.error else ''}",
                reason="bad_token",
            )
        # The API server only answers with audiences the token shares with those asked; an
        # authenticator in front of it that ignores spec.audiences might not: refuse those tokens.
        if status.audiences is None or self._audience not in status.audiences:
            raise AuthError(f"token is not for audience {self._audience!r}", reason="bad_token")
        user = status.user
        if user.username != self._username and (
            user.username in self._viewers or self._viewer_groups.intersection(user.groups)
        ):
            return Identity(node=None, subject=user.username, role="viewer")
        if user.username != self._username:
            raise AuthError(
                f"{user.username!r} is not the agent's service account {self._username!r}",
                reason="forbidden",
                status=403,
            )
        nodes = user.extra.get(NODE_NAME_EXTRA, ())
        if len(nodes) > 1:
            raise AuthError(f"token is bound to several nodes {list(nodes)}", reason="forbidden", status=403)
        return Identity(node=nodes[0] if nodes else None, subject=user.username)
