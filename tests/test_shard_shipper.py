"""The agent's side of sharding: a redirect to the owning shard is followed at once and
remembered; an error there falls back to the configured URL; the report leaves the spool only
on a 2xx, so a move of its pool loses nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.clock import FakeClock
from agent.shardroute import ShardRoute
from agent.shipper import Shipper
from tests.ports import free_port
from tests.test_shipper import FAST, FakeAggregator, Reply, Request, make_report, wait_until

REPORTS = "/v1/reports"


@pytest.fixture
def aggregators() -> Iterator[list[FakeAggregator]]:
    made: list[FakeAggregator] = []
    yield made
    for a in made:
        a.stop()


@pytest.fixture
def shipper_of(tmp_path: Path) -> Iterator[Callable[[str], Shipper]]:
    token = tmp_path / "token"
    token.write_text("token-one\n")
    made: list[Shipper] = []

    def make(url: str) -> Shipper:
        s = Shipper(url, token, FakeClock(), **FAST)  # type: ignore[arg-type]
        made.append(s)
        s.start()
        return s

    yield make
    for s in made:
        s.close(timeout_s=0.2)


def redirect_to(owner: FakeAggregator, shard: str = "1/2") -> Callable[[Request], Reply]:
    return lambda _req: Reply(
        307, headers={"Location": owner.url() + REPORTS, "X-Gpuwarden-Shard": shard}, body=b"{}"
    )


def test_a_redirect_is_followed_at_once_and_remembered(
    aggregators: list[FakeAggregator], shipper_of: Callable[[str], Shipper]
) -> None:
    wrong, owner = FakeAggregator(), FakeAggregator()
    aggregators += [wrong, owner]
    wrong.respond = redirect_to(owner)
    shipper = shipper_of(wrong.url())
    for seq in range(1, 4):
        shipper.submit(make_report(seq))
    assert shipper.flush(5.0)
    assert owner.accepted_seqs() == [1, 2, 3]
    assert wrong.seqs_tried() == [1]  # one detour, then straight to the owner
    stats = shipper.stats()
    assert (stats.sent_total, stats.failed_attempts_total, stats.dropped_total) == (3, 0, 0)


def test_the_owner_down_falls_back_and_the_report_waits_in_the_spool(
    aggregators: list[FakeAggregator], shipper_of: Callable[[str], Shipper]
) -> None:
    port = free_port()
    wrong, owner = FakeAggregator(), FakeAggregator(port)
    aggregators.append(wrong)
    wrong.respond = redirect_to(owner)
    shipper = shipper_of(wrong.url())
    shipper.submit(make_report(1))
    assert shipper.flush(5.0)
    owner.stop()  # the owning shard's replica goes away (a restart, a change of N)
    shipper.submit(make_report(2))
    wait_until(lambda: wrong.seqs_tried().count(2) >= 2)  # back to the configured URL, redirected again
    held = shipper.stats()
    assert (held.sent_total, held.dropped_total) == (1, 0)  # report 2 is held, not lost
    assert 2 not in wrong.accepted_seqs()
    back = FakeAggregator(port)
    aggregators.append(back)
    assert shipper.flush(5.0)
    assert back.accepted_seqs() == [2]
    assert shipper.stats().dropped_total == 0


def test_a_5xx_from_the_learned_shard_falls_back_to_the_configured_url(
    aggregators: list[FakeAggregator], shipper_of: Callable[[str], Shipper]
) -> None:
    first, moved = FakeAggregator(), FakeAggregator()
    aggregators += [first, moved]
    first.respond = redirect_to(moved)
    shipper = shipper_of(first.url())
    shipper.submit(make_report(1))
    assert shipper.flush(5.0)
    # The number of shards changed: the learned replica is not the owner any more and is failing;
    # the configured one now owns the pool.
    moved.respond = lambda _req: Reply(503, headers={"Retry-After": "0"})
    first.respond = lambda _req: Reply()
    shipper.submit(make_report(2))
    assert shipper.flush(5.0)
    assert first.accepted_seqs() == [2]


def test_only_a_redirect_to_the_reports_endpoint_on_the_same_scheme_is_followed() -> None:
    route = ShardRoute("https", REPORTS)
    route.saw(307, "http://shard-1:8080/v1/reports")  # a downgrade would send the token in clear
    route.saw(307, "https://shard-1:8443/elsewhere")
    route.saw(307, "https://user:pw@shard-1/v1/reports")
    route.saw(302, "https://shard-1/v1/reports")
    assert route.learned is None and not route.redirected()
    route.saw(307, "https://shard-1.gpuwarden.svc:8443/v1/reports", "1/4")
    assert route.learned is not None
    assert (route.learned.host, route.learned.port) == ("shard-1.gpuwarden.svc", 8443)
    assert route.redirected() and not route.redirected()  # once
    route.saw(307, "https://shard-1.gpuwarden.svc:8443/v1/reports")  # a loop: not again
    assert not route.redirected()
    route.failed("ConnectionRefusedError")
    assert route.learned is None
