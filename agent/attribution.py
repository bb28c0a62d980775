"""Which pod, namespace and container hold which GPU of this node: GPU-to-pod attribution.

The kubelet knows, per container, the device IDs that device plugins (``nvidia.com/gpu``) and DRA
drivers (``gpu.nvidia.com``) handed it; ``agent.podresources`` asks it through the PodResources
API. This module is the pure part, and imports no gRPC: the plain types of one answer, the
``PodResourcesSource`` boundary (with a fake, healthy by default, for tests), the rule that ties a
device ID to a GPU of this node, and ``PodAttributor``, which the agent's cycle calls once per
report.

Device IDs, as the plugins name them (dcgm-exporter reads the same forms):

- ``GPU-<uuid>``: NVIDIA's device plugin, one whole GPU; NVML's UUID, so it matches ``Gpu.uuid``.
- ``GPU-<uuid>::<n>``: the same plugin's replicas of one GPU (time-slicing or MPS sharing): the
  part before ``::`` is the GPU.
- ``MIG-GPU-<uuid>/<gi>/<ci>``: a MIG device in the pre-R470 naming, which contains its parent
  GPU's UUID. ``MIG-<uuid>`` (R470 and later) does not: only NVML can tell its parent, so it is
  tied to a GPU only through ``mig_parents`` (MIG UUID to parent GPU UUID); the report carries it
  either way.
- ``nvidia<N>``, ``nvidia<N>/gi<M>``, ``nvidia<N>/vgpu<K>``: GKE's device plugin, by GPU index N.
- DRA (``dynamic_resources``): the claim names a driver, a pool and a device (``gpu-<minor>`` for
  NVIDIA's driver, where minor is the /dev/nvidia<minor> number, not NVML's index), and the CDI
  device names the runtime injected. The report carries them (resource = the driver name,
  devices = the DRA device names); tying them to a UUID needs the driver's ResourceSlice (an API
  server read), which the agent does not do.

``Report.pods`` is left UNSET when attribution is not available (no socket, or the call failed):
absent means "unknown", an empty list means "no pod holds a GPU here".
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import msgspec

from agent.clock import Clock
from agent.collectors.base import Support
from agent.errors import CollectorFailure
from agent.report import Gpu, GpuAllocation, Jobs
from agent.state import CollectorStatus

log = logging.getLogger(__name__)

# Where the kubelet serves the PodResources API: pod-resources/ under its --root-dir (default
# /var/lib/kubelet); a kubelet with another root dir needs --pod-resources-socket.
DEFAULT_SOCKET: Final = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
NAME: Final = "podresources"  # the collector name in statuses, errors and gpuwarden_collector_*
MAX_ALLOCATIONS: Final = 256  # the schema's bound on Report.pods
MAX_DEVICES: Final = 64  # the schema's bound on GpuAllocation.devices
MAX_NAME: Final = 253  # namespace, pod, container and resource (Str253)
MAX_DEVICE_ID: Final = 96  # Str96
# NVIDIA's DRA driver for GPUs (k8s-dra-driver-gpu); its other driver, compute-domain.nvidia.com,
# hands out IMEX channels, not GPUs.
DRA_GPU_DRIVERS: Final = frozenset({"gpu.nvidia.com"})
# After a failed call the next one waits 5 s, then 10, 20, 40 and at most 60 s: a stuck kubelet
# costs one deadline per minute at worst, not one per cycle.
RETRY_FIRST_S: Final = 5.0
RETRY_MAX_S: Final = 60.0

_GKE_RE = re.compile(r"^nvidia(\d+)(?:/(?:gi\d+|vgpu\d+))*$")
_LEGACY_MIG_RE = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/\d+/\d+$")


class PodResourcesError(CollectorFailure):
    """The kubelet's PodResources API could not be read this cycle (timeout, refused, too large)."""


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices of one resource, as the kubelet lists them (device plugins)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class ClaimDevice:
    """One device of one DRA claim that a container uses."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    driver: str
    pool: str
    device: str
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class PodListing:
    """One answer of the kubelet's List: every container's devices, of every resource."""

    devices: tuple[ContainerDevices, ...] = ()
    claims: tuple[ClaimDevice, ...] = ()
    pods: int = 0


class PodResourcesSource(Protocol):
    """The kubelet's PodResources API. ``list`` raises ``PodResourcesError`` when it cannot answer."""

    def supported(self) -> Support: ...

    def list(self) -> PodListing: ...

    def close(self) -> None: ...


@dataclass
class FakePodResources:
    """A kubelet in memory: supported, answering ``listing``; set ``fail`` or ``unsupported``."""

    listing: PodListing = field(default_factory=PodListing)
    fail: str | None = None
    unsupported: str | None = None
    calls: int = 0
    closed: bool = False

    def supported(self) -> Support:
        return Support(False, self.unsupported) if self.unsupported else Support(True)

    def list(self) -> PodListing:
        self.calls += 1
        if self.fail is not None:
            raise PodResourcesError(self.fail)
        return self.listing

    def close(self) -> None:
        self.closed = True


def is_gpu_resource(name: str) -> bool:
    """A device-plugin resource of NVIDIA GPUs: nvidia.com/gpu, its renamed shared replicas
    (nvidia.com/gpu.shared) and the MIG profiles (nvidia.com/mig-1g.10gb, ...)."""
    return name == "nvidia.com/gpu" or name.startswith(("nvidia.com/gpu.", "nvidia.com/mig-"))


def resolve_device(
    device_id: str,
    uuids: Mapping[str, int],
    indexes: frozenset[int] | set[int],
    mig_parents: Mapping[str, str] | None = None,
) -> int | None:
    """The index of the GPU of this node that ``device_id`` is (or is a part of), None if none.

    ``uuids``: GPU UUID to index, from the report's GPUs; ``indexes``: the indexes there are.
    """
    base = device_id.split("::", 1)[0]
    index = uuids.get(base)
    if index is not None:
        return index
    legacy = _LEGACY_MIG_RE.match(base)
    if legacy is not None:
        return uuids.get(legacy.group(1))
    if base.startswith("MIG-"):
        parent = (mig_parents or {}).get(base)
        return uuids.get(parent) if parent is not None else None
    gke = _GKE_RE.match(base)
    if gke is not None:
        n = int(gke.group(1))
        return n if n in indexes else None
    return None


def gpu_holders(
    pods: Sequence[GpuAllocation], gpus: Mapping[int, str], mig_parents: Mapping[str, str] | None = None
) -> dict[int, list[GpuAllocation]]:
    """GPU index to the allocations that hold it (several where a GPU is shared), in report order.

    ``gpus``: the node's GPUs, index to UUID (the report's, or what the aggregator kept of it).
    """
    uuids = {uuid: index for index, uuid in gpus.items()}
    indexes = frozenset(gpus)
    held: dict[int, list[GpuAllocation]] = {}
    for alloc in pods:
        seen: set[int] = set()
        for device in alloc.devices:
            index = resolve_device(device, uuids, indexes, mig_parents)
            if index is not None and index not in seen:
                seen.add(index)
                held.setdefault(index, []).append(alloc)
    return held


def pod_gpus(
    pods: Sequence[GpuAllocation], gpus: Mapping[int, str], namespace: str | None, pod: str
) -> list[int]:
    """The indexes of the GPUs of this node that pod ``pod`` (in ``namespace``, or any) holds."""
    return sorted(
        index
        for index, allocs in gpu_holders(pods, gpus).items()
        if any(a.pod == pod and (namespace is None or a.namespace == namespace) for a in allocs)
    )


def pod_hostname(pod: str) -> str:
    """The hostname the kubelet gives a pod's containers (without ``spec.hostname``): the pod's
    name, cut to 63 characters (one DNS label) and stripped of a trailing ``-`` or ``.``."""
    return pod[:63].rstrip("-.")


def attribute_collectives(jobs: Jobs, pods: Sequence[GpuAllocation], gpus: Mapping[int, str]) -> Jobs:
    """``jobs`` with each Inspector row's ``gpu`` set where attribution tells it.

    Inspector writes the process's hostname, which in a pod is the pod's (``pod_hostname``). A
    row whose hostname is a pod of this node holding exactly one GPU ran on that GPU. A pod with
    several GPUs says nothing about which of them a rank used (that is the job's
    CUDA_VISIBLE_DEVICES and local rank), and a name two namespaces share says nothing either:
    those rows, and rows that already have a ``gpu``, are left as they are.
    """
    holders = gpu_holders(pods, gpus)
    by_host: dict[str, set[tuple[str, str]]] = {}
    held: dict[tuple[str, str], set[int]] = {}
    for index, allocs in holders.items():
        for a in allocs:
            by_host.setdefault(pod_hostname(a.pod), set()).add((a.namespace, a.pod))
            held.setdefault((a.namespace, a.pod), set()).add(index)
    single: dict[str, int] = {}
    for host, owners in by_host.items():
        if len(owners) == 1:
            indexes = held[next(iter(owners))]
            if len(indexes) == 1:
                single[host] = next(iter(indexes))
    if not single:
        return jobs
    rows = [
        msgspec.structs.replace(row, gpu=single[row.hostname])
        if row.gpu is msgspec.UNSET and isinstance(row.hostname, str) and row.hostname in single
        else row
        for row in jobs.collectives
    ]
    return msgspec.structs.replace(jobs, collectives=rows)


def allocations(listing: PodListing, gpus: Sequence[Gpu]) -> tuple[list[GpuAllocation], list[str]]:
    """The report's ``pods`` from one List answer, and what had to be left out.

    A container's devices count as GPUs when their resource is an NVIDIA GPU resource, or when one
    of them is a GPU of this node (a plugin configured with another resource name); DRA devices
    count when their driver is NVIDIA's GPU driver. Other resources (NICs, hugepages, CPUs) are
    not GPUs and are left out silently.
    """
    uuids = {gpu.uuid: gpu.index for gpu in gpus}
    indexes = frozenset(uuids.values())
    problems: list[str] = []
    out: list[GpuAllocation] = []

    def add(namespace: str, pod: str, container: str, resource: str, devices: Sequence[str]) -> None:
        names = (namespace, pod, container, resource)
        if any(len(n) > MAX_NAME for n in names):
            problems.append(f"{namespace}/{pod}/{container}: a name longer than {MAX_NAME} characters")
            return
        kept = [d for d in devices if len(d) <= MAX_DEVICE_ID]
        if len(kept) < len(devices):
            problems.append(
                f"{namespace}/{pod}/{container}: {len(devices) - len(kept)} device IDs longer than "
                f"{MAX_DEVICE_ID} characters left out"
            )
        if len(kept) > MAX_DEVICES:
            problems.append(
                f"{namespace}/{pod}/{container}: {len(kept) - MAX_DEVICES} devices beyond {MAX_DEVICES}"
            )
            kept = kept[:MAX_DEVICES]
        if kept:
            out.append(
                GpuAllocation(
                    namespace=namespace, pod=pod, container=container, resource=resource, devices=tuple(kept)
                )
            )

    for entry in listing.devices:
        if not entry.device_ids:
            continue
        if is_gpu_resource(entry.resource) or any(
            resolve_device(d, uuids, indexes) is not None for d in entry.device_ids
        ):
            add(entry.namespace, entry.pod, entry.container, entry.resource, entry.device_ids)
    # DRA: one allocation per (container, driver), its devices in the kubelet's order.
    claimed: dict[tuple[str, str, str, str], list[str]] = {}
    for claim in listing.claims:
        if claim.driver in DRA_GPU_DRIVERS and claim.device:
            key = (claim.namespace, claim.pod, claim.container, claim.driver)
            devices = claimed.setdefault(key, [])
            if claim.device not in devices:
                devices.append(claim.device)
    for (namespace, pod, container, driver), devices in claimed.items():
        add(namespace, pod, container, driver, devices)
    out.sort(key=lambda a: (a.namespace, a.pod, a.container, a.resource))
    if len(out) > MAX_ALLOCATIONS:
        problems.append(f"{len(out) - MAX_ALLOCATIONS} GPU allocations beyond {MAX_ALLOCATIONS} left out")
        out = out[:MAX_ALLOCATIONS]
    return out, problems


@dataclass(frozen=True)
class Attribution:
    """One cycle's attribution: ``pods`` None when not available, with the status and errors."""

    pods: list[GpuAllocation] | None
    status: CollectorStatus
    errors: tuple[str, ...] = ()


class PodAttributor:
    """Asks the kubelet once per cycle (never per scrape) and says plainly when it cannot.

    Not supported (no socket: not on Kubernetes, or the hostPath is not mounted; or a socket this
    agent may not connect to) is a state,
    logged once when it begins and once when it ends, never per cycle; the collector status
    (``gpuwarden_collector_supported{collector="podresources"}`` 0) says it on /metrics. A failed
    call is an error in that cycle's report; the next call waits (``RETRY_FIRST_S`` doubling up
    to ``RETRY_MAX_S``) so that a hung kubelet is not asked every cycle.
    """

    name = NAME

    def __init__(self, source: PodResourcesSource, clock: Clock) -> None:
        self.source = source
        self.clock = clock
        self._unsupported: str | None = None
        self._failing: str | None = None
        self._failures = 0
        self._retry_at = 0.0

    def collect(self, gpus: Sequence[Gpu]) -> Attribution:
        start = time.perf_counter()
        support = self.source.supported()
        if not support.supported:
            if self._unsupported != support.reason:
                log.info("pod attribution not available", extra={"reason": support.reason})
                self._unsupported = support.reason
            self._failing, self._failures, self._retry_at = None, 0, 0.0
            return Attribution(None, CollectorStatus(NAME, False, support.reason, False, 0.0))
        if self._unsupported is not None:
            log.info("pod attribution available", extra={"was": self._unsupported})
            self._unsupported = None
        now = self.clock.monotonic()
        if self._failing is not None and now < self._retry_at:
            message = (
                f"not asked this cycle (next try in {self._retry_at - now:.0f} s) after: {self._failing}"
            )
            return Attribution(None, CollectorStatus(NAME, True, message, False, 0.0), (message,))
        try:
            listing = self.source.list()
        except PodResourcesError as exc:
            message = str(exc)
            self._failures += 1
            self._retry_at = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self._failures - 1))
            if self._failing != message:
                log.warning("kubelet PodResources call failed", extra={"error": message})
            self._failing = message
            elapsed = time.perf_counter() - start
            return Attribution(None, CollectorStatus(NAME, True, message, False, elapsed), (message,))
        if self._failing is not None:
            log.info("kubelet PodResources call recovered", extra={"failures": self._failures})
        self._failing, self._failures, self._retry_at = None, 0, 0.0
        pods, problems = allocations(listing, gpus)
        elapsed = time.perf_counter() - start
        return Attribution(pods, CollectorStatus(NAME, True, "", True, elapsed), tuple(problems))

    def close(self) -> None:
        self.source.close()
