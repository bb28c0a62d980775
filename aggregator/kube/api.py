"""The narrow Kubernetes API gpuwarden uses: a typed Protocol, implemented by ``client.KubeClient``.

Every method raises only ``aggregator.kube.objects.KubeError`` subclasses.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Protocol

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


class KubeApi(Protocol):
    async def get_node(self, name: str) -> Node: ...

    async def list_nodes(self, *, label_selector: str | None = None) -> NodeList: ...

    def watch_nodes(
        self, *, resource_version: str, timeout_seconds: int = 300, label_selector: str | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Events after ``resource_version`` until the server ends the watch, bookmarks included
        (the caller resumes from the last of either); ``KubeGone`` when the version is too old (the
        caller lists again)."""
        ...

    async def patch_node(
        self,
        name: str,
        *,
        resource_version: str,
        taints: Sequence[Taint] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Node:
        """Strategic merge patch of ``spec.taints`` (replaced whole: the list has no merge key) and
        ``metadata.annotations`` (None deletes a key), with ``metadata.resourceVersion`` as a
        precondition: ``KubeConflict`` (409) if the node changed since it was read."""
        ...

    async def patch_node_condition(self, name: str, condition: Condition) -> Node:
        """Strategic merge patch of ``status.conditions`` through the ``/status`` subresource;
        conditions merge by ``type``, so the kubelet's own conditions are untouched."""
        ...

    async def create_event(self, namespace: str, event: EventRecord) -> None: ...

    async def get_lease(self, namespace: str, name: str) -> Lease:
        """``KubeNotFound`` when there is none yet."""
        ...

    async def list_leases(self, namespace: str) -> list[Lease]:
        """Every Lease of ``namespace``, in one LIST (a namespace holds a handful: no paging)."""
        ...

    async def create_lease(self, lease: Lease) -> Lease:
        """``KubeConflict`` when another replica created it first."""
        ...

    async def replace_lease(self, lease: Lease) -> Lease:
        """PUT with ``lease.resource_version``: ``KubeConflict`` when someone else wrote it since."""
        ...

    async def create_token_review(self, token: str, audiences: Sequence[str]) -> TokenReviewStatus:
        """POST an authentication.k8s.io/v1 TokenReview of ``token`` for ``audiences``: the server's
        verdict, an unauthenticated token included (that is an answer, not an error). ``KubeForbidden``
        when our own account may not create tokenreviews."""
        ...

    async def close(self) -> None: ...
