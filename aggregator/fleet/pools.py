"""Where a node sits: its pool (the peers it is compared with) and its failure domains.

The pool is, first found wins:

1. the report's ``labels.pool`` (the operator's own grouping, set on the agent);
2. the Kubernetes node labels in ``K8S_POOL_LABELS`` (filled in by the remediation part, which
   watches the nodes; empty until then);
3. the GPU model: the most common ``Gpu.model`` among the node's GPUs, made label-safe
   (``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``), so that nodes are compared with
   nodes of the same hardware even when nobody configured anything;
4. ``"unknown"`` (no label and no GPU model: such nodes are at least compared with each other).

Failure domains (rack, leaf switch, zone) come from the report's labels first, then from the
Kubernetes labels in ``K8S_DOMAIN_LABELS``; a domain nobody names is None. The silence detector
groups silent nodes by these, so one rack losing power is one event, not forty node problems.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Mapping
from typing import Final

import msgspec
from msgspec import UNSET

from agent.report import Report

UNKNOWN_POOL: Final = "unknown"

# Kubernetes node labels that name a pool, in order of preference.
K8S_POOL_LABELS: Final[tuple[str, ...]] = ("gpuwarden.io/pool", "node.kubernetes.io/instance-type")
# Kubernetes node labels that name a failure domain, in order of preference.
K8S_DOMAIN_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "rack": ("gpuwarden.io/rack",),
    "leaf": ("gpuwarden.io/leaf",),
    "zone": ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone"),
}

_LABEL_VALUE_MAX: Final = 63  # a Kubernetes label value's limit; pools end up in taints and logs
_NOT_LABEL_SAFE: Final = re.compile(r"[^a-z0-9]+")


class Placement(msgspec.Struct, frozen=True, gc=False):
    """Where a node sits: its pool and its failure domains. Strings only, so a struct the cycle
    collector need not track (one per node, held for as long as the node is known)."""

    pool: str
    rack: str | None = None
    leaf: str | None = None
    zone: str | None = None


def label_safe(text: str) -> str:
    """Lower case, every run of other characters one ``-``, trimmed to a label value's 63 chars."""
    safe = _NOT_LABEL_SAFE.sub("-", text.lower()).strip("-")
    return safe[:_LABEL_VALUE_MAX].rstrip("-")


def gpu_model_pool(report: Report) -> str | None:
    """The label-safe name of the node's most common GPU model; None when no GPU names one.

    A tie (a node half of one model, half another, which should not exist) goes to the name that
    sorts first, so the answer does not depend on the order of the GPUs in the report.
    """
    return _model_pool(tuple(g.model for g in report.gpus))


# Every report of a node names the same models: what they make is worked out once per set of
# names (a Counter and a regex a GPU cost more than the rest of placing a node). Bounded, as the
# names are what agents send.
@functools.lru_cache(maxsize=256)
def _model_pool(models: tuple[str | None, ...]) -> str | None:
    counts = Counter(label_safe(m) for m in models if m)
    counts.pop("", None)
    if not counts:
        return None
    return min(counts.items(), key=lambda item: (-item[1], item[0]))[0]


def _first(labels: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = labels.get(key)
        if value:
            return value
    return None


def k8s_pool(labels: Mapping[str, str]) -> str | None:
    """The pool a node's Kubernetes labels name (the first of ``K8S_POOL_LABELS`` set)."""
    return _first(labels, K8S_POOL_LABELS)


def placement_of(report: Report, k8s_labels: Mapping[str, str] | None = None) -> Placement:
    """The node's pool and failure domains from its report and its Kubernetes node labels."""
    own: Mapping[str, str] = report.labels if report.labels is not UNSET else {}
    return place(own, gpu_model_pool(report), k8s_labels)


def place(own: Mapping[str, str], model_pool: str | None, k8s_labels: Mapping[str, str] | None) -> Placement:
    """``placement_of`` from what it reads of a report (its labels, its GPU model's pool), so a
    node can be placed again when the Kubernetes labels arrive without keeping its report."""
    k8s: Mapping[str, str] = k8s_labels if k8s_labels is not None else {}
    pool = own.get("pool") or _first(k8s, K8S_POOL_LABELS) or model_pool or UNKNOWN_POOL
    domains = {name: own.get(name) or _first(k8s, keys) for name, keys in K8S_DOMAIN_LABELS.items()}
    return Placement(pool, rack=domains["rack"], leaf=domains["leaf"], zone=domains["zone"])
