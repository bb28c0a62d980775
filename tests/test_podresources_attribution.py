"""GPU-to-pod attribution: device IDs to this node's GPUs, the report's ``pods``, /metrics, the cycle.

The device ID forms are the ones dcgm-exporter's pod mapper handles (NVIDIA's device plugin,
its shared replicas, MIG in both namings, GKE's plugin) and DRA claims of NVIDIA's GPU driver.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import subprocess

import msgspec
import pytest
from msgspec import UNSET
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.attribution import (
    NAME,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    ClaimDevice,
    ContainerDevices,
    FakePodResources,
    PodAttributor,
    PodListing,
    allocations,
    attribute_collectives,
    gpu_holders,
    is_gpu_resource,
    pod_gpus,
    resolve_device,
)
from agent.clock import FakeClock
from agent.collectors.base import Collected, Support
from agent.metrics import AgentMetrics, AgentSnapshot, make_registry
from agent.report import Collective, Gpu, GpuAllocation, Jobs, Stat, decode, encode
from agent.runner import Agent

UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444444444444" for i in range(8)]
GPUS = [Gpu(index=i, uuid=u) for i, u in enumerate(UUIDS)]
BY_UUID = {g.uuid: g.index for g in GPUS}
BY_INDEX = {g.index: g.uuid for g in GPUS}
INDEXES = frozenset(BY_UUID.values())


def _dev(pod: str, resource: str, *ids: str, ns: str = "ml", ctr: str = "main") -> ContainerDevices:
    return ContainerDevices(ns, pod, ctr, resource, ids)


@pytest.mark.parametrize(
    ("device", "index"),
    [
        (UUIDS[3], 3),  # NVIDIA's device plugin: the GPU's UUID
        (f"{UUIDS[5]}::2", 5),  # its time-slicing / MPS replicas
        (f"MIG-{UUIDS[6]}/1/0", 6),  # MIG, pre-R470 naming (parent UUID inside)
        ("nvidia2", 2),  # GKE
        ("nvidia4/gi1", 4),  # GKE MIG
        ("nvidia7/vgpu3", 7),  # GKE shared
        ("nvidia9", None),  # GKE index this node does not have
        ("MIG-8d5b4d4e-4a5b-5f2e-9c1d-0e1f2a3b4c5d", None),  # R470+ MIG: parent unknown without NVML
        ("GPU-ffffffff-0000-0000-0000-000000000000", None),  # another node's GPU
        ("gpu-1", None),  # a DRA device name (minor number, not NVML's index)
        ("0000:3b:00.2", None),  # an SR-IOV NIC
        ("", None),
    ],
)
def test_resolve_device(device: str, index: int | None) -> None:
    assert resolve_device(device, BY_UUID, INDEXES) == index


def test_a_new_style_mig_uuid_resolves_through_its_parent() -> None:
    mig = "MIG-8d5b4d4e-4a5b-5f2e-9c1d-0e1f2a3b4c5d"
    assert resolve_device(mig, BY_UUID, INDEXES, {mig: UUIDS[1]}) == 1
    assert resolve_device(f"{mig}::1", BY_UUID, INDEXES, {mig: UUIDS[1]}) == 1


def test_gpu_resources() -> None:
    assert is_gpu_resource("nvidia.com/gpu")
    assert is_gpu_resource("nvidia.com/gpu.shared")
    assert is_gpu_resource("nvidia.com/mig-1g.10gb")
    assert not is_gpu_resource("nvidia.com/rdma_shared_device_a")
    assert not is_gpu_resource("openshift.io/mlnx_sriov")
    assert not is_gpu_resource("nvidia.com/gpux")


def test_allocations_keep_gpus_and_leave_other_devices_out() -> None:
    listing = PodListing(
        devices=(
            _dev("trainer-0", "nvidia.com/gpu", UUIDS[0], UUIDS[1]),
            _dev("trainer-0", "nvidia.com/rdma_shared_device_a", "r1"),  # a NIC: not a GPU
            _dev("renamed", "example.com/accel", UUIDS[2], ns="b"),  # another name, but our GPU
            _dev("other", "example.com/fpga", "fpga0", ns="b"),
            _dev("mig", "nvidia.com/mig-1g.10gb", "MIG-8d5b4d4e-4a5b-5f2e-9c1d-0e1f2a3b4c5d", ns="c"),
            _dev("empty", "nvidia.com/gpu", ns="c"),
        ),
        claims=(
            ClaimDevice("serve", "infer", "triton", "serve", "one", "gpu.nvidia.com", "node-a", "gpu-1"),
            ClaimDevice("serve", "infer", "triton", "serve", "one", "gpu.nvidia.com", "node-a", "gpu-1"),
            ClaimDevice("serve", "infer", "triton", "serve", "imex", "compute-domain.nvidia.com", "p", "ch0"),
        ),
    )
    pods, problems = allocations(listing, GPUS)
    assert problems == []
    assert [(a.namespace, a.pod, a.container, a.resource, a.devices) for a in pods] == [
        ("b", "renamed", "main", "example.com/accel", (UUIDS[2],)),
        # A MIG device is reported even where its parent cannot be told (R470+ naming).
        ("c", "mig", "main", "nvidia.com/mig-1g.10gb", ("MIG-8d5b4d4e-4a5b-5f2e-9c1d-0e1f2a3b4c5d",)),
        ("ml", "trainer-0", "main", "nvidia.com/gpu", (UUIDS[0], UUIDS[1])),
        ("serve", "infer", "triton", "gpu.nvidia.com", ("gpu-1",)),  # DRA: the driver's device names
    ]
    assert {i: [a.pod for a in al] for i, al in gpu_holders(pods, BY_INDEX).items()} == {
        0: ["trainer-0"],
        1: ["trainer-0"],
        2: ["renamed"],
    }
    assert pod_gpus(pods, BY_INDEX, "ml", "trainer-0") == [0, 1]
    assert pod_gpus(pods, BY_INDEX, None, "trainer-0") == [0, 1]
    assert pod_gpus(pods, BY_INDEX, "other-ns", "trainer-0") == []


def test_a_shared_gpu_has_every_holder() -> None:
    listing = PodListing(
        devices=(
            _dev("a", "nvidia.com/gpu.shared", f"{UUIDS[0]}::0"),
            _dev("b", "nvidia.com/gpu.shared", f"{UUIDS[0]}::1", f"{UUIDS[0]}::2"),
        )
    )
    pods, _ = allocations(listing, GPUS)
    assert [a.pod for a in gpu_holders(pods, BY_INDEX)[0]] == ["a", "b"]  # b once, for two replicas


def test_allocations_respect_the_schema_s_bounds() -> None:
    many = tuple(_dev(f"p{i:03d}", "nvidia.com/gpu", UUIDS[i % 8]) for i in range(300))
    wide = _dev("wide", "nvidia.com/gpu", *(f"{UUIDS[0]}::{i}" for i in range(70)))
    long_id = _dev("long", "nvidia.com/gpu", "GPU-" + "a" * 100, UUIDS[1])
    long_name = _dev("n" * 254, "nvidia.com/gpu", UUIDS[2])
    pods, problems = allocations(PodListing(devices=(*many, wide, long_id, long_name)), GPUS)
    assert len(pods) == 256
    assert any("beyond 256" in p for p in problems)
    assert any("6 devices beyond 64" in p for p in problems)
    assert any("1 device IDs longer than 96" in p for p in problems)
    assert any("longer than 253" in p for p in problems)
    # Whatever was kept is a valid report section.
    report = _report(pods)
    assert decode(encode(report)).pods == tuple(pods)


def _report(pods: list[GpuAllocation] | None) -> msgspec.Struct:
    clock = FakeClock()
    agent = Agent(
        node="node-a",
        collectors=[_Gpus()],
        clock=clock,
        boot_id="b",
        pods=PodAttributor(FakePodResources(PodListing()), clock),
    )
    report = agent.cycle().report
    return msgspec.structs.replace(report, pods=pods if pods is not None else UNSET)


class _Gpus:
    name = "nvml"

    def supported(self) -> Support:
        return Support(True)

    def collect(self) -> Collected:
        return Collected(gpus=tuple(GPUS[:2]))

    def close(self) -> None:
        pass


def _agent(source: FakePodResources, clock: FakeClock | None = None) -> tuple[Agent, FakeClock]:
    clock = clock or FakeClock()
    return Agent(
        node="node-a", collectors=[_Gpus()], clock=clock, boot_id="b", pods=PodAttributor(source, clock)
    ), clock


def test_the_cycle_puts_the_pods_in_the_report_and_asks_once() -> None:
    source = FakePodResources(PodListing(devices=(_dev("trainer-0", "nvidia.com/gpu", UUIDS[1]),), pods=1))
    agent, _ = _agent(source)
    result = agent.cycle()
    assert result.report.pods == (
        GpuAllocation(
            namespace="ml", pod="trainer-0", container="main", resource="nvidia.com/gpu", devices=(UUIDS[1],)
        ),
    )
    assert source.calls == 1
    status = {s.name: s for s in result.statuses}[NAME]
    assert status.supported and status.success
    # Scrapes read the cycle's report: no further call to the kubelet.
    metrics = AgentMetrics(lambda: AgentSnapshot(cycle=result))
    registry = make_registry(metrics, process_metrics=False)
    for _ in range(3):
        generate_latest(registry)
    assert source.calls == 1
    decode(encode(result.report))  # valid against the schema's types
    agent.close()
    assert source.closed


def test_no_pod_holding_a_gpu_is_an_empty_list_not_absent() -> None:
    agent, _ = _agent(
        FakePodResources(PodListing(devices=(_dev("nic", "openshift.io/sriov", "0000:3b:00.2"),)))
    )
    assert agent.cycle().report.pods == ()


def test_without_a_socket_pods_are_unset_and_it_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    reason = "no kubelet PodResources socket at /x (not on Kubernetes, or ... not mounted)"
    source = FakePodResources(unsupported=reason)
    agent, _ = _agent(source)
    caplog.set_level(logging.INFO, logger="agent.attribution")
    results = [agent.cycle() for _ in range(5)]
    assert all(r.report.pods is UNSET for r in results)
    assert all(not r.report.errors for r in results)  # a state, not an error each cycle
    assert source.calls == 0
    status = {s.name: s for s in results[-1].statuses}[NAME]
    assert not status.supported and status.reason == reason
    assert [r.getMessage() for r in caplog.records] == ["pod attribution not available"]
    # The metric that says so.
    text = generate_latest(
        make_registry(AgentMetrics(lambda: AgentSnapshot(cycle=results[-1])), process_metrics=False)
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
    }
    assert samples[("gpuwarden_collector_supported", (("collector", NAME),))] == 0.0
    assert not any(name == "gpuwarden_gpu_pod_info" for name, _ in samples)
    # The socket appears (the kubelet started, the mount was fixed): attribution starts, logged once.
    source.unsupported = None
    assert agent.cycle().report.pods == ()
    assert [r.getMessage() for r in caplog.records][-1] == "pod attribution available"


def test_a_failing_kubelet_is_an_error_and_is_asked_less_often(caplog: pytest.LogCaptureFixture) -> None:
    source = FakePodResources(fail="kubelet PodResources List: DEADLINE_EXCEEDED: Deadline Exceeded")
    agent, clock = _agent(source)
    caplog.set_level(logging.INFO, logger="agent.attribution")
    calls_at: list[float] = []
    t0 = clock.monotonic()
    for _ in range(40):  # 400 s of 10 s cycles
        before = source.calls
        report = agent.cycle().report
        if source.calls > before:
            calls_at.append(clock.monotonic() - t0)
        assert report.pods is UNSET
        assert report.errors and report.errors[-1].collector == NAME
        assert "DEADLINE_EXCEEDED" in report.errors[-1].message
        clock.advance(10.0)
    gaps = [b - a for a, b in itertools.pairwise(calls_at)]
    assert gaps[:4] == [10.0, 10.0, 20.0, 40.0]  # waits of 5, 10, 20, 40 s rounded up to cycles
    assert max(gaps) <= RETRY_MAX_S and gaps[-1] == RETRY_MAX_S
    assert RETRY_FIRST_S == 5.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # the same failure is logged once
    source.fail = None
    clock.advance(RETRY_MAX_S)
    assert agent.cycle().report.pods == ()
    assert caplog.records[-1].getMessage() == "kubelet PodResources call recovered"
    asked = source.calls
    source.fail = "boom"  # failing again after recovering waits the first interval again, not 60 s
    agent.cycle()
    clock.advance(RETRY_FIRST_S)
    agent.cycle()
    assert source.calls == asked + 2


def test_an_attributor_bug_does_not_cost_the_report() -> None:
    class Broken(FakePodResources):
        def list(self) -> PodListing:
            raise RuntimeError("bug")

    agent, _ = _agent(Broken())
    report = agent.cycle().report
    assert len(report.gpus) == 2
    assert report.pods is UNSET
    assert report.errors and report.errors[0].message == "RuntimeError: bug"


def test_the_info_metric_has_one_series_per_gpu_and_container() -> None:
    listing = PodListing(
        devices=(
            _dev("trainer-0", "nvidia.com/gpu", UUIDS[0], UUIDS[1], ctr="pytorch"),
            _dev("a", "nvidia.com/gpu.shared", f"{UUIDS[1]}::0", ns="x"),
            _dev("a", "example.com/also", UUIDS[1], ns="x"),  # the same container twice: one series
        )
    )
    agent, _ = _agent(FakePodResources(listing))
    result = agent.cycle()
    text = generate_latest(
        make_registry(AgentMetrics(lambda: AgentSnapshot(cycle=result)), process_metrics=False)
    )
    info = sorted(
        tuple(s.labels[k] for k in ("gpu", "uuid", "namespace", "pod", "container"))
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if s.name == "gpuwarden_gpu_pod_info"
    )
    assert info == [
        ("0", UUIDS[0], "ml", "trainer-0", "pytorch"),
        ("1", UUIDS[1], "ml", "trainer-0", "pytorch"),
        ("1", UUIDS[1], "x", "a", "main"),
    ]
    assert b"# TYPE gpuwarden_gpu_pod_info gauge" in text
    promtool = shutil.which("promtool")
    if promtool is not None:
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, check=False)
        assert out.returncode == 0, out.stdout + out.stderr


def _row(hostname: str | None, gpu: int | None = None) -> Collective:
    stat = Stat(min=1.0, p10=1.0, p50=1.0, p90=1.0, max=1.0)
    return Collective(
        comm="0xad56c683b0c4ef",
        collective="AllReduce",
        size_bytes=1 << 20,
        n_ranks=2,
        nnodes=2,
        count=10,
        timing_source="kernel_gpu",
        busbw_gbs=stat,
        exec_time_us=stat,
        hostname=hostname if hostname is not None else UNSET,
        gpu=gpu if gpu is not None else UNSET,
    )


def test_inspector_rows_of_a_one_gpu_pod_get_its_gpu() -> None:
    long_name = "w" * 62 + "-0"  # 64 characters: the hostname is cut to 63, then loses its "-"
    pods = (
        GpuAllocation(
            namespace="ml", pod="one-gpu", container="c", resource="nvidia.com/gpu", devices=(UUIDS[4],)
        ),
        GpuAllocation(
            namespace="ml", pod=long_name, container="c", resource="nvidia.com/gpu", devices=(UUIDS[6],)
        ),
        GpuAllocation(
            namespace="ml", pod="eight", container="c", resource="nvidia.com/gpu", devices=UUIDS[:2]
        ),
        # The same pod name in two namespaces: nothing can be told.
        GpuAllocation(
            namespace="a", pod="twin", container="c", resource="nvidia.com/gpu", devices=(UUIDS[2],)
        ),
        GpuAllocation(
            namespace="b", pod="twin", container="c", resource="nvidia.com/gpu", devices=(UUIDS[3],)
        ),
    )
    jobs = Jobs(
        format="gpuwarden/jobs/v1",
        records=5,
        dropped=0,
        collectives=(
            _row("one-gpu"),
            _row("w" * 62),  # the kubelet's hostname for that pod
            _row("eight"),
            _row("twin"),
            _row("node-a"),  # hostNetwork: the node's name
            _row(None),
            _row("one-gpu", gpu=7),  # already known (Prometheus mode): kept
        ),
    )
    out = attribute_collectives(jobs, pods, BY_INDEX)
    assert [r.gpu for r in out.collectives] == [4, 6, UNSET, UNSET, UNSET, UNSET, 7]
    assert attribute_collectives(jobs, [], BY_INDEX) is jobs


def test_the_cycle_fills_in_the_gpu_of_the_jobs_rows() -> None:
    class Inspector:
        name = "nccl_inspector"

        def supported(self) -> Support:
            return Support(True)

        def collect(self) -> Collected:
            jobs = Jobs(format="gpuwarden/jobs/v1", records=1, dropped=0, collectives=(_row("trainer-0"),))
            return Collected(jobs=jobs)

        def close(self) -> None:
            pass

    clock = FakeClock()
    source = FakePodResources(PodListing(devices=(_dev("trainer-0", "nvidia.com/gpu", UUIDS[1]),)))
    agent = Agent(
        node="node-a",
        collectors=[_Gpus(), Inspector()],
        clock=clock,
        boot_id="b",
        pods=PodAttributor(source, clock),
    )
    report = agent.cycle().report
    assert report.jobs is not UNSET
    assert [r.gpu for r in report.jobs.collectives] == [1]
    decode(encode(report))
