"""What GPU-to-pod attribution costs the agent: memory, and time and CPU per kubelet call.

A kubelet double (tests/test_podresources.py's, the kubelet's own proto over a unix socket) runs in
a child process and lists a full node: 110 pods (the kubelet's default maxPods), eight of them
holding one GPU each, the rest with no devices. This process is the agent's side: it imports
what the agent imports, then asks ``--calls`` times through ``KubeletPodResources`` and turns each
answer into the report's ``pods`` (``allocations``).

    .venv/bin/python bench/podresources.py [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_SERVER = """
import sys, time
from pathlib import Path
from agent import podresources_v1_pb2 as pb
from tests.test_podresources import Kubelet
pods = [
    pb.PodResources(name=f"pod-{i}", namespace="jobs", containers=[
        pb.ContainerResources(name="main", devices=[
            pb.ContainerDevices(
                resource_name="nvidia.com/gpu", device_ids=[f"GPU-{i:08x}-1111-2222-3333-444444444444"]
            )
        ] if i < 8 else [])
    ]) for i in range(110)
]
k = Kubelet(Path(sys.argv[1]))
k.behaviour = lambda _r, _c: pb.ListPodResourcesResponse(pod_resources=pods)
k.start()
print("up", flush=True)
sys.stdin.read()
"""


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    # After sys.path has the repository: what the agent has loaded before its first cycle.
    import agent.cli  # noqa: F401, PLC0415
    from agent.attribution import allocations  # noqa: PLC0415
    from agent.podresources import KubeletPodResources  # noqa: PLC0415
    from agent.report import Gpu  # noqa: PLC0415

    gpus = [Gpu(index=i, uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444") for i in range(8)]
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        sock = Path(tmp) / "kubelet.sock"
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(sock)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == b"up"
            before = rss_mib()
            client = KubeletPodResources(sock)
            pods, _ = allocations(client.list(), gpus)
            assert len(pods) == 8
            first = rss_mib()
            wall: list[float] = []
            cpu: list[float] = []
            for _ in range(args.calls):
                t, c = time.perf_counter(), time.process_time()
                allocations(client.list(), gpus)
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            after = rss_mib()
            client.close()
        finally:
            server.communicate(b"", timeout=10)
    print(
        f"RSS before the first call {before:.1f} MiB, after it {first:.1f} MiB, "
        f"after {args.calls} more {after:.1f} MiB"
    )
    print(
        f"per call (110 pods, 8 with a GPU): wall median {statistics.median(wall) * 1e3:.2f} ms, "
        f"agent CPU median {statistics.median(cpu) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
