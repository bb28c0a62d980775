"""The kubelet PodResources client against a real gRPC server on a unix socket.

The server double speaks the kubelet's own proto (tests/fixtures/podresources, copied unmodified
from k8s.io/kubelet): the same service and method name, the same messages on the wire, served by
grpcio the way the kubelet's grpc-go server serves them. What it cannot show is a real kubelet's
answer for a real node; the shapes below follow the API's documentation (device plugin devices,
CPU and memory assignments, DRA claims).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from agent import podresources
from agent import podresources_v1_pb2 as pb
from agent.attribution import ClaimDevice, ContainerDevices, PodResourcesError
from agent.podresources import LIST_METHOD, KubeletPodResources, listing_from_message, socket_support
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "podresources"
UUID0 = "GPU-3a1d5b5e-1f0c-6f4e-9a7b-0d2c9e8f1a10"
UUID1 = "GPU-7c2e4f60-2b1d-4e3f-8a9c-1e2d3f4a5b61"

Behaviour = Callable[[pb.ListPodResourcesRequest, grpc.ServicerContext], pb.ListPodResourcesResponse]


def kubelet_answer() -> pb.ListPodResourcesResponse:
    """A node as the kubelet lists it: a training pod with two GPUs and exclusive CPUs, a pod with
    an SR-IOV NIC only, a pod with no devices, and a pod with a DRA GPU claim."""
    numa0 = pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)])
    return pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                name="trainer-0",
                namespace="ml",
                containers=[
                    pb.ContainerResources(
                        name="pytorch",
                        devices=[
                            pb.ContainerDevices(
                                resource_name="nvidia.com/gpu", device_ids=[UUID0, UUID1], topology=numa0
                            ),
                            pb.ContainerDevices(
                                resource_name="nvidia.com/rdma_shared_device_a", device_ids=["r1"]
                            ),
                        ],
                        cpu_ids=[2, 3, 4, 5],
                        memory=[pb.ContainerMemory(memory_type="memory", size=1 << 30, topology=numa0)],
                    ),
                    pb.ContainerResources(name="sidecar"),
                ],
            ),
            pb.PodResources(
                name="dpdk",
                namespace="net",
                containers=[
                    pb.ContainerResources(
                        name="app",
                        devices=[
                            pb.ContainerDevices(
                                resource_name="openshift.io/mlnx_sriov", device_ids=["0000:3b:00.2"]
                            )
                        ],
                    )
                ],
            ),
            pb.PodResources(
                name="web", namespace="default", containers=[pb.ContainerResources(name="nginx")]
            ),
            pb.PodResources(
                name="infer",
                namespace="serve",
                containers=[
                    pb.ContainerResources(
                        name="triton",
                        dynamic_resources=[
                            pb.DynamicResource(
                                claim_name="single-gpu",
                                claim_namespace="serve",
                                claim_resources=[
                                    pb.ClaimResource(
                                        cdi_devices=[pb.CDIDevice(name="k8s.gpu.nvidia.com/device=gpu-1")],
                                        driver_name="gpu.nvidia.com",
                                        pool_name="node-a",
                                        device_name="gpu-1",
                                    )
                                ],
                            )
                        ],
                    )
                ],
            ),
        ]
    )


class Kubelet:
    """A PodResourcesLister on a unix socket; ``behaviour`` answers each List."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls = 0
        self.behaviour: Behaviour = lambda _req, _ctx: kubelet_answer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(
            self._list,
            request_deserializer=pb.ListPodResourcesRequest.FromString,
            response_serializer=pb.ListPodResourcesResponse.SerializeToString,
        )
        service, method = LIST_METHOD.strip("/").split("/")
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        self.server.add_insecure_port(f"unix://{path}")

    def _list(
        self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        self.calls += 1
        return self.behaviour(request, context)

    def start(self) -> Kubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # A short path of its own: a unix socket path has at most 107 bytes, and pytest's tmp_path
    # can be longer.
    path = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[Kubelet]:
    k = Kubelet(sockdir / "kubelet.sock").start()
    yield k
    k.stop()


def test_list_returns_every_container_s_devices_and_claims(kubelet: Kubelet) -> None:
    client = KubeletPodResources(kubelet.path)
    assert client.supported().supported
    listing = client.list()
    client.close()
    assert listing.pods == 4
    assert listing.devices == (
        ContainerDevices("ml", "trainer-0", "pytorch", "nvidia.com/gpu", (UUID0, UUID1)),
        ContainerDevices("ml", "trainer-0", "pytorch", "nvidia.com/rdma_shared_device_a", ("r1",)),
        ContainerDevices("net", "dpdk", "app", "openshift.io/mlnx_sriov", ("0000:3b:00.2",)),
    )
    assert listing.claims == (
        ClaimDevice(
            "serve", "infer", "triton", "serve", "single-gpu", "gpu.nvidia.com", "node-a", "gpu-1",
            ("k8s.gpu.nvidia.com/device=gpu-1",),
        ),
    )  # fmt: skip


def test_one_channel_serves_many_cycles(kubelet: Kubelet) -> None:
    client = KubeletPodResources(kubelet.path)
    for _ in range(3):
        assert client.list().pods == 4
    assert kubelet.calls == 3
    client.close()


def test_a_hung_kubelet_costs_one_deadline(kubelet: Kubelet) -> None:
    release = threading.Event()

    def hang(_req: pb.ListPodResourcesRequest, _ctx: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        release.wait(10)
        return pb.ListPodResourcesResponse()

    kubelet.behaviour = hang
    client = KubeletPodResources(kubelet.path, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(PodResourcesError, match="DEADLINE_EXCEEDED"):
        client.list()
    elapsed = time.monotonic() - start
    release.set()
    assert 0.25 <= elapsed < 2.0
    client.close()


def test_an_answer_larger_than_the_bound_fails_the_call(kubelet: Kubelet) -> None:
    big = pb.ListPodResourcesResponse(
        pod_resources=[pb.PodResources(name=f"pod-{i}", namespace="x" * 200) for i in range(200)]
    )
    assert big.ByteSize() > 32 * 1024
    kubelet.behaviour = lambda _req, _ctx: big
    client = KubeletPodResources(kubelet.path, max_message_bytes=32 * 1024)
    with pytest.raises(PodResourcesError, match="RESOURCE_EXHAUSTED"):
        client.list()
    # The default bound (16 MiB, the kubelet's own client's) takes it.
    assert KubeletPodResources(kubelet.path).list().pods == 200


def test_a_kubelet_error_is_a_typed_error_with_its_code(kubelet: Kubelet) -> None:
    def refuse(_req: pb.ListPodResourcesRequest, ctx: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")

    kubelet.behaviour = refuse
    client = KubeletPodResources(kubelet.path)
    with pytest.raises(PodResourcesError, match="RESOURCE_EXHAUSTED: rejected by rate limit"):
        client.list()


def test_a_restarted_kubelet_is_reached_on_the_next_call(sockdir: Path) -> None:
    path = sockdir / "kubelet.sock"
    first = Kubelet(path).start()
    client = KubeletPodResources(path, timeout_s=1.0)
    assert client.list().pods == 4
    first.stop()
    with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
        client.list()
    second = Kubelet(path).start()  # a new socket at the same path
    try:
        assert client.list().pods == 4  # at once, not after gRPC's reconnect backoff
    finally:
        second.stop()
        client.close()


def test_support_says_why_not(sockdir: Path) -> None:
    missing = socket_support(sockdir / "kubelet.sock")
    assert not missing.supported
    assert "no kubelet PodResources socket" in missing.reason
    assert "not on Kubernetes" in missing.reason
    plain = sockdir / "plain"
    plain.write_text("")
    assert "is not a unix socket" in socket_support(plain).reason


def test_a_socket_this_user_may_not_write_is_unsupported_with_the_reason(
    sockdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sockdir / "kubelet.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    try:
        path.chmod(0o755)
        owner = path.stat().st_uid
        # Seen by another user (the DaemonSet's uid 65532), whoever runs the tests.
        monkeypatch.setattr(os, "geteuid", lambda: owner + 65532)
        monkeypatch.setattr(os, "getegid", lambda: 65532)
        monkeypatch.setattr(os, "getgroups", lambda: [])
        support = socket_support(path)
        assert not support.supported
        assert "permission denied" in support.reason
        assert "srwxr-xr-x" in support.reason and "docs/deploy.md" in support.reason
        path.chmod(0o757)
        assert socket_support(path).supported
    finally:
        srv.close()


def test_a_root_owned_socket_is_refused_to_the_agent_s_user(
    sockdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the DaemonSet's agent (uid 65532) meets on a node: the kubelet's socket, root's, 0755."""
    path = sockdir / "kubelet.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    try:
        path.chmod(0o755)
        mode = path.stat().st_mode
        root_owned = os.stat_result((mode, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        assert podresources._may_write(root_owned)  # root, no capabilities: the owner bits
        monkeypatch.setattr(os, "geteuid", lambda: 65532)
        monkeypatch.setattr(os, "getegid", lambda: 65532)
        monkeypatch.setattr(os, "getgroups", lambda: [])
        assert not podresources._may_write(root_owned)
        group_writable = os.stat_result((mode | 0o020, 0, 0, 1, 0, 65532, 0, 0, 0, 0))
        assert podresources._may_write(group_writable)  # a supplementalGroups route would do
    finally:
        srv.close()


def test_listing_from_message_reads_the_real_wire_format() -> None:
    """Bytes as grpc-go would send them decode to the same listing (proto3 wire format)."""
    wire = kubelet_answer().SerializeToString()
    listing = listing_from_message(pb.ListPodResourcesResponse.FromString(wire))
    assert [d.pod for d in listing.devices] == ["trainer-0", "trainer-0", "dpdk"]


def test_the_committed_generated_code_is_what_protoc_makes_of_the_kubelet_proto(tmp_path: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{FIXTURES}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        "podresources_v1.proto",
    ]
    assert protoc.main(args) == 0
    for name in ("podresources_v1_pb2.py", "podresources_v1_pb2.pyi"):
        assert (tmp_path / name).read_bytes() == (REPO / "agent" / name).read_bytes(), name


def test_the_service_and_method_are_the_kubelet_s() -> None:
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert service.methods_by_name["List"].input_type.full_name == "v1.ListPodResourcesRequest"
    assert f"/{service.full_name}/List" == LIST_METHOD
    assert pb.DESCRIPTOR.GetOptions().go_package == "k8s.io/kubelet/pkg/apis/podresources/v1"


def test_the_agent_command_reports_the_pods_from_the_socket(kubelet: Kubelet) -> None:
    """``gpuwarden agent --once --print`` with fake GPUs and the kubelet double: report.pods."""
    import json
    import subprocess
    import sys

    from agent.gpu.fake import default_gpu

    uuid0, uuid3 = str(default_gpu(0)["uuid"]), str(default_gpu(3)["uuid"])
    kubelet.behaviour = lambda _req, _ctx: pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                name="trainer-0",
                namespace="ml",
                containers=[
                    pb.ContainerResources(
                        name="pytorch",
                        devices=[
                            pb.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[uuid0, uuid3])
                        ],
                    )
                ],
            )
        ]
    )
    argv = [
        "agent",
        "--once",
        "--print",
        "--node",
        "node-1",
        "--gpu-backend",
        f"fake:{REPO / 'tests' / 'fixtures' / 'gpus' / 'h100x8.json'}",
    ]

    def run(*extra: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, "-m", "gpuwarden", *argv, *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        report: dict[str, object] = json.loads(out.stdout)
        return report

    report = run("--pod-resources-socket", str(kubelet.path))
    assert report["pods"] == [
        {
            "namespace": "ml",
            "pod": "trainer-0",
            "container": "pytorch",
            "resource": "nvidia.com/gpu",
            "devices": [uuid0, uuid3],
        }
    ]
    # No socket there: no pods field, no error, and the agent still reports.
    report = run("--pod-resources-socket", str(kubelet.path.parent / "absent.sock"))
    assert "pods" not in report and "errors" not in report


def test_grpc_is_loaded_only_when_the_kubelet_is_asked() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from agent.podresources import KubeletPodResources; "
        "c = KubeletPodResources(Path('/nonexistent/kubelet.sock')); assert not c.supported().supported; "
        "print('grpc' in sys.modules, 'google.protobuf' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
