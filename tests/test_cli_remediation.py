"""``gpuwarden aggregator --remediation enforce`` and ``gpuwarden breaker`` as operators run them:
the real processes, the real Kubernetes client, against the API-server double (tests/kube_double.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import FIXTURES, REPO
from tests.kube_double import KubeApiDouble
from tests.ports import free_port
from tests.test_cli_end_to_end import GPWD, agent_to, aggregator_args, write_node_token

ADMIN = "admin-token-0123456789abcdef"


async def _run(*args: str, timeout: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *GPWD, *args, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _get(url: str) -> dict[str, Any]:
    def fetch() -> dict[str, Any]:
        # Reads need a viewer or admin token (aggregator/service.py).
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data

    return await asyncio.to_thread(fetch)


async def _eventually(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await check():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_the_aggregator_taints_through_the_real_client_and_the_breaker_cli_works(
    tmp_path: Path,
) -> None:
    async with KubeApiDouble() as api:
        api.add_node("node-1", labels={"gpuwarden.io/pool": "h100"})
        api.add_node(
            "node-2", labels={"gpuwarden.io/pool": "h100"}, taints=[{"key": "other", "effect": "NoSchedule"}]
        )
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        write_node_token(tmp_path)
        (tmp_path / "admins").write_text(f"# on-call\n{ADMIN}\n")
        (tmp_path / "admin.token").write_text(f"{ADMIN}\n")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server = await asyncio.create_subprocess_exec(
            *GPWD,
            *aggregator_args(port, tmp_path),
            "--remediation",
            "enforce",
            "--kubeconfig",
            str(kubeconfig),
            "--identity",
            "agg-test",
            "--admin-token-file",
            str(tmp_path / "admins"),
            cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:

            async def leading() -> bool:
                return bool((await _get(f"{base}/api/v1/remediation"))["is_leader"])

            await _eventually(leading, "the aggregator to lead")
            lease = api.lease("gpuwarden", "gpuwarden-aggregator")
            assert lease is not None and lease["spec"]["holderIdentity"] == "agg-test"

            code, _out, err = await _run(
                *agent_to(base, f"fake:{FIXTURES / 'gpus' / 'gpu_lost.json'}", tmp_path / "node-1.token")
            )
            assert code == 0, err

            async def tainted() -> bool:
                return any(
                    t["key"] == "gpuwarden.io/unhealthy" for t in api.node("node-1")["spec"].get("taints", [])
                )

            await _eventually(tainted, "node-1's taint")
            [ours] = [t for t in api.node("node-1")["spec"]["taints"] if t["key"] == "gpuwarden.io/unhealthy"]
            assert (ours["value"], ours["effect"]) == ("gpu-lost", "NoSchedule")
            # The other node: never reported, so never touched.
            assert api.node("node-2")["spec"]["taints"] == [{"key": "other", "effect": "NoSchedule"}]

            code, out, err = await _run(
                "breaker", "status", "--aggregator", base, "--token-file", str(tmp_path / "admin.token")
            )
            assert code == 0, err
            status = json.loads(out)
            assert status["mode"] == "enforce" and status["breaker"]["open"] is False

            def reset(token_file: str, *by: str) -> list[str]:
                return [
                    "breaker",
                    "reset",
                    "--aggregator",
                    base,
                    "--token-file",
                    str(tmp_path / token_file),
                    *by,
                ]

            code, out, err = await _run(*reset("node-1.token", "--by", "eve"))
            assert code == 2 and "HTTP 401" in err  # an agent's token is not an admin's
            code, out, err = await _run(*reset("admin.token", "--by", "alice", "--reason", "drill"))
            assert code == 0, err
            assert json.loads(out)["reset"]["reset_by"] == "alice"
        finally:
            server.terminate()
            await asyncio.wait_for(server.wait(), 20)
        assert server.returncode == 0
    audit = [json.loads(line) for line in (tmp_path / "decisions.audit.jsonl").read_text().splitlines()]
    assert [(a["action"], a["by"], a["detail"]["reason"]) for a in audit] == [
        ("breaker_reset", "alice", "drill")
    ]
