"""``KubeClient``: the one implementation of ``aggregator.kube.api.KubeApi``, on kubernetes_asyncio.

Design:

* Every call goes through kubernetes_asyncio's generated API methods (paths, query parameters,
  authentication, TLS from the kubeconfig or the in-cluster service account) but with
  ``_preload_content=False``: we read the JSON ourselves and convert it to our value types in one
  place (the ``_node``/``_lease``... functions below). That keeps API-server strings (RFC 3339 times,
  quantities) exactly as sent instead of round-tripping them through the generated models, and it
  means every HTTP status passes through ``_error`` -- the single mapping from status to
  ``KubeError`` subclass (409 and a 422 from a failed JSON Patch ``test`` -> ``KubeConflict``, 404
  -> ``KubeNotFound``, 410 -> ``KubeGone``, 401/403 -> ``KubeForbidden``, 429/5xx/no answer ->
  ``KubeUnavailable``).
* Watches are read as a raw stream rather than with ``kubernetes_asyncio.watch.Watch``: ``Watch``
  retries a 410 ERROR event once behind the caller's back when no ``timeout_seconds`` is given,
  never checks the HTTP status of the watch request itself, and builds its own ApiClient. Here an
  ERROR event becomes the matching ``KubeError`` (410 -> ``KubeGone``: the caller lists again), a
  BOOKMARK becomes a ``WatchBookmark`` (the caller resumes from it), and a non-2xx answer is
  mapped like any other call.
* Writes to Nodes are strategic merge patches of our own fields only, with ``metadata
  .resourceVersion`` as a precondition, so a taint another controller added since our read is never
  overwritten: the server answers 409 and the caller re-reads.
* A LIST of Nodes is read in pages of 500 (``limit`` and ``continue``, as client-go's pager and
  kubectl read them), one consistent list as of the first page; an expired continue token (410
  mid-list) means one whole LIST instead, and a later page that is shed (429, 5xx) is asked for
  again with its token after the server's wait (three tries) rather than the list started over.
* Each request has a timeout (``request_timeout``); a LIST page has a longer one (``list_timeout``,
  60 s: the upstream SLO allows a cluster-wide LIST 30 s at p99); a watch's read timeout is its
  server-side ``timeout_seconds`` plus the request timeout, so a silent, half-dead connection
  still ends.
* A 429 (API Priority and Fairness shedding load, with ``Retry-After``) is ``KubeUnavailable``
  like a 5xx, carrying the wait the server asked for (``KubeError.retry_after``), and is not retried
  here (but for a LIST page after the first, above): every caller waits at least a second, or that
  long if longer, before its next try. A watch stream the server ends is simply over (the caller
  watches again from its last resourceVersion); a 410 on that resume is ``KubeGone`` (the caller
  lists again).

* In a pod, the service-account token is re-read whenever the file changes (the kubelet rotates
  it), checked on every request: a rotated token is used from the next call on.

Node events go to namespace "default": the API server refuses Events about a Node elsewhere.
TokenReviews (``create_token_review``) are how the aggregator checks an agent's token; the token
under review is a credential and never appears in a log line or an error message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, cast

import aiohttp
import yaml
from kubernetes_asyncio.client import (
    ApiClient,
    AuthenticationV1Api,
    Configuration,
    CoordinationV1Api,
    CoreV1Api,
)
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

from agent.clock import Clock, SystemClock
from agent.errors import ConfigError
from aggregator.kube.objects import (
    Condition,
    ConditionStatus,
    EventRecord,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeNotFound,
    KubeUnavailable,
    Lease,
    Node,
    NodeEvent,
    NodeList,
    Taint,
    TaintEffect,
    TokenReviewStatus,
    UserInfo,
    WatchBookmark,
    WatchEvent,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")

Json = dict[str, Any]

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
DEFAULT_REQUEST_TIMEOUT_S = 10.0
# A LIST of every Node of a big cluster is slow on a busy control plane: the upstream API call
# latency SLO allows 30 s at p99 for cluster-scoped LISTs. A LIST given only the request timeout
# fails on every try there, and the informer that needs it never syncs; so it gets this instead.
DEFAULT_LIST_TIMEOUT_S = 60.0
# Nodes asked for per LIST page: client-go's pager default (and kubectl's --chunk-size). A GPU
# Node object is 10-40 KB of JSON (its images, capacity, conditions): all 7,500 of a big cluster
# in one answer are hundreds of MB to read and parse at once, and one huge request to the API
# server's priority and fairness; 500 a page bounds both.
LIST_PAGE_SIZE: Final = 500
# Pages of one LIST before it is refused: a server that keeps answering with a new continue
# token (a broken proxy) must not keep the informer listing forever (5 million Nodes).
_MAX_LIST_PAGES: Final = 10_000
# Tries of a page after the first that the server shed (429, 5xx) or did not answer, each after
# the wait it asked (at least PAGE_RETRY_MIN_S): the continue token stays good for minutes, and
# listing again from the first page would repeat every page read, the load being shed.
PAGE_ATTEMPTS: Final = 3
PAGE_RETRY_MIN_S: Final = 1.0
_TAINT_EFFECTS: tuple[TaintEffect, ...] = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_CONDITION_STATUSES: tuple[ConditionStatus, ...] = ("True", "False", "Unknown")
_WATCH_TYPES = ("ADDED", "MODIFIED", "DELETED")


class KubeClient:
    """gpuwarden's narrow Kubernetes API (see ``aggregator.kube.api.KubeApi``)."""

    def __init__(
        self,
        api_client: ApiClient,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        list_timeout: float = DEFAULT_LIST_TIMEOUT_S,
        list_page_size: int = LIST_PAGE_SIZE,
        clock: Clock | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._api_client = api_client
        self._core = CoreV1Api(api_client)
        self._coordination = CoordinationV1Api(api_client)
        self._authentication = AuthenticationV1Api(api_client)
        self._timeout = request_timeout
        self._list_timeout = max(list_timeout, request_timeout)
        self._page_size = list_page_size
        self._sleep = sleep
        self._clock = clock or SystemClock()

    @property
    def configuration(self) -> Configuration:
        """The connection settings as loaded (server, CA, credentials)."""
        conf: Configuration = self._api_client.configuration
        return conf

    @classmethod
    async def from_kubeconfig(
        cls,
        path: Path,
        *,
        context: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        list_page_size: int = LIST_PAGE_SIZE,
    ) -> KubeClient:
        """A client for the cluster and credentials of a kubeconfig file (``ConfigError`` if bad)."""
        configuration = Configuration()
        try:
            await load_kube_config(
                config_file=str(path),
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
        except (ConfigException, OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot use kubeconfig {path}: {exc}") from exc
        log.info("kubernetes client from kubeconfig", extra={"kubeconfig": str(path), "context": context})
        return cls(ApiClient(configuration), request_timeout=request_timeout, list_page_size=list_page_size)

    @classmethod
    def in_cluster(
        cls,
        *,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
        environ: Mapping[str, str] | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> KubeClient:
        """A client as client-go's in-cluster config makes one: the pod's service account (token and
        ca.crt in ``service_account_dir``) and the ``KUBERNETES_SERVICE_HOST``/``_PORT`` environment.
        ``ConfigError`` naming what is missing. Call it with the event loop running."""
        configuration = _in_cluster_configuration(
            service_account_dir, os.environ if environ is None else environ
        )
        try:
            api_client = ApiClient(configuration)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load Kubernetes CA {configuration.ssl_ca_cert}: {exc}") from exc
        log.info(
            "kubernetes client from the in-cluster service account", extra={"server": configuration.host}
        )
        return cls(api_client, request_timeout=request_timeout)

    @classmethod
    async def from_environment(
        cls,
        *,
        kubeconfig: Path | None = None,
        context: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> KubeClient:
        """An explicit ``kubeconfig`` first; else the pod's service account (token and ca.crt in
        ``service_account_dir``) when running in a cluster (``KUBERNETES_SERVICE_HOST`` set); else
        ``$KUBECONFIG`` (its first existing file), else ``~/.kube/config``. ``ConfigError`` when
        none is usable."""
        if kubeconfig is not None:
            return await cls.from_kubeconfig(kubeconfig, context=context, request_timeout=request_timeout)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.in_cluster(service_account_dir=service_account_dir, request_timeout=request_timeout)
        path = _default_kubeconfig()
        if path is None:
            raise ConfigError(
                "no Kubernetes configuration: not running in a cluster (KUBERNETES_SERVICE_HOST unset), "
                "no kubeconfig given, $KUBECONFIG names no existing file and ~/.kube/config does not exist"
            )
        return await cls.from_kubeconfig(path, context=context, request_timeout=request_timeout)

    async def close(self) -> None:
        await self._api_client.close()

    # -- nodes ------------------------------------------------------------------------------------

    async def get_node(self, name: str) -> Node:
        return _node(await self._call(f"get node {name!r}", self._core.read_node, name))

    async def list_nodes(self, *, label_selector: str | None = None) -> NodeList:
        """Every Node (matching ``label_selector``), read in pages of ``list_page_size``.

        As client-go's pager does: each page asks for the rest after the last one (``continue``),
        and the pages together are one consistent list as of the first page's resourceVersion,
        the version a watch then resumes from. A server that does not paginate answers all at
        once, which is the same. When the continue token expires mid-list (410: the server's
        history was compacted while we read), the list is read again whole, in one request, as
        client-go's ``FullListIfExpired`` does: pages from a new start could miss or repeat a
        Node that changed in between."""
        what = "list nodes" + (f" with selector {label_selector!r}" if label_selector else "")
        items: list[Node] = []
        token: str | None = None
        for page in range(_MAX_LIST_PAGES):
            asked: dict[str, Any] = {"label_selector": label_selector, "_request_timeout": self._list_timeout}
            if self._page_size > 0:
                asked["limit"] = self._page_size
            if token is not None:
                asked["_continue"] = token
            try:
                body = await self._page(f"{what} (page {page + 1})", asked, resumed=token is not None)
            except KubeGone as exc:
                if token is None:
                    raise
                log.info(
                    "node list expired while paging, listing them whole",
                    extra={"pages_read": page, "nodes_read": len(items), "error": str(exc)},
                )
                body = await self._call(
                    what,
                    self._core.list_node,
                    label_selector=label_selector,
                    _request_timeout=self._list_timeout,
                )
                return _node_list(body, [])
            meta = body.get("metadata")
            following = meta.get("continue") if isinstance(meta, dict) else None
            if not following:
                return _node_list(body, items)
            if following == token:
                raise KubeError(
                    f"{what}: the server answered page {page + 1} with the continue token it was given"
                )
            items.extend(_node(item) for item in body.get("items") or [])
            token = str(following)
        raise KubeError(f"{what}: still more after {_MAX_LIST_PAGES} pages of {self._page_size}; refused")

    async def _page(self, what: str, asked: dict[str, Any], *, resumed: bool) -> Json:
        """One LIST page; a page after the first is tried again in place when shed (see
        ``PAGE_ATTEMPTS``), as client-go's REST client retries a 429 with its Retry-After."""
        for attempt in range(1, PAGE_ATTEMPTS + 1):
            try:
                return await self._call(what, self._core.list_node, **asked)
            except KubeUnavailable as exc:
                if not resumed or attempt == PAGE_ATTEMPTS:
                    raise
                wait = exc.wait_s(PAGE_RETRY_MIN_S)
                log.info(
                    "node list page refused, asking for it again",
                    extra={"status": exc.status, "attempt": attempt, "retry_in_s": wait},
                )
                await self._sleep(wait)
        raise AssertionError("unreachable")  # the loop returns or raises

    async def watch_nodes(
        self, *, resource_version: str, timeout_seconds: int = 300, label_selector: str | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        # An async generator (a subtype of the Protocol's AsyncIterator): callers that stop early
        # should ``aclose`` it (``contextlib.aclosing``) so the stream's connection is closed at once.
        what = f"watch nodes from resourceVersion {resource_version}"
        timeout = aiohttp.ClientTimeout(sock_connect=self._timeout, sock_read=timeout_seconds + self._timeout)
        response = await self._send(
            what,
            self._core.list_node,
            watch=True,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            allow_watch_bookmarks=True,
            label_selector=label_selector,
            _request_timeout=timeout,
        )
        try:
            if not 200 <= response.status < 300:
                raise _error(what, response.status, await response.read(), response.headers)
            while True:
                try:
                    line = await response.content.readline()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise KubeUnavailable(f"{what}: stream broke: {exc!r}") from exc
                if not line:
                    return
                if not line.strip():
                    continue
                event = _json_object(what, line)
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(obj, dict):
                    raise KubeError(f"{what}: watch event without an object: {line[:200]!r}")
                if kind == "ERROR":
                    raise _error(what, int(obj.get("code") or 0), obj)
                if kind == "BOOKMARK":
                    meta = obj.get("metadata")
                    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
                    if not version:
                        raise KubeError(f"{what}: BOOKMARK without a resourceVersion: {line[:200]!r}")
                    yield WatchBookmark(resource_version=str(version))
                    continue
                if kind not in _WATCH_TYPES:
                    raise KubeError(f"{what}: unknown watch event type {kind!r}")
                yield NodeEvent(type=cast(Literal["ADDED", "MODIFIED", "DELETED"], kind), node=_node(obj))
        finally:
            response.close()

    async def patch_node(
        self,
        name: str,
        *,
        resource_version: str,
        taints: Sequence[Taint] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Node:
        metadata: Json = {"resourceVersion": resource_version}
        body: Json = {"metadata": metadata}
        if annotations is not None:
            metadata["annotations"] = dict(annotations)
        if taints is not None:
            body["spec"] = {"taints": [_taint_json(t) for t in taints]}
        what = f"patch node {name!r} at resourceVersion {resource_version}"
        return _node(await self._call(what, self._core.patch_node, name, body, _content_type=STRATEGIC_MERGE))

    async def patch_node_condition(self, name: str, condition: Condition) -> Node:
        body = {"status": {"conditions": [_condition_json(condition)]}}
        what = f"set condition {condition.type} on node {name!r}"
        return _node(
            await self._call(what, self._core.patch_node_status, name, body, _content_type=STRATEGIC_MERGE)
        )

    # -- events -----------------------------------------------------------------------------------

    async def create_event(self, namespace: str, event: EventRecord) -> None:
        now = datetime.fromtimestamp(self._clock.time(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: Json = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{event.node}.", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": event.node, "uid": event.node_uid},
            "type": event.type,
            "reason": event.reason,
            "message": event.message,
            "source": {"component": event.component},
            "reportingComponent": event.component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        what = f"create event {event.reason} for node {event.node!r} in namespace {namespace!r}"
        await self._call(what, self._core.create_namespaced_event, namespace, body)

    # -- leases -----------------------------------------------------------------------------------

    async def get_lease(self, namespace: str, name: str) -> Lease:
        what = f"get lease {namespace}/{name}"
        return _lease(await self._call(what, self._coordination.read_namespaced_lease, name, namespace))

    async def list_leases(self, namespace: str) -> list[Lease]:
        what = f"list leases in {namespace}"
        # A LIST, queued and served as one (API Priority and Fairness may hold it for seconds on
        # a busy control plane): the LIST timeout, not a single object's.
        body = await self._call(
            what, self._coordination.list_namespaced_lease, namespace, _request_timeout=self._list_timeout
        )
        items = body.get("items")
        if not isinstance(items, list):
            raise KubeUnavailable(f"{what}: the answer has no items list")
        return [_lease(item) for item in items if isinstance(item, dict)]

    async def create_lease(self, lease: Lease) -> Lease:
        what = f"create lease {lease.namespace}/{lease.name}"
        body = _lease_json(lease, with_version=False)
        return _lease(
            await self._call(what, self._coordination.create_namespaced_lease, lease.namespace, body)
        )

    async def replace_lease(self, lease: Lease) -> Lease:
        what = f"replace lease {lease.namespace}/{lease.name} at resourceVersion {lease.resource_version}"
        body = _lease_json(lease, with_version=True)
        return _lease(
            await self._call(
                what, self._coordination.replace_namespaced_lease, lease.name, lease.namespace, body
            )
        )

    # -- authentication ---------------------------------------------------------------------------

    async def create_token_review(self, token: str, audiences: Sequence[str]) -> TokenReviewStatus:
        body: Json = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": list(audiences)},
        }
        # ``what`` goes into errors and logs: it names the call, never the token.
        answer = await self._call("create tokenreview", self._authentication.create_token_review, body)
        return _token_review_status(answer)

    # -- transport --------------------------------------------------------------------------------

    async def _send(self, what: str, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """The raw aiohttp response of one generated API call; transport failures -> KubeUnavailable."""
        kwargs.setdefault("_request_timeout", self._timeout)
        try:
            return await call(*args, _preload_content=False, **kwargs)
        except ApiException as exc:
            raise _error(what, int(exc.status or 0), exc.body, exc.headers) from exc
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeUnavailable(f"{what}: no answer from the API server: {exc!r}") from exc

    async def _call(self, what: str, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Json:
        response = await self._send(what, call, *args, **kwargs)
        try:
            body: bytes = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeUnavailable(f"{what}: answer cut short: {exc!r}") from exc
        finally:
            response.release()
        if not 200 <= response.status < 300:
            raise _error(what, response.status, body, response.headers)
        return _json_object(what, body)


class ServiceAccountToken:
    """A pod's service-account token file, re-read when it changes (the kubelet rotates it)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._token = ""
        self._key: tuple[int, int, int] | None = None
        self.current()
        if not self._token:
            raise ConfigError(
                f"in-cluster Kubernetes configuration unusable: service-account token {path} "
                "is missing or empty"
            )

    def current(self) -> str:
        try:
            st = os.stat(self._path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._key:
                token = self._path.read_text(encoding="utf-8").strip()
                if token:
                    self._token = token
                    self._key = key
        except (OSError, UnicodeDecodeError) as exc:
            if self._token:
                log.warning(
                    "service-account token unreadable, using the previous one",
                    extra={"token_file": str(self._path), "error": str(exc)},
                )
        return self._token

    def refresh(self, configuration: Configuration) -> None:
        """kubernetes_asyncio's ``refresh_api_key_hook``: called before every request."""
        configuration.api_key["BearerToken"] = f"Bearer {self.current()}"


def _in_cluster_configuration(service_account_dir: Path, environ: Mapping[str, str]) -> Configuration:
    if not environ.get("KUBERNETES_SERVICE_HOST") or not environ.get("KUBERNETES_SERVICE_PORT"):
        raise ConfigError(
            "not running in a Kubernetes pod: KUBERNETES_SERVICE_HOST and "
            "KUBERNETES_SERVICE_PORT are not set (use a kubeconfig, or --token-file for static tokens)"
        )
    token = ServiceAccountToken(service_account_dir / "token")
    ca = service_account_dir / "ca.crt"
    if not ca.is_file():
        raise ConfigError(f"in-cluster Kubernetes configuration unusable: no cluster CA at {ca}")
    configuration = Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(service_account_dir / "token"),
            cert_filename=str(ca),
            try_refresh_token=False,  # replaced below: re-read on change, not once a minute
            environ=dict(environ),
        ).load_and_set(configuration)
    except (ConfigException, OSError) as exc:
        raise ConfigError(f"in-cluster Kubernetes configuration unusable: {exc}") from exc
    configuration.refresh_api_key_hook = token.refresh
    return configuration


def _default_kubeconfig() -> Path | None:
    for entry in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if entry and Path(entry).expanduser().is_file():
            return Path(entry).expanduser()
    home = Path.home() / ".kube" / "config"
    return home if home.is_file() else None


def _json_object(what: str, raw: bytes | str) -> Json:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise KubeError(f"{what}: the API server answered something that is not JSON: {raw[:200]!r}") from exc
    if not isinstance(value, dict):
        raise KubeError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _retry_after(headers: Mapping[str, str] | None, details: Mapping[str, Any]) -> float | None:
    """The wait a 429 or 5xx asks for: the ``Retry-After`` header in seconds (what the API server
    sends; an HTTP-date is not), else the Status's ``details.retryAfterSeconds``; None if neither."""
    raw: Any = headers.get("Retry-After") if headers is not None else None
    if raw is None:
        inner = details.get("details")
        raw = inner.get("retryAfterSeconds") if isinstance(inner, dict) else None
    try:
        seconds = float(raw) if raw is not None else None
    except (TypeError, ValueError):
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def _node_list(last_page: Json, before: list[Node]) -> NodeList:
    """The list from its last page (which has the list's resourceVersion) and the pages before."""
    items = last_page.get("items") or []
    meta = last_page.get("metadata")
    version = meta.get("resourceVersion", "") if isinstance(meta, dict) else ""
    return NodeList(items=(*before, *(_node(item) for item in items)), resource_version=str(version))


def _error(what: str, status: int, body: Any, headers: Mapping[str, str] | None = None) -> KubeError:
    """The ``KubeError`` for an HTTP status, its ``Status`` body (bytes, str or parsed) and the
    answer's headers (for ``Retry-After``)."""
    details: Any = body
    if isinstance(body, bytes | str):
        try:
            details = json.loads(body)
        except ValueError:
            details = {"message": body.decode(errors="replace") if isinstance(body, bytes) else body}
    if not isinstance(details, dict):
        details = {}
    reason = str(details.get("reason") or "")
    server_message = str(details.get("message") or "")[:500]
    message = f"{what}: HTTP {status} {reason}: {server_message}".rstrip(": ")
    if status == 409:
        return KubeConflict(message, status=status)
    if status == 422 and "test failed" in server_message:
        # A JSON Patch ``test`` operation failed: the object is not as read, like a 409.
        return KubeConflict(message, status=status)
    if status == 404:
        return KubeNotFound(message, status=status)
    if status == 410:
        return KubeGone(message, status=status)
    if status in (401, 403):
        return KubeForbidden(message, status=status)
    if status in (0, 429) or status >= 500:
        return KubeUnavailable(message, status=status, retry_after=_retry_after(headers, details))
    return KubeError(message, status=status)


# -- conversion between API JSON and our values ---------------------------------------------------


def _taint(node_name: str, obj: Json) -> Taint:
    effect = obj.get("effect")
    if effect not in _TAINT_EFFECTS:
        # Refused rather than dropped: taints are rewritten whole, a dropped one would be deleted.
        raise KubeError(f"node {node_name!r} has a taint {obj!r} with an effect gpuwarden does not know")
    return Taint(
        key=str(obj.get("key", "")),
        effect=cast(TaintEffect, effect),
        value=obj.get("value"),
        time_added=obj.get("timeAdded"),
    )


def _with_optional(out: Json, optional: Mapping[str, object]) -> Json:
    """``out`` and each of the ``optional`` fields that is set: an unset field is left out of what
    gpuwarden writes, never sent as null."""
    out.update((key, value) for key, value in optional.items() if value is not None)
    return out


def _taint_json(taint: Taint) -> Json:
    return _with_optional(
        {"key": taint.key, "effect": taint.effect}, {"value": taint.value, "timeAdded": taint.time_added}
    )


def _condition(obj: Json) -> Condition:
    status = obj.get("status")
    return Condition(
        type=str(obj.get("type", "")),
        # Other components' conditions are only read, never written back: an odd status reads as Unknown.
        status=cast(ConditionStatus, status) if status in _CONDITION_STATUSES else "Unknown",
        reason=str(obj.get("reason", "")),
        message=str(obj.get("message", "")),
        last_transition_time=obj.get("lastTransitionTime"),
        last_heartbeat_time=obj.get("lastHeartbeatTime"),
    )


def _condition_json(condition: Condition) -> Json:
    return _with_optional(
        {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
        },
        {
            "lastTransitionTime": condition.last_transition_time,
            "lastHeartbeatTime": condition.last_heartbeat_time,
        },
    )


def _node(obj: Json) -> Node:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    name = str(meta.get("name", ""))
    return Node(
        name=name,
        resource_version=str(meta.get("resourceVersion", "")),
        uid=str(meta.get("uid", "")),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        taints=tuple(_taint(name, t) for t in spec.get("taints") or []),
        conditions=tuple(_condition(c) for c in status.get("conditions") or []),
        unschedulable=bool(spec.get("unschedulable", False)),
    )


def _token_review_status(obj: Json) -> TokenReviewStatus:
    status = obj.get("status") or {}
    raw_user = status.get("user") or {}
    user = None
    if raw_user.get("username"):
        user = UserInfo(
            username=str(raw_user["username"]),
            uid=str(raw_user.get("uid", "")),
            groups=tuple(str(g) for g in raw_user.get("groups") or ()),
            extra={
                str(k): tuple(str(v) for v in vs or ()) for k, vs in (raw_user.get("extra") or {}).items()
            },
        )
    audiences = status.get("audiences")
    return TokenReviewStatus(
        authenticated=status.get("authenticated") is True,
        user=user,
        audiences=tuple(str(a) for a in audiences) if isinstance(audiences, list) else None,
        error=str(status.get("error") or ""),
    )


def _lease(obj: Json) -> Lease:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    return Lease(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        holder=spec.get("holderIdentity"),
        lease_duration_seconds=spec.get("leaseDurationSeconds"),
        acquire_time=spec.get("acquireTime"),
        renew_time=spec.get("renewTime"),
        transitions=int(spec.get("leaseTransitions") or 0),
        annotations=dict(meta.get("annotations") or {}),
        raw=obj,
    )


# The Lease fields gpuwarden writes; every other field of the object as read goes back unchanged.
_LEASE_SPEC_FIELDS: Final = (
    "holderIdentity",
    "leaseDurationSeconds",
    "acquireTime",
    "renewTime",
    "leaseTransitions",
)


def _lease_json(lease: Lease, *, with_version: bool) -> Json:
    raw_meta = lease.raw.get("metadata")
    raw_spec = lease.raw.get("spec")
    metadata: Json = dict(raw_meta) if isinstance(raw_meta, Mapping) and with_version else {}
    metadata.update(name=lease.name, namespace=lease.namespace)
    metadata.pop("resourceVersion", None)
    metadata.pop("annotations", None)
    if with_version:
        metadata["resourceVersion"] = lease.resource_version
    if lease.annotations:
        metadata["annotations"] = dict(lease.annotations)
    kept = dict(raw_spec) if isinstance(raw_spec, Mapping) and with_version else {}
    spec = {k: v for k, v in kept.items() if k not in _LEASE_SPEC_FIELDS}
    spec = _with_optional(
        {**spec, "leaseTransitions": lease.transitions},
        {
            "holderIdentity": lease.holder,
            "leaseDurationSeconds": lease.lease_duration_seconds,
            "acquireTime": lease.acquire_time,
            "renewTime": lease.renew_time,
        },
    )
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
