"""The parts of Kubernetes objects gpuwarden reads and writes, as plain immutable values.

Only what remediation needs is kept; everything else on a Node (other controllers' taints,
labels, annotations) travels untouched because every write is a patch of our own fields only, or
a whole ``spec.taints`` list rebuilt from a fresh read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.errors import GpuwardenError

TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
ConditionStatus = Literal["True", "False", "Unknown"]
EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    effect: TaintEffect
    value: str | None = None
    time_added: str | None = None  # RFC 3339, set by the API server for NoExecute; kept as read


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: ConditionStatus
    reason: str
    message: str
    last_transition_time: str | None = None  # RFC 3339
    last_heartbeat_time: str | None = None


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    resource_version: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    conditions: tuple[Condition, ...] = ()
    unschedulable: bool = False


@dataclass(frozen=True, slots=True)
class NodeList:
    items: tuple[Node, ...]
    resource_version: str  # the list's, to start a watch from


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One watch event: ADDED, MODIFIED, DELETED."""

    type: Literal["ADDED", "MODIFIED", "DELETED"]
    node: Node


@dataclass(frozen=True, slots=True)
class WatchBookmark:
    """A watch's BOOKMARK: every change up to ``resource_version`` has been sent. A watch resumed
    from it needs no LIST even when no Node changed for longer than the API server keeps history
    (other objects move the resourceVersion on; a resume from an old one is 410 Gone)."""

    resource_version: str


WatchEvent = NodeEvent | WatchBookmark


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    namespace: str
    resource_version: str
    holder: str | None
    lease_duration_seconds: int | None
    acquire_time: str | None  # RFC 3339 with microseconds (MicroTime)
    renew_time: str | None
    transitions: int = 0
    annotations: Mapping[str, str] = field(default_factory=dict)
    # The object as the API server returned it ({} for one not read yet). A write starts from it
    # and changes only the fields above, as client-go's LeaseLock.Update does: what others put
    # on the Lease (labels, finalizers, ownerReferences, spec fields newer than this code, such
    # as preferredHolder and strategy) is kept, never wiped by a renewal.
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """A core/v1 Event about a Node (``involvedObject`` kind Node)."""

    node: str
    node_uid: str
    type: EventType
    reason: str  # CamelCase, e.g. GpuwardenQuarantined
    message: str
    component: str = "gpuwarden-aggregator"


@dataclass(frozen=True, slots=True)
class UserInfo:
    """Who a reviewed token belongs to (authentication.k8s.io/v1 ``UserInfo``)."""

    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    # For a pod-bound service-account token: authentication.kubernetes.io/pod-name, pod-uid and
    # (Kubernetes 1.30+) node-name, node-uid, credential-id.
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenReviewStatus:
    """The API server's verdict on a token (``TokenReview.status``)."""

    authenticated: bool
    user: UserInfo | None = None
    # The audiences the token is valid for among those asked (None: the server named none).
    audiences: tuple[str, ...] | None = None
    error: str = ""


# -- errors: every API failure surfaces as one of these -------------------------------------------


# A Retry-After beyond this is taken as this: a misconfigured proxy's "come back in an hour" must
# not park a quarantine for an hour (APF itself asks 1 s; client-go takes the header as sent).
RETRY_AFTER_MAX_S = 30.0


class KubeError(GpuwardenError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (0: no answer). ``retry_after``:
    the seconds the server asked us to wait (429 or 5xx with ``Retry-After`` or the Status's
    ``details.retryAfterSeconds``), capped at ``RETRY_AFTER_MAX_S``; None when it named none."""

    def __init__(self, message: str, *, status: int = 0, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = None if retry_after is None else min(max(retry_after, 0.0), RETRY_AFTER_MAX_S)

    def wait_s(self, default: float) -> float:
        """How long to wait before the next try: ``default``, or longer when the server asked."""
        return default if self.retry_after is None else max(default, self.retry_after)


class KubeConflict(KubeError):
    """409 (stale resourceVersion, object exists) or 422 from a failed JSON Patch ``test``: re-read
    and retry."""


class KubeNotFound(KubeError):
    """404: the object is gone (a node deleted while we worked on it)."""


class KubeGone(KubeError):
    """410: the watch's resourceVersion is too old; list again."""


class KubeUnavailable(KubeError):
    """No answer, 429, 5xx: back off and retry."""


class KubeForbidden(KubeError):
    """401/403: our RBAC is missing something (docs/remediation.md lists what we need)."""
