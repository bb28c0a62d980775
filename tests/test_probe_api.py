"""The probe routes over HTTP: who may poll and for whom, leadership, and the NCCL rendezvous."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from agent.clock import FakeClock
from agent.probes.protocol import ASSIGNMENTS_PATH, PROTOCOL, RENDEZVOUS_PATH, AssignmentList, verify
from aggregator.auth import StaticTokens
from aggregator.config import ProbesConfig
from aggregator.fleet.pools import Placement
from aggregator.probes.api import probe_routes
from aggregator.probes.scheduler import ProbeScheduler

KEY = b"probe-key-for-tests-0123456789ab"
NODES = ("gpu-a", "gpu-b")
TOKENS = {
    "gpu-a": "token-of-gpu-a-0123456789",
    "gpu-b": "token-of-gpu-b-0123456789",
    "gpu-c": "token-of-gpu-c-01234",
}

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


class Harness:
    def __init__(
        self, client: Client, scheduler: ProbeScheduler, clock: FakeClock, leader: list[bool]
    ) -> None:
        self.client = client
        self.scheduler = scheduler
        self.clock = clock
        self.leader = leader

    async def poll(self, node: str, token_of: str | None = None, **query: str) -> tuple[int, Any]:
        token = TOKENS[token_of or node]
        resp = await self.client.get(
            ASSIGNMENTS_PATH, params={"node": node, **query}, headers={"Authorization": f"Bearer {token}"}
        )
        return resp.status, await resp.json()

    async def pair(self) -> tuple[str, dict[str, Any]]:
        """Both nodes report and poll until the scheduler pairs them; their assignments by node."""
        for n in NODES:
            self.scheduler.observe(n, Placement("h100", leaf="l1"), idle=True, now=self.clock.time())
        got: dict[str, Any] = {}
        for _ in range(3):
            for n in NODES:
                status, body = await self.poll(n, address=f"{n}.cluster.local:7700")
                assert status == 200
                if body["assignments"]:
                    got[n] = body["assignments"][0]
            if len(got) == 2:
                break
            self.clock.advance(11)
        assert len(got) == 2
        return got["gpu-a"]["id"], got

    async def put(
        self, probe_id: str, body: object, token_of: str, raw: bytes | None = None
    ) -> tuple[int, Any]:
        resp = await self.client.put(
            f"{RENDEZVOUS_PATH}/{probe_id}",
            data=raw if raw is not None else msgspec.json.encode(body),
            headers={"Authorization": f"Bearer {TOKENS[token_of]}", "Content-Type": "application/json"},
        )
        return resp.status, await resp.json()

    async def fetch(self, probe_id: str, node: str, token_of: str | None = None) -> tuple[int, Any]:
        resp = await self.client.get(
            f"{RENDEZVOUS_PATH}/{probe_id}",
            params={"node": node},
            headers={"Authorization": f"Bearer {TOKENS[token_of or node]}"},
        )
        return resp.status, await resp.json()


@pytest.fixture
async def harness(aiohttp_client: MakeClient, tmp_path: Path) -> Harness:
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{n} {t}\n" for n, t in TOKENS.items()))
    clock = FakeClock()
    cfg = msgspec.convert({"pair_kind": "nccl_allreduce_pair", "local_kind": None}, ProbesConfig)
    scheduler = ProbeScheduler(cfg, KEY)
    leader = [True]
    app = web.Application()
    app.router.add_routes(
        probe_routes(scheduler, StaticTokens(token_file), clock, is_leader=lambda: leader[0])
    )
    return Harness(await aiohttp_client(app), scheduler, clock, leader)


async def test_poll_answers_signed_assignments_for_the_tokens_node(harness: Harness) -> None:
    probe_id, _ = await harness.pair()
    status, body = await harness.poll("gpu-b")
    assert status == 200
    listing = msgspec.convert(body, AssignmentList)
    assert listing.protocol == PROTOCOL and listing.node == "gpu-b"
    assert listing.poll_seconds == harness.scheduler.config.poll_seconds
    [mine] = listing.assignments
    assert mine.id == probe_id and mine.node == "gpu-b" and mine.peer == "gpu-a"
    assert verify(mine, KEY)
    # The advertised address reached the scheduler: the rank-1 end knows where rank 0 is.
    assert mine.rank == 1 and mine.peer_address == "gpu-a.cluster.local:7700"


async def test_poll_refuses_missing_bad_and_foreign_tokens(harness: Harness) -> None:
    resp = await harness.client.get(ASSIGNMENTS_PATH, params={"node": "gpu-a"})
    assert resp.status == 401 and (await resp.json())["error"] == "missing_token"
    resp = await harness.client.get(
        ASSIGNMENTS_PATH, params={"node": "gpu-a"}, headers={"Authorization": "Bearer not-a-token-at-all"}
    )
    assert resp.status == 401 and (await resp.json())["error"] == "bad_token"
    status, body = await harness.poll("gpu-a", token_of="gpu-b")
    assert status == 403 and body["error"] == "node_mismatch"
    status, body = await harness.poll("gpu-a", address="not an address")
    assert status == 400 and body["error"] == "bad_request"
    # None of it counted as a poll: gpu-a is not schedulable.
    assert harness.scheduler.assignments_total == {}


async def test_a_follower_answers_an_empty_list(harness: Harness) -> None:
    harness.leader[0] = False
    for n in NODES:
        harness.scheduler.observe(n, Placement("h100", leaf="l1"), idle=True, now=harness.clock.time())
    for _ in range(3):
        for n in NODES:
            status, body = await harness.poll(n)
            assert status == 200 and body["assignments"] == []
            assert body["poll_seconds"] == harness.scheduler.config.poll_seconds
        harness.clock.advance(11)
    assert harness.scheduler.in_flight_count == 0
    status, body = await harness.fetch("any-id", "gpu-a")
    assert status == 503 and body["error"] == "not_leader"


async def test_rendezvous_hands_the_unique_id_from_one_end_to_the_other(harness: Harness) -> None:
    probe_id, _ = await harness.pair()
    status, body = await harness.fetch(probe_id, "gpu-b")
    assert status == 404 and body["error"] == "not_published"
    unique = "ab" * 128
    status, body = await harness.put(probe_id, {"node": "gpu-a", "unique_id": unique}, "gpu-a")
    assert status == 200
    status, body = await harness.fetch(probe_id, "gpu-b")
    assert status == 200 and body == {"unique_id": unique}
    # The same value again is harmless; another is refused; the first stays.
    assert (await harness.put(probe_id, {"node": "gpu-a", "unique_id": unique}, "gpu-a"))[0] == 200
    status, body = await harness.put(probe_id, {"node": "gpu-b", "unique_id": "cd" * 128}, "gpu-b")
    assert status == 409 and body["error"] == "conflict"
    assert (await harness.fetch(probe_id, "gpu-a"))[1] == {"unique_id": unique}
    # Gone after the probe's deadline.
    view = harness.scheduler.probe(probe_id)
    assert view is not None
    harness.clock.advance(view.deadline - harness.clock.time() + 1)
    status, body = await harness.fetch(probe_id, "gpu-b")
    assert status == 404 and body["error"] == "unknown_assignment"


async def test_rendezvous_refuses_strangers_impostors_and_big_bodies(harness: Harness) -> None:
    probe_id, _ = await harness.pair()
    good = {"node": "gpu-a", "unique_id": "ab" * 128}
    # gpu-c has a valid token but is not an end of this probe.
    status, body = await harness.put(probe_id, {"node": "gpu-c", "unique_id": "ab"}, "gpu-c")
    assert status == 403 and body["error"] == "forbidden"
    # gpu-c cannot write in gpu-a's name either.
    status, body = await harness.put(probe_id, good, "gpu-c")
    assert status == 403 and body["error"] == "node_mismatch"
    status, body = await harness.put("no-such-probe", good, "gpu-a")
    assert status == 404 and body["error"] == "unknown_assignment"
    limit = harness.scheduler.config.rendezvous_max_bytes
    status, body = await harness.put(probe_id, {"node": "gpu-a", "unique_id": "ab" * limit}, "gpu-a")
    assert status == 413 and body["error"] == "body_too_large"
    status, body = await harness.put(probe_id, None, "gpu-a", raw=b'{"node": "gpu-a", "unique_id": "zz"}')
    assert status == 400
    status, body = await harness.put(probe_id, None, "gpu-a", raw=b"{not json")
    assert status == 400
    # Nothing of that was stored; the real end still publishes, and a stranger cannot read it.
    assert (await harness.put(probe_id, good, "gpu-a"))[0] == 200
    status, body = await harness.fetch(probe_id, "gpu-c")
    assert status == 403 and body["error"] == "forbidden"
    status, body = await harness.fetch(probe_id, "gpu-b", token_of="gpu-c")
    assert status == 403 and body["error"] == "node_mismatch"


async def test_a_node_may_advertise_only_its_own_probe_address(harness: Harness) -> None:
    # Partners connect to what a node advertises: never another machine, never a privileged port.
    for address in ("10.1.2.3:22", "10.1.2.3:7700", "gpu-b.cluster.local:7700", "127.0.0.1:22"):
        status, body = await harness.poll("gpu-a", address=address)
        assert status == 403 and body["error"] == "forbidden", address
    for address in ("127.0.0.1:7700", "gpu-a:7700", "gpu-a.cluster.local:7700"):
        status, _ = await harness.poll("gpu-a", address=address)
        assert status == 200, address
