"""An in-process double of the Kubernetes API server, for tests of gpuwarden's Kubernetes client.

Why a double: no kube-apiserver (or etcd) binary can be installed here, yet remediation depends on
exact server behaviour (optimistic concurrency, how patches merge, watch semantics). So the tests
drive the REAL client (kubernetes_asyncio, through ``aggregator.kube.client.KubeClient``) over HTTP
against this aiohttp server on 127.0.0.1, which reproduces what we rely on and nothing more. Each
behaviour below was checked against the Kubernetes API reference
(https://kubernetes.io/docs/reference/using-api/api-concepts/) and the kubernetes/kubernetes source
named next to it:

* Status objects for failures (``kind: Status``, ``reason``, ``code``, ``details``): 404 NotFound,
  409 Conflict / AlreadyExists, 422 Invalid, 400 BadRequest, 401 Unauthorized, 410 Expired,
  415 UnsupportedMediaType (staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go).
* One global resourceVersion counter for every object, as etcd's revision; a write that changes
  nothing keeps the resourceVersion and emits no watch event (etcd3 store ``GuaranteedUpdate``
  short-circuits when the encoded object is unchanged).
* Optimistic concurrency: a PATCH whose result carries a ``metadata.resourceVersion`` different
  from the stored one is 409 Conflict "the object has been modified; please apply your changes to
  the latest version and try again" (patch.go applies the patch, then registry/store.go ``Update``
  compares versions). Nodes allow unconditional updates (no resourceVersion: last writer wins);
  Leases do not (``leaseStrategy.AllowUnconditionalUpdate`` is false: a PUT without one is 422
  "must be specified for an update"), and a PUT may create a Lease (``AllowCreateOnUpdate``).
* PATCH content types (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go):
  ``application/strategic-merge-patch+json``: maps merge recursively, ``null`` deletes a key, lists
  without a patch strategy are replaced whole (``NodeSpec.Taints`` has none, k8s.io/api/core/v1
  types.go), lists with ``patchStrategy:"merge"`` merge element-wise by their ``patchMergeKey``
  (``NodeStatus.Conditions`` and ``NodeStatus.Addresses``, key ``type``), ``$patch: delete`` in such
  an element removes it, ``$setElementOrder/...`` is accepted (the double keeps stored order).
  ``application/merge-patch+json``: RFC 7386, every list replaced whole.
  ``application/json-patch+json``: RFC 6902 including ``test``; any failure while applying it,
  a failed ``test`` included, is 422 (``jsonPatcher.applyJSPatch`` returns
  ``NewGenericServerResponse(http.StatusUnprocessableEntity, ...)``), a malformed patch 400.
* Subresources (pkg/registry/core/node/strategy.go): on ``/api/v1/nodes/{name}`` status changes
  are silently dropped (``nodeStrategy.PrepareForUpdate``: ``newNode.Status = oldNode.Status``); on
  ``/api/v1/nodes/{name}/status`` spec changes are dropped (``nodeStatusStrategy``:
  ``newNode.Spec = oldNode.Spec``) while metadata changes are kept, as the real server keeps them.
* Node validation we depend on: a taint needs a key and one of the three effects, and taints are
  unique by (key, effect) (pkg/apis/core/validation ``validateNodeTaints``), else 422.
* Label selectors on list and watch: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``,
  ``k notin (a,b)``, comma-separated requirements ANDed (apimachinery/pkg/labels/selector.go).
* Watch (``?watch=<bool>``, query booleans parsed as apimachinery does): newline-delimited JSON
  events with HTTP 200; ADDED/MODIFIED/DELETED after the given resourceVersion; ``resourceVersion``
  unset or "0" starts with synthetic ADDED events for what exists; an object that starts or stops
  matching the selector is seen as ADDED or DELETED
  (apiserver cacher ``cacheWatcher.convertToWatchEvent``); a resourceVersion older than the
  compaction point gets one ERROR event carrying a 410 Status, reason Expired, "too old resource
  version" (watch_cache.go ``NewResourceExpired``), then the stream ends; ``timeoutSeconds`` ends the
  stream; with ``allowWatchBookmarks`` a BOOKMARK (an object with only the resourceVersion) is sent
  before a timeout ends the stream, and every ``bookmark_every`` seconds if set (the server sends
  bookmarks at its discretion; the cacher about a minute apart). A bookmark names the server's
  current resourceVersion once every Node change before it was sent: writes to other objects
  (Leases, Events) move it past the last Node change, as etcd's progress notifications move the
  cacher's, so a watch resumed from a bookmark is not 410 after a compaction.
* Events (core v1): an Event about a Node must live in namespace "default" (or ""), else 422
  (pkg/apis/core/validation/events.go); ``generateName`` gets a random suffix.
* Bearer token authentication: a request without the token is 401 Unauthorized.
* TokenReview (authentication.k8s.io/v1, POST ``/apis/authentication.k8s.io/v1/tokenreviews``;
  pkg/registry/authentication/tokenreview/storage.go): an empty ``spec.token`` is 400 "token is
  required for TokenReview in authentication"; empty ``spec.audiences`` means the server's own
  (``--api-audiences``); the answer is 201 with the review echoed and its ``status``. A token is
  authenticated only if one of its audiences is among those asked (the service-account JWT
  authenticator), and ``status.audiences`` is that intersection; otherwise ``authenticated`` is
  absent (``omitempty``), ``user`` is ``{}`` and ``error`` says why ("token audiences [...] is
  invalid for the target audiences [...]", or "invalid bearer token" for a token it never issued
  or whose pod is gone). The user of a service-account token is ``system:serviceaccount:NS:NAME``
  with the service account's uid and the groups ``system:serviceaccounts``,
  ``system:serviceaccounts:NS``, ``system:authenticated``; a token bound to a pod carries
  ``authentication.kubernetes.io/pod-name``/``pod-uid`` in ``extra`` and, since Kubernetes 1.30,
  ``node-name``/``node-uid`` of the pod's node and ``credential-id`` (``JTI=<id>``)
  (pkg/serviceaccount/claims.go). RBAC on ``create tokenreviews`` is not modelled: ``fail_next``
  plays a 403.

* LIST pagination (``limit``, ``continue``; apiserver/pkg/storage/etcd3/store.go): Nodes in key
  (name) order, at most ``limit`` a page, ``metadata.continue`` an opaque token holding the list's
  revision and the key to start after, each page as of the first page's revision (the double
  undoes the changes since, as etcd serves an old revision); a token from before the compaction
  point is 410 Expired "The provided continue parameter is too old...", a mangled one 400.
  ``list_pages`` counts the pages served.

Not reproduced (we do not rely on it): server-side apply, managedFields, field selectors, deletes
over HTTP, admission, defaulting, ``remainingItemCount``,
``resourceVersion``/``resourceVersionMatch`` on a LIST (a list's first page is the newest, the pages
after it as of the first). A strategic merge element without its merge key is 400 here; the double
does not claim the real server's code for that malformed patch.

A busy control plane (all off by default):

* ``set_latency(verb, seconds)``: requests of a verb (``get``, ``list``, ``watch``, ``create``,
  ``update``, ``patch``, as the API server's request info names them) are answered late, after a
  fixed time or one drawn uniformly from a range (the issue's case: Node LISTs after 3 s, anywhere
  in 0-30 s; the upstream SLO allows cluster-scoped LISTs 30 s at p99). The work is done when the
  request arrives and only the answer waits, as when a large LIST is served and then serialized and
  sent: a LIST shows the cluster as of its start (its resourceVersion too, so a watch from it sees
  what changed meanwhile), and a write is applied even if the client stops waiting.
  With ``applied_late=True`` the work itself takes the time instead (slow admission webhooks, a
  slow etcd): a write lands only when its answer is sent, and still lands if the client stopped
  waiting meanwhile, as the API server runs a mutation it has begun to the end in the background
  (k8s.io/apiserver's ``finisher``: "post-timeout activity"). (A request still waiting in an API
  Priority and Fairness queue is dropped when its client goes; that case is a 429 or a plain
  delay here.) A watch's latency delays the start of its stream.
* ``throttle(share=, burst=, retry_after=)``: 429 TooManyRequests with ``Retry-After`` and
  ``details.retryAfterSeconds``, "Too many requests, please try again later.", as API Priority
  and Fairness rejects a request its queues cannot hold (apiserver/pkg/server/filters/
  priority-and-fairness.go, ``tooManyRequests``); for the next ``burst`` matching requests, then
  for a random ``share`` of them. Rejected after authentication, before any work, like APF.
* ``restart_watches(expire=True)``: ends every open watch stream at once, as an API server
  restart or a watch cache re-initialising does; with ``expire`` the history is compacted too, so
  resuming from a resourceVersion before now is 410 Expired and the client must list again.

Test-only controls: ``add_node``/``update_node``/``delete_node`` play the kubelet or another
controller writing directly, ``fail_next`` injects faults (429, 5xx, 409...) before the handler,
``compact`` moves the compaction point, ``issue_token``/``revoke_token`` play the TokenRequest API
(the kubelet's projected tokens) and a deleted pod, ``accept_token`` a rotated caller token,
``ssl_context`` serves HTTPS (an in-cluster client needs it), and ``requests``/``writes()``,
``callers`` (each request's Authorization header) and ``token_reviews`` record every call.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import json
import logging
import random
import re
import secrets
import ssl
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from aggregator.kube.client import KubeClient
from aggregator.kube.objects import (
    Condition,
    EventRecord,
    Lease,
    Node,
    NodeList,
    Taint,
    TokenReviewStatus,
    WatchEvent,
)

log = logging.getLogger(__name__)

Json = Any
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
OPTIMISTIC_LOCK = (
    "the object has been modified; please apply your changes to the latest version and try again"
)
LEASES = "leases.coordination.k8s.io"
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
# --api-audiences when unset: the service-account issuer (the cluster's API server URL).
API_AUDIENCES = ("https://kubernetes.default.svc.cluster.local",)

# Node lists that strategic merge patch merges element-wise, by merge key (k8s.io/api/core/v1).
_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An answer the double gives as a ``Status`` object."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        details: dict[str, Json] | None = None,
        retry_after: int = 1,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details or {}
        self.retry_after = retry_after

    def status(self) -> dict[str, Json]:
        body: dict[str, Json] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": str(self),
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.code == 429 else None
        return web.json_response(self.status(), status=self.code, headers=headers)


def _not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, f'{resource} "{name}" not found', details={"name": name, "kind": resource})


def _conflict(resource: str, name: str, why: str = OPTIMISTIC_LOCK) -> ApiError:
    return ApiError(
        409, f'Operation cannot be fulfilled on {resource} "{name}": {why}', details={"name": name}
    )


# apiserver/pkg/storage/errors.go, NewResourceExpired for an expired continue (etcd3 store).
EXPIRED_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start "
    "a new list without the continue parameter, or use the continue token in this response to "
    "retrieve the remainder of the results. Continuing with the provided token results in an "
    "inconsistent list - objects that were created, modified, or deleted between the time the "
    "first chunk was returned and now may show up in the list."
)


def _continue_token(rv: int, start: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _read_continue(token: str) -> tuple[int, str]:
    """(resourceVersion, start key) of a continue token; 400 as the server's ``DecodeContinue``."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        decoded = json.loads(raw)
        rv, start = decoded["rv"], decoded["start"]
        if decoded.get("v") != "meta.k8s.io/v1" or not isinstance(rv, int) or not isinstance(start, str):
            raise ValueError("not a meta.k8s.io/v1 continue key")
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"continue key is not valid: {exc}") from exc
    return rv, start


def _query_int(request: web.Request, name: str) -> int:
    raw = request.query.get(name, "")
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError as exc:
        raise ApiError(400, f"invalid value for {name}: {raw!r}") from exc


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    count: int


@dataclass
class _Latency:
    verb: str
    path: re.Pattern[str]
    low: float
    high: float
    applied_late: bool  # the wait comes before the work is applied (else after it: answered late)


@dataclass
class _Throttle:
    share: float
    burst: int
    retry_after: int
    verbs: frozenset[str]
    path: re.Pattern[str]


def _verb(request: web.Request) -> str:
    """The API server's name for what a request does (apiserver ``RequestInfo.Verb``)."""
    method = request.method
    if method == "GET":
        if _query_bool(request, "watch"):
            return "watch"
        return "get" if "name" in request.match_info else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


@dataclass(frozen=True)
class _IssuedToken:
    namespace: str
    service_account: str
    service_account_uid: str
    audiences: tuple[str, ...]
    pod: tuple[str, str] | None  # (name, uid)
    node: tuple[str, str] | None
    credential_id: str


def _go_quoted(values: Sequence[str]) -> str:
    """A Go ``%q`` of a []string, as the API server writes audiences into its errors."""
    return "[" + " ".join(json.dumps(v) for v in values) + "]"


@dataclass(frozen=True)
class _Change:
    resource_version: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Json]
    previous: dict[str, Json] | None


# -- label selectors ------------------------------------------------------------------------------

_REQUIREMENT = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<nkey>[^\s=!,()]+)"
    r"|(?P<key>[^\s=!,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s=!,()]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^()]*)\))?)\s*$"
)

Requirement = Callable[[dict[str, str]], bool]


def parse_label_selector(text: str) -> list[Requirement]:
    """The requirements of a label selector, ANDed; ``ApiError`` 400 when it does not parse."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    requirements: list[Requirement] = []
    for part in parts:
        if not part.strip():
            if text.strip():
                raise ApiError(400, f"unable to parse requirement: empty requirement in {text!r}")
            continue
        match = _REQUIREMENT.match(part)
        if match is None:
            raise ApiError(400, f"unable to parse requirement: {part!r}")
        requirements.append(_requirement(match))
    return requirements


def _requirement(match: re.Match[str]) -> Requirement:
    if match["not"]:
        nkey = match["nkey"]
        return lambda labels: nkey not in labels
    key = match["key"]
    if match["op"] in ("=", "=="):
        value = match["value"]
        return lambda labels: labels.get(key) == value
    if match["op"] == "!=":
        value = match["value"]
        return lambda labels: labels.get(key) != value
    if match["setop"]:
        values = {v.strip() for v in match["values"].split(",") if v.strip()}
        if match["setop"] == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    return lambda labels: key in labels


def _matches(obj: dict[str, Json] | None, requirements: list[Requirement]) -> bool:
    if obj is None:
        return False
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(req(labels) for req in requirements)


# -- patches --------------------------------------------------------------------------------------


def strategic_merge(original: Json, patch: Json, path: tuple[str, ...] = ()) -> Json:
    """Strategic merge patch of Node JSON (see the module docstring for the rules kept)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch" and v is not None}
    result: dict[str, Json] = copy.deepcopy(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$"):
            raise ApiError(400, f"strategic merge directive {key!r} is not supported by the double")
        if value is None:
            result.pop(key, None)
            continue
        sub = (*path, key)
        if isinstance(value, list) and sub in _MERGE_KEYS:
            result[key] = _merge_list(result.get(key), value, _MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            result[key] = strategic_merge(result.get(key), value, sub)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(original: Json, items: list[Json], merge_key: str, path: tuple[str, ...]) -> list[Json]:
    result: list[Json] = copy.deepcopy(original) if isinstance(original, list) else []
    for item in items:
        if not isinstance(item, dict) or merge_key not in item:
            raise ApiError(400, f"map: {item} does not contain declared merge key: {merge_key}")
        index = next(
            (
                i
                for i, old in enumerate(result)
                if isinstance(old, dict) and old.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
            continue
        if index is None:
            result.append(strategic_merge({}, item, path))
        else:
            result[index] = strategic_merge(result[index], item, path)
    return result


def merge_patch(target: Json, patch: Json) -> Json:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Json] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class _PatchFailed(Exception):
    pass


def _pointer(text: Json) -> list[str]:
    if not isinstance(text, str) or (text and not text.startswith("/")):
        raise _PatchFailed(f"invalid JSON pointer {text!r}")
    if not text:
        return []
    return [token.replace("~1", "/").replace("~0", "~") for token in text[1:].split("/")]


def _index(container: list[Json], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise _PatchFailed(f"invalid array index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise _PatchFailed(f"array index {index} out of bounds")
    return index


def _resolve(doc: Json, tokens: list[str]) -> Json:
    for token in tokens:
        if isinstance(doc, dict):
            if token not in doc:
                raise _PatchFailed(f"missing key {token!r}")
            doc = doc[token]
        elif isinstance(doc, list):
            doc = doc[_index(doc, token, allow_end=False)]
        else:
            raise _PatchFailed(f"cannot descend into {type(doc).__name__} at {token!r}")
    return doc


def _json_equal(a: Json, b: Json) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and (isinstance(a, str) == isinstance(b, str))


def _add(doc: Json, tokens: list[str], value: Json) -> Json:
    if not tokens:
        return value
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise _PatchFailed(f"cannot add to {type(parent).__name__}")
    return doc


def _remove(doc: Json, tokens: list[str]) -> Json:
    if not tokens:
        raise _PatchFailed("cannot remove the whole document")
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise _PatchFailed(f"missing key {last!r}")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, allow_end=False))
    raise _PatchFailed(f"cannot remove from {type(parent).__name__}")


def json_patch(doc: Json, operations: Json) -> Json:
    """RFC 6902 JSON patch; ``ApiError`` 400 for a malformed patch, 422 when applying it fails."""
    if not isinstance(operations, list) or not all(
        isinstance(op, dict) and isinstance(op.get("op"), str) for op in operations
    ):
        raise ApiError(400, "json patch must be a list of operations, each with an 'op'")
    doc = copy.deepcopy(doc)
    for op in operations:
        try:
            kind, tokens = op["op"], _pointer(op.get("path"))
            if kind in ("add", "replace", "test") and "value" not in op:
                raise ApiError(400, f"json patch {kind} operation has no value")
            if kind == "add":
                doc = _add(doc, tokens, copy.deepcopy(op["value"]))
            elif kind == "remove":
                _remove(doc, tokens)
            elif kind == "replace":
                _resolve(doc, tokens)
                if tokens:
                    _remove(doc, tokens)
                doc = _add(doc, tokens, copy.deepcopy(op["value"]))
            elif kind in ("move", "copy"):
                source = _pointer(op.get("from"))
                value = _remove(doc, source) if kind == "move" else copy.deepcopy(_resolve(doc, source))
                doc = _add(doc, tokens, value)
            elif kind == "test":
                if not _json_equal(_resolve(doc, tokens), op["value"]):
                    raise _PatchFailed(f"testing value {op['path']} failed: test failed")
            else:
                raise ApiError(400, f"unexpected json patch operation {kind!r}")
        except _PatchFailed as exc:
            raise ApiError(422, str(exc)) from exc
    return doc


# -- the server -----------------------------------------------------------------------------------


class KubeApiDouble:
    """The API-server double; ``async with KubeApiDouble() as api:`` starts it on a free port."""

    def __init__(
        self, *, token: str | None = None, ssl_context: ssl.SSLContext | None = None, seed: int = 0
    ) -> None:
        """``seed``: of the random draws of ``set_latency`` ranges and ``throttle`` shares."""
        self.token = token or secrets.token_urlsafe(16)
        self.url = ""
        self.port = 0
        self.api_audiences = API_AUDIENCES
        self.events: list[dict[str, Json]] = []
        self.requests: list[tuple[str, str, str]] = []
        self.callers: list[str] = []
        self.token_reviews: list[dict[str, Json]] = []
        self._ssl = ssl_context
        self._also_accepted: set[str] = set()
        self._issued: dict[str, _IssuedToken] = {}
        self._account_uids: dict[tuple[str, str], str] = {}
        self._rv = 1
        self._compacted = 0
        self._nodes: dict[str, dict[str, Json]] = {}
        self._leases: dict[tuple[str, str], dict[str, Json]] = {}
        self._history: list[_Change] = []
        self._faults: list[_Fault] = []
        self._latencies: list[_Latency] = []
        self._throttle: _Throttle | None = None
        self._rng = random.Random(seed)
        self._watch_epoch = 0
        self._bookmark_every: float | None = None
        self.throttled = 0  # requests answered 429 by ``throttle``
        self.list_pages = 0  # Node LIST answers given (one per page)
        self._wakeups: set[asyncio.Event] = set()
        self._closing = False
        self._runner: web.AppRunner | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(middlewares=[self._record, self._authenticate, self._inject_faults, self._busy])
        app.router.add_get("/api/v1/nodes", self._list_or_watch_nodes)
        app.router.add_get("/api/v1/nodes/{name}", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}", self._patch_node)
        app.router.add_put("/api/v1/nodes/{name}", self._put_node)
        app.router.add_get("/api/v1/nodes/{name}/status", self._get_node)
        app.router.add_patch("/api/v1/nodes/{name}/status", self._patch_node_status)
        app.router.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        base = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
        app.router.add_get(base, self._list_leases)
        app.router.add_post(base, self._create_lease)
        app.router.add_get(base + "/{name}", self._get_lease)
        app.router.add_put(base + "/{name}", self._put_lease)
        app.router.add_post(TOKEN_REVIEWS, self._create_token_review)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"{'https' if self._ssl is not None else 'http'}://{host}:{port}"

    async def close(self) -> None:
        self._closing = True
        self._wake()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> KubeApiDouble:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (JSON is YAML) pointing the real client at this double with its token."""
        if not self.url:
            raise RuntimeError("start the double before writing a kubeconfig for it")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "gpuwarden", "user": {"token": self.token}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "gpuwarden"}}],
            "current-context": "double",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    # -- test controls ----------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> dict[str, Json]:
        """Registers a Node as the kubelet does, with a Ready=True condition; emits ADDED."""
        if name in self._nodes:
            raise ValueError(f"node {name} exists")
        now = _now()
        node: dict[str, Json] = {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now,
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": {"taints": [dict(t) for t in taints or []]},
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ]
            },
        }
        self._validate_node(node)
        return copy.deepcopy(self._store_node(None, node))

    def node(self, name: str) -> dict[str, Json]:
        return copy.deepcopy(self._nodes[name])

    def update_node(self, name: str, mutate: Callable[[dict[str, Json]], None]) -> dict[str, Json]:
        """Another writer changes the node (any field): bumps resourceVersion, emits MODIFIED.

        Empty labels, annotations and taints are absent, as the real server omits them
        (``omitempty``): mutate with ``setdefault``."""
        current = self._nodes[name]
        new = copy.deepcopy(current)
        mutate(new)
        return copy.deepcopy(self._store_node(current, new, force=True))

    def delete_node(self, name: str) -> None:
        current = self._nodes.pop(name)
        self._rv += 1
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(_Change(self._rv, "DELETED", gone, current))

    def seed_lease(self, body: dict[str, Json]) -> None:
        """A Lease as another tool created it (a chart, an operator), stored as the API would."""
        body = copy.deepcopy(body)
        body.update(kind="Lease", apiVersion="coordination.k8s.io/v1")
        self._store_lease(body)

    def delete_lease(self, namespace: str, name: str) -> None:
        """What ``kubectl delete lease`` does (KeyError when there is none)."""
        del self._leases[(namespace, name)]

    def lease(self, namespace: str, name: str) -> dict[str, Json] | None:
        found = self._leases.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def writes(self) -> list[tuple[str, str, str]]:
        return [r for r in self.requests if r[0] != "GET"]

    def fail_next(self, method: str, path_regex: str, status: int, *, count: int = 1) -> None:
        """The next ``count`` requests matching method and path (``re.search``) get ``status``."""
        self._faults.append(_Fault(method.upper(), re.compile(path_regex), status, count))

    def clear_faults(self) -> None:
        """Forget every ``fail_next`` still pending."""
        self._faults.clear()

    def issue_token(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: Sequence[str] = API_AUDIENCES,
        pod: str | None = None,
        node: str | None = None,
    ) -> str:
        """A service-account token as the TokenRequest API issues one: for ``audiences``, bound to
        ``pod`` (and, as the kubelet's projected tokens are since 1.30, to ``node``) if given."""
        token = secrets.token_urlsafe(32)
        account_uid = self._account_uids.setdefault((namespace, service_account), str(uuid.uuid4()))
        self._issued[token] = _IssuedToken(
            namespace=namespace,
            service_account=service_account,
            service_account_uid=account_uid,
            audiences=tuple(audiences),
            pod=None if pod is None else (pod, str(uuid.uuid4())),
            node=None if node is None else (node, str(uuid.uuid4())),
            credential_id=str(uuid.uuid4()),
        )
        return token

    def revoke_token(self, token: str) -> None:
        """The token's pod is deleted: a bound token stops authenticating at once."""
        del self._issued[token]

    def accept_token(self, token: str) -> None:
        """Callers may also use ``token`` (the kubelet rotated the caller's service-account token;
        the old one stays valid until it expires)."""
        self._also_accepted.add(token)

    def set_latency(
        self,
        verb: str,
        seconds: float | tuple[float, float],
        *,
        path_regex: str = "",
        applied_late: bool = False,
    ) -> None:
        """Answer requests of ``verb`` (matching ``path_regex`` by ``re.search``) after ``seconds``,
        or after a time drawn uniformly from the range ``(low, high)``; 0 turns it off.
        ``applied_late``: apply the work only then (a mutation the server takes that long to run,
        client or not), not at once."""
        low, high = (seconds, seconds) if isinstance(seconds, int | float) else seconds
        path = re.compile(path_regex)
        self._latencies = [x for x in self._latencies if (x.verb, x.path.pattern) != (verb, path.pattern)]
        if high > 0:
            self._latencies.append(_Latency(verb, path, float(low), float(high), applied_late))

    def throttle(
        self,
        *,
        share: float = 0.0,
        burst: int = 0,
        retry_after: int = 1,
        verbs: Sequence[str] = (),
        path_regex: str = "",
    ) -> None:
        """429 the next ``burst`` requests, then a random ``share`` of them, of ``verbs`` (all if
        empty) on paths matching ``path_regex``; ``throttle()`` turns it off."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be within [0, 1], got {share}")
        self._throttle = (
            _Throttle(share, burst, retry_after, frozenset(verbs), re.compile(path_regex))
            if share > 0 or burst > 0
            else None
        )

    def bookmark_every(self, seconds: float | None) -> None:
        """Send watches that asked for bookmarks one every ``seconds`` too, not only as they end
        (the real cacher sends one about a minute apart); None: only as they end."""
        self._bookmark_every = seconds if seconds else None

    def restart_watches(self, *, expire: bool = True) -> int:
        """End every open watch stream now (and, with ``expire``, compact: resuming from before
        now is 410 Expired); how many streams were open."""
        self._watch_epoch += 1
        if expire:
            self.compact()
        self._wake()
        return len(self._wakeups)

    def compact(self) -> None:
        """Forgets history: watches from any resourceVersion before now get 410 Expired."""
        self._compacted = self._rv
        self._history.clear()

    # -- middlewares ------------------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.append((request.method, request.path, request.headers.get("Content-Type", "")))
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        self.callers.append(header)
        caller = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        if caller is None or (caller != self.token and caller not in self._also_accepted):
            raise ApiError(401, "Unauthorized")
        return await handler(request)

    @web.middleware
    async def _inject_faults(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        for fault in self._faults:
            if fault.count > 0 and fault.method == request.method and fault.path.search(request.path):
                fault.count -= 1
                log.info(
                    "kube double injects a fault",
                    extra={"method": request.method, "path": request.path, "status": fault.status},
                )
                raise ApiError(
                    fault.status, f"injected fault {fault.status} for {request.method} {request.path}"
                )
        return await handler(request)

    @web.middleware
    async def _busy(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        verb = _verb(request)
        throttle = self._throttle
        if (
            throttle is not None
            and (not throttle.verbs or verb in throttle.verbs)
            and throttle.path.search(request.path)
        ):
            if throttle.burst > 0:
                throttle.burst -= 1
                shed = True
            else:
                shed = self._rng.random() < throttle.share
            if shed:
                self.throttled += 1
                raise ApiError(
                    429,
                    "Too many requests, please try again later.",
                    details={"retryAfterSeconds": throttle.retry_after},
                    retry_after=throttle.retry_after,
                )
        delay, late = 0.0, False
        for latency in self._latencies:
            if latency.verb == verb and latency.path.search(request.path):
                delay, late = self._rng.uniform(latency.low, latency.high), latency.applied_late
        if delay <= 0:
            return await handler(request)
        if verb == "watch" or late:
            # The stream starts late; a slow mutation is applied at its end. aiohttp (3.9+) does
            # not cancel a handler whose client went away, so it is applied either way.
            await asyncio.sleep(delay)
            return await handler(request)
        response = await handler(request)  # done now, answered late
        await asyncio.sleep(delay)
        return response

    async def _unknown(self, request: web.Request) -> web.StreamResponse:
        raise ApiError(
            404, f"the server could not find the requested resource ({request.method} {request.path})"
        )

    # -- storage ----------------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _wake(self) -> None:
        for event in self._wakeups:
            event.set()

    def _emit(self, change: _Change) -> None:
        self._history.append(change)
        self._wake()

    def _store_node(
        self, current: dict[str, Json] | None, new: dict[str, Json], *, force: bool = False
    ) -> dict[str, Json]:
        _omit_empty(new)
        if current is not None and not force:
            unchanged = copy.deepcopy(new)
            unchanged["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if unchanged == current:
                return current
        new["metadata"]["resourceVersion"] = self._next_rv()
        self._nodes[new["metadata"]["name"]] = new
        kind = "ADDED" if current is None else "MODIFIED"
        self._emit(_Change(self._rv, kind, copy.deepcopy(new), copy.deepcopy(current) if current else None))
        return new

    @staticmethod
    def _validate_node(node: dict[str, Json]) -> None:
        taints = node.get("spec", {}).get("taints") or []
        if not isinstance(taints, list):
            raise ApiError(422, "spec.taints: must be a list")
        seen: set[tuple[str, str]] = set()
        for i, taint in enumerate(taints):
            if not isinstance(taint, dict) or not taint.get("key"):
                raise ApiError(422, f"spec.taints[{i}].key: Required value")
            if taint.get("effect") not in TAINT_EFFECTS:
                raise ApiError(
                    422,
                    f"spec.taints[{i}].effect: Unsupported value: {taint.get('effect')!r}: "
                    f"supported values: {', '.join(TAINT_EFFECTS)}",
                )
            pair = (taint["key"], taint["effect"])
            if pair in seen:
                raise ApiError(
                    422, f"spec.taints[{i}]: Duplicate value: taints must be unique by key and effect pair"
                )
            seen.add(pair)

    def _update_node(self, name: str, new: Json, *, subresource: bool) -> dict[str, Json]:
        current = self._nodes.get(name)
        if current is None:
            raise _not_found("nodes", name)
        if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
            raise ApiError(400, "the patched object is not a Node")
        new = copy.deepcopy(new)
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiError(
                400,
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
            )
        uid = current["metadata"]["uid"]
        if meta.get("uid") not in (None, "", uid):
            raise _conflict(
                "nodes",
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: {uid}",
            )
        rv = meta.get("resourceVersion")
        if rv not in (None, ""):
            if not isinstance(rv, str) or not rv.isdigit():
                raise ApiError(400, f"invalid resourceVersion {rv!r}")
            if rv != current["metadata"]["resourceVersion"]:
                raise _conflict("nodes", name)
        # System fields stay the server's.
        new["kind"], new["apiVersion"] = "Node", "v1"
        meta.update(name=name, uid=uid, creationTimestamp=current["metadata"]["creationTimestamp"])
        if subresource:
            new["spec"] = copy.deepcopy(current.get("spec", {}))
        else:
            new["status"] = copy.deepcopy(current.get("status", {}))
        self._validate_node(new)
        return self._store_node(current, new)

    # -- nodes ------------------------------------------------------------------------------------

    def _node_or_404(self, name: str) -> dict[str, Json]:
        node = self._nodes.get(name)
        if node is None:
            raise _not_found("nodes", name)
        return node

    async def _get_node(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self._node_or_404(request.match_info["name"]))

    async def _list_or_watch_nodes(self, request: web.Request) -> web.StreamResponse:
        requirements = parse_label_selector(request.query.get("labelSelector", ""))
        if _query_bool(request, "watch"):
            return await self._watch_nodes(request, requirements)
        limit = _query_int(request, "limit")
        token = request.query.get("continue", "")
        if token:
            rv, start = _read_continue(token)
            if rv < self._compacted:
                raise ApiError(410, EXPIRED_CONTINUE)
            nodes = self._nodes_at(rv)
        else:
            rv, start, nodes = self._rv, "", self._nodes
        items = [n for name, n in sorted(nodes.items()) if name >= start and _matches(n, requirements)]
        metadata: dict[str, Json] = {"resourceVersion": str(rv)}
        if 0 < limit < len(items):
            items = items[:limit]
            # The etcd3 store's token: the list's revision and the key to start after.
            metadata["continue"] = _continue_token(rv, items[-1]["metadata"]["name"] + "\x00")
        self.list_pages += 1
        return web.json_response(
            {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": metadata,
                "items": [{k: v for k, v in n.items() if k not in ("kind", "apiVersion")} for n in items],
            }
        )

    def _nodes_at(self, rv: int) -> dict[str, dict[str, Json]]:
        """The Nodes as they were at ``rv`` (not before the compaction point): today's, with every
        change since undone, newest first, as etcd serves an older revision."""
        nodes = dict(self._nodes)
        for change in reversed(self._history):
            if change.resource_version <= rv:
                break
            name = change.obj["metadata"]["name"]
            if change.previous is None:
                nodes.pop(name, None)
            else:
                nodes[name] = change.previous
        return nodes

    async def _read_json(self, request: web.Request) -> Json:
        try:
            return json.loads(await request.read())
        except ValueError as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from exc

    async def _patched(self, request: web.Request) -> Json:
        name = request.match_info["name"]
        current = self._node_or_404(name)
        patch = await self._read_json(request)
        if request.content_type == STRATEGIC:
            if not isinstance(patch, dict):
                raise ApiError(400, "strategic merge patch must be a JSON object")
            return strategic_merge(current, patch)
        if request.content_type == MERGE:
            if not isinstance(patch, dict):
                raise ApiError(400, "merge patch must be a JSON object")
            return merge_patch(current, patch)
        if request.content_type == JSON_PATCH:
            return json_patch(current, patch)
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types include: "
            f"{JSON_PATCH}, {MERGE}, {STRATEGIC}",
        )

    async def _patch_node(self, request: web.Request) -> web.StreamResponse:
        patched = await self._patched(request)
        return web.json_response(self._update_node(request.match_info["name"], patched, subresource=False))

    async def _patch_node_status(self, request: web.Request) -> web.StreamResponse:
        patched = await self._patched(request)
        return web.json_response(self._update_node(request.match_info["name"], patched, subresource=True))

    async def _put_node(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        return web.json_response(self._update_node(request.match_info["name"], body, subresource=False))

    async def _watch_nodes(self, request: web.Request, requirements: list[Requirement]) -> web.StreamResponse:
        since = request.query.get("resourceVersion", "")
        try:
            timeout = float(request.query.get("timeoutSeconds", "1800"))
        except ValueError as exc:
            raise ApiError(400, "timeoutSeconds must be an integer") from exc
        if since not in ("", "0") and not since.isdigit():
            raise ApiError(400, f"invalid resourceVersion {since!r}")
        bookmarks = _query_bool(request, "allowWatchBookmarks")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        wakeup = asyncio.Event()
        self._wakeups.add(wakeup)
        try:
            await self._stream(
                response,
                since=since,
                timeout=timeout,
                bookmarks=bookmarks,
                requirements=requirements,
                wakeup=wakeup,
            )
        except ConnectionResetError:
            # The client went away; the server just drops the watch.
            return response
        finally:
            self._wakeups.discard(wakeup)
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        *,
        since: str,
        timeout: float,
        bookmarks: bool,
        requirements: list[Requirement],
        wakeup: asyncio.Event,
    ) -> None:
        async def send(kind: str, obj: dict[str, Json]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since in ("", "0"):
            cursor = self._rv
            for _, node in sorted(self._nodes.items()):
                if _matches(node, requirements):
                    await send("ADDED", node)
        else:
            cursor = int(since)
            if cursor < self._compacted:
                expired = ApiError(410, f"too old resource version: {cursor} ({self._compacted})")
                await send("ERROR", expired.status())
                await response.write_eof()
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        every = self._bookmark_every if bookmarks else None
        next_bookmark = loop.time() + every if every else float("inf")
        epoch = self._watch_epoch

        def bookmark_version() -> int:
            # Every Node change up to the server's resourceVersion has been sent once nothing is
            # left after the cursor: the bookmark may then name that (the cacher's progress),
            # which other objects' writes have moved past the last Node change.
            caught_up = not self._history or self._history[-1].resource_version <= cursor
            return max(cursor, self._rv) if caught_up else cursor

        async def bookmark() -> None:
            meta = {"resourceVersion": str(bookmark_version())}
            await send("BOOKMARK", {"kind": "Node", "apiVersion": "v1", "metadata": meta})

        while not self._closing:
            if self._watch_epoch != epoch:
                await response.write_eof()  # ended by restart_watches: no bookmark, just the end
                return
            wakeup.clear()
            # History is in resourceVersion order: a bisection finds what is new, so a wake-up
            # costs the changes it sends, not the whole history (7,500 ADDED at a fleet's scale).
            start = bisect.bisect_right(self._history, cursor, key=lambda c: c.resource_version)
            for change in self._history[start:]:
                cursor = change.resource_version
                event = _watch_event(change, requirements)
                if event is not None:
                    await send(*event)
            now = loop.time()
            if now >= deadline:
                break
            if every and now >= next_bookmark:
                await bookmark()
                next_bookmark = now + every
            try:
                await asyncio.wait_for(wakeup.wait(), min(deadline, next_bookmark) - now)
            except TimeoutError:
                continue
        if bookmarks and not self._closing:
            await bookmark()
        await response.write_eof()

    # -- events -----------------------------------------------------------------------------------

    async def _create_event(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["ns"]
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "an Event must be a JSON object")
        meta = body.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400, "the namespace of the provided object does not match the namespace sent on the request"
            )
        involved = body.get("involvedObject")
        if not isinstance(involved, dict) or not involved.get("kind"):
            raise ApiError(422, "involvedObject.kind: Required value")
        if involved["kind"] in ("Node", "PersistentVolume") and namespace not in ("default", ""):
            raise ApiError(
                422, f"involvedObject.namespace: Invalid value: {namespace!r}: not allowed for node"
            )
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
        meta["resourceVersion"] = self._next_rv()
        body.update(kind="Event", apiVersion="v1")
        self.events.append(copy.deepcopy(body))
        return web.json_response(body, status=201)

    # -- leases -----------------------------------------------------------------------------------

    async def _create_token_review(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        if (
            not isinstance(body, dict)
            or body.get("apiVersion") != "authentication.k8s.io/v1"
            or body.get("kind") != "TokenReview"
        ):
            raise ApiError(400, "the body must be an authentication.k8s.io/v1 TokenReview")
        self.token_reviews.append(copy.deepcopy(body))
        spec = body.get("spec") or {}
        token = spec.get("token") or ""
        if not token:
            raise ApiError(400, "token is required for TokenReview in authentication")
        wanted = list(spec.get("audiences") or self.api_audiences)
        issued = self._issued.get(token)
        status: dict[str, Json]
        if issued is None:
            status = {"user": {}, "error": "invalid bearer token"}
        elif not (audiences := [a for a in issued.audiences if a in wanted]):
            status = {
                "user": {},
                "error": f"[invalid bearer token, token audiences {_go_quoted(issued.audiences)} "
                f"is invalid for the target audiences {_go_quoted(wanted)}]",
            }
        else:
            extra: dict[str, list[str]] = {}
            if issued.pod is not None:
                extra["authentication.kubernetes.io/pod-name"] = [issued.pod[0]]
                extra["authentication.kubernetes.io/pod-uid"] = [issued.pod[1]]
            if issued.node is not None:
                extra["authentication.kubernetes.io/node-name"] = [issued.node[0]]
                extra["authentication.kubernetes.io/node-uid"] = [issued.node[1]]
            extra["authentication.kubernetes.io/credential-id"] = [f"JTI={issued.credential_id}"]
            status = {
                "authenticated": True,
                "user": {
                    "username": f"system:serviceaccount:{issued.namespace}:{issued.service_account}",
                    "uid": issued.service_account_uid,
                    "groups": [
                        "system:serviceaccounts",
                        f"system:serviceaccounts:{issued.namespace}",
                        "system:authenticated",
                    ],
                    "extra": extra,
                },
                "audiences": audiences,
            }
        answer = {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }
        return web.json_response(answer, status=201)

    async def _list_leases(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info["ns"]
        items = [lease for (ns, _), lease in sorted(self._leases.items()) if ns == namespace]
        return web.json_response(
            {
                "kind": "LeaseList",
                "apiVersion": "coordination.k8s.io/v1",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _get_lease(self, request: web.Request) -> web.StreamResponse:
        ns, name = request.match_info["ns"], request.match_info["name"]
        lease = self._leases.get((ns, name))
        if lease is None:
            raise _not_found(LEASES, name)
        return web.json_response(lease)

    async def _lease_body(self, request: web.Request) -> dict[str, Json]:
        body = await self._read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "a Lease must be a JSON object")
        namespace = request.match_info["ns"]
        meta = body.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(
                400, "the namespace of the provided object does not match the namespace sent on the request"
            )
        spec = body.get("spec") or {}
        duration = spec.get("leaseDurationSeconds")
        if duration is not None and (not isinstance(duration, int) or duration <= 0):
            raise ApiError(
                422, f"spec.leaseDurationSeconds: Invalid value: {duration!r}: must be greater than 0"
            )
        transitions = spec.get("leaseTransitions")
        if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
            raise ApiError(422, f"spec.leaseTransitions: Invalid value: {transitions!r}: must be >= 0")
        body.update(kind="Lease", apiVersion="coordination.k8s.io/v1")
        meta["namespace"] = namespace
        return body

    def _store_lease(self, body: dict[str, Json]) -> dict[str, Json]:
        meta = body["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = self._next_rv()
        self._leases[(meta["namespace"], meta["name"])] = body
        return body

    async def _create_lease(self, request: web.Request) -> web.StreamResponse:
        body = await self._lease_body(request)
        meta = body["metadata"]
        if not meta.get("name"):
            raise ApiError(422, "metadata.name: Required value: name or generateName is required")
        if (meta["namespace"], meta["name"]) in self._leases:
            raise ApiError(
                409,
                f'{LEASES} "{meta["name"]}" already exists',
                reason="AlreadyExists",
                details={"name": meta["name"], "group": "coordination.k8s.io", "kind": "leases"},
            )
        for system in ("uid", "resourceVersion", "creationTimestamp"):
            meta.pop(system, None)
        return web.json_response(self._store_lease(body), status=201)

    async def _put_lease(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = await self._lease_body(request)
        meta = body["metadata"]
        if meta.get("name", name) != name:
            raise ApiError(
                400,
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
            )
        meta["name"] = name
        current = self._leases.get((meta["namespace"], name))
        if current is None:
            for system in ("uid", "resourceVersion", "creationTimestamp"):
                meta.pop(system, None)
            return web.json_response(self._store_lease(body), status=201)
        rv = meta.get("resourceVersion")
        if not rv:
            raise ApiError(
                422,
                f'Lease.coordination.k8s.io "{name}" is invalid: metadata.resourceVersion: '
                "Invalid value: 0x0: must be specified for an update",
            )
        if rv != current["metadata"]["resourceVersion"]:
            raise _conflict(LEASES, name)
        meta.update(
            uid=current["metadata"]["uid"], creationTimestamp=current["metadata"]["creationTimestamp"]
        )
        if body == current:
            return web.json_response(current)
        return web.json_response(self._store_lease(body))


def _query_bool(request: web.Request, name: str) -> bool:
    """Absent, "0" or "false" (any case) is false, anything else true: kubernetes_asyncio sends
    ``watch=True`` (apimachinery runtime/conversion.go ``Convert_Slice_string_To_bool``)."""
    if name not in request.query:
        return False
    value = request.query[name]
    return value != "0" and value.lower() != "false"


def _omit_empty(node: dict[str, Json]) -> None:
    """Empty lists and maps vanish, as Go's ``omitempty`` drops them when the server encodes."""
    for section, key in (("spec", "taints"), ("metadata", "labels"), ("metadata", "annotations")):
        part = node.get(section)
        if isinstance(part, dict) and not part.get(key, True):
            del part[key]


def _watch_event(change: _Change, requirements: list[Requirement]) -> tuple[str, dict[str, Json]] | None:
    now = change.type != "DELETED" and _matches(change.obj, requirements)
    before = change.type != "ADDED" and _matches(
        change.previous if change.type == "MODIFIED" else change.obj, requirements
    )
    if change.type == "DELETED":
        return ("DELETED", change.obj) if before else None
    if now and before:
        return ("MODIFIED", change.obj)
    if now:
        return ("ADDED", change.obj)
    if before:
        # Leaving the selector reads as a deletion: the previous object at the new resourceVersion.
        assert change.previous is not None
        gone = copy.deepcopy(change.previous)
        gone["metadata"]["resourceVersion"] = str(change.resource_version)
        return ("DELETED", gone)
    return None


class Intercepted:
    """A ``KubeApi`` that forwards every call to a real client, calling ``before(op)`` first (to
    record it, or to fail it as a lost connection would) and ``after_get(name)`` right after each
    node read (to play a writer that slips in between our read and our patch). ``watch_from``
    replaces the first watch's resourceVersion (to start a watch from a compacted version)."""

    def __init__(self, inner: KubeClient) -> None:
        self.inner = inner
        self.after_get: Callable[[str], None] | None = None
        self.watch_from: str | None = None

    def before(self, op: str) -> None:
        """Called before each call: ``get``, ``list``, ``watch`` (and each event), ``patch``,
        ``condition``, ``event``, ``get lease``, ``create lease``, ``replace lease``,
        ``token review``."""

    async def get_node(self, name: str) -> Node:
        self.before("get")
        node = await self.inner.get_node(name)
        if self.after_get is not None:
            self.after_get(name)
        return node

    async def list_nodes(self, *, label_selector: str | None = None) -> NodeList:
        self.before("list")
        return await self.inner.list_nodes(label_selector=label_selector)

    async def watch_nodes(
        self, *, resource_version: str, timeout_seconds: int = 300, label_selector: str | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        self.before("watch")
        if self.watch_from is not None:
            resource_version, self.watch_from = self.watch_from, None
        async with aclosing(
            self.inner.watch_nodes(
                resource_version=resource_version,
                timeout_seconds=timeout_seconds,
                label_selector=label_selector,
            )
        ) as events:
            async for event in events:
                self.before("watch")
                yield event

    async def patch_node(
        self,
        name: str,
        *,
        resource_version: str,
        taints: Sequence[Taint] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Node:
        self.before("patch")
        return await self.inner.patch_node(
            name, resource_version=resource_version, taints=taints, annotations=annotations
        )

    async def patch_node_condition(self, name: str, condition: Condition) -> Node:
        self.before("condition")
        return await self.inner.patch_node_condition(name, condition)

    async def create_event(self, namespace: str, event: EventRecord) -> None:
        self.before("event")
        await self.inner.create_event(namespace, event)

    async def get_lease(self, namespace: str, name: str) -> Lease:
        self.before("get lease")
        return await self.inner.get_lease(namespace, name)

    async def list_leases(self, namespace: str) -> list[Lease]:
        self.before("list leases")
        return await self.inner.list_leases(namespace)

    async def create_lease(self, lease: Lease) -> Lease:
        self.before("create lease")
        return await self.inner.create_lease(lease)

    async def replace_lease(self, lease: Lease) -> Lease:
        self.before("replace lease")
        return await self.inner.replace_lease(lease)

    async def create_token_review(self, token: str, audiences: Sequence[str]) -> TokenReviewStatus:
        self.before("token review")
        return await self.inner.create_token_review(token, audiences)

    async def close(self) -> None:
        await self.inner.close()
