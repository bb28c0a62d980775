"""The status page: the aggregator's fleet as server-rendered HTML, for on-call during an incident.

    GET /                  the fleet at a glance: per pool and rack, the breaker, systemic events
    GET /nodes             the node list: filter (state, pool, rack), search (name, reason), pages
    GET /nodes/{node}      one node: state history, reasons with evidence, sparklines, what next
    GET /decisions         the decision feed, newest first
    GET /systemic          systemic events, one line each
    GET /links             pair bandwidth as a heat map, and the links that are not healthy
    GET /probes            active-probe coverage
    GET /api/v1/summary            the glance as JSON (``gpuwarden status``)
    GET /api/v1/nodes/{node}/story one node's story as JSON (``gpuwarden explain``)

Read-only, like the JSON read API it is built on (``source``: the pipeline's ``nodes``, ``node``,
``decisions_since``, and where it has them ``systemic_events``, ``breaker``, ``link_matrix`` and
``probe_coverage``). Everything that came from an agent (node names, reasons, evidence) is
escaped. The only assets are this package's stylesheet and icon, and the Content-Security-Policy
forbids anything else, so a page opened in an air-gapped cluster fetches nothing from another
host. No script anywhere: forms are plain GETs. Pages without a form refresh themselves by
``<meta refresh>``, and say so with a link that stops it (``?refresh=off``); a page with a form
(the node list, the decisions, the links) never reloads under what someone is typing.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from importlib import resources
from string import Template
from typing import Any, Final, Protocol
from urllib.parse import quote, urlencode

from aiohttp import web

from agent.clock import Clock
from aggregator.config import Config
from aggregator.story import duration, evidence_value, iso, next_step, override_note, runbook_url
from aggregator.web import svg

log = logging.getLogger(__name__)

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "STATES",
    "NodeFilter",
    "OtherShards",
    "ShardNodes",
    "StatusSource",
    "StatusView",
    "fleet_summary",
    "one_row_per_node",
    "status_routes",
]

STATES: Final = ("healthy", "suspect", "quarantined", "probation")
# Overlays on the four states: a silent node is suspect, a held one quarantined.
COUNTED: Final = (*STATES, "silent", "held")
_TROUBLE: Final = {"quarantined": 0, "probation": 1, "suspect": 2, "healthy": 3}
PER_PAGE: Final = 100
MAX_PER_PAGE: Final = 500
MATRIX_MAX_NODES: Final = 64
DECISION_WINDOW_S: Final = 86_400.0
NODES_TTL_S: Final = 2.0  # a page may show the fleet as it was this long ago
# A node page's node, looked up once before the page is rendered.
_FOUND: Final = web.RequestKey("gpuwarden_status_node", dict)
_OTHERS_KEPT: Final = 16  # callers whose view of the other shards is kept (status.StatusView)
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
# Quarantined nodes the fleet page lists by name; the rest are one click away (the node list).
_GLANCE_QUARANTINED: Final = 20
_REFRESH_S: Final = {"glance": 15, "node": 10, "feed": 15}
# The request a page is rendered for (set by ``_guard``): its ``?refresh=off`` and its address.
_REQUEST: contextvars.ContextVar[web.Request | None] = contextvars.ContextVar(
    "gpuwarden_status_request", default=None
)
# Systemic events the fleet page lists; the rest are on /systemic.
_GLANCE_SYSTEMIC: Final = 10
# Unicode's bidirectional controls (embeddings, overrides, isolates, marks): text an agent sent
# with one would reverse what follows it on the page, the time of the last report included.
# Shown as their code points instead: escaped like the rest, and visible.
_BIDI: Final = {
    c: f"[U+{c:04X}]" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)
}

_PKG = resources.files("aggregator.web")
_PAGE: Final = Template((_PKG / "templates" / "page.html").read_text(encoding="utf-8"))
_ASSETS: Final[Mapping[str, tuple[bytes, str]]] = {
    "status.css": ((_PKG / "static" / "status.css").read_bytes(), "text/css"),
    "favicon.svg": ((_PKG / "static" / "favicon.svg").read_bytes(), "image/svg+xml"),
}
# The stylesheet's address names its content: browsers keep it an hour (``asset``), and a page of
# a newer aggregator asks for the new one rather than styling itself with the old.
_CSS_HREF: Final = "/static/status.css?v=" + hashlib.sha256(_ASSETS["status.css"][0]).hexdigest()[:12]


class StatusSource(Protocol):
    """What the page reads: the read API's interface (``aggregator.service.PipelineLike``)."""

    def nodes(self) -> list[dict[str, Any]]: ...

    def node(self, name: str) -> dict[str, Any] | None: ...

    def decisions_since(self, since: float, limit: int) -> list[dict[str, Any]]: ...


class OtherShards(Protocol):
    """The other shards' nodes, for a sharded replica's status page (``FleetViews`` in
    aggregator/shard/fanout.py)."""

    @property
    def shard(self) -> int:
        """This replica's shard."""
        ...

    def page_url(self, shard: int) -> str:
        """Where a shard's status page is (its first replica's URL)."""
        ...

    async def other_nodes(self, authorization: str | None) -> ShardNodes:
        """Every other shard's node rows, asked with the caller's ``Authorization``."""
        ...


# States a node keeps when it moves between shards: its decision travels with it (the new owner
# restores it from the Node), so the shard that holds one is right about the node.
_CARRIED: Final = frozenset({"quarantined", "probation"})


def one_row_per_node(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shards' node rows with each node once, in the order first seen.

    A node moving between shards (its pool relabelled) is held by both for a moment: the old
    owner keeps a decision until the Node shows it, the new one takes the node's reports. The row
    kept is the one with a quarantine or probation (the decision being handed over is what the
    node is), else the one with the newest report: the old owner, no longer sent the node's
    reports, soon calls it silent and suspect, which is not news about the node. The kept row
    names the other shards in ``also_on``, so neither the counts nor the list show the node
    twice. Rows are copied only where two meet."""
    kept: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = str(row.get("node", ""))
        have = kept.get(name)
        if have is None:
            kept[name] = row
            continue
        also = [*have.get("also_on", []), *row.get("also_on", [])]
        winner, other = (row, have) if _move_rank(row) < _move_rank(have) else (have, row)
        if other.get("shard") is not None:
            also.append(other["shard"])
        kept[name] = {**winner, "also_on": sorted(set(also))}
    return list(kept.values())


def _move_rank(row: Mapping[str, Any]) -> tuple[bool, float]:
    return (row.get("state") not in _CARRIED, -float(row.get("last_received") or 0.0))


@dataclass(frozen=True)
class ShardNodes:
    rows: list[dict[str, Any]]  # each with its "shard"
    answered: list[int]  # the shards that answered (this one not included)
    missing: list[tuple[int, str]]  # (shard, why) of those that did not


def h(value: object) -> str:
    """Escaped for HTML text and attribute values alike, bidirectional controls shown as code
    points (``_BIDI``)."""
    return escape(str(value).translate(_BIDI), quote=True)


def _node_href(name: str) -> str:
    return "/nodes/" + quote(name, safe="")


def _node_link(name: str) -> str:
    return f'<a href="{h(_node_href(name))}">{h(name)}</a>'


def _badge(state: str) -> str:
    return f'<span class="st st-{h(state)}">{h(state)}</span>'


def _href(path: str, **params: object) -> str:
    q = urlencode({k: v for k, v in params.items() if v not in (None, "") and (k, v) != ("page", 1)})
    return h(f"{path}?{q}" if q else path)


def _num(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


# -- the fleet at a glance ------------------------------------------------------------------------


def _node_table(
    nodes: Sequence[Mapping[str, Any]], now: float, link: Callable[[Mapping[str, Any]], str] | None = None
) -> str:
    """Nodes as the node list shows them: state, since, place, last report, why. ``link``: the
    node's link (default: its page here)."""
    rows = []
    for n in nodes:
        flags = "".join(_badge(x) + " " for x in _flags(n))
        name = link(n) if link is not None else _node_link(n["node"])
        rows.append(
            f'<tr class="{"out" if n["state"] in ("quarantined", "probation") else ""}">'
            f"<td>{name}</td><td>{flags}</td><td>{h(iso(n.get('since')))}</td>"
            f"<td>{h(n.get('pool') or '-')}</td><td>{h(n.get('rack') or '-')}</td>"
            f"<td>{h(duration(now - n['last_received']))} ago</td>"
            f"<td class='why'>{h('; '.join(n.get('reasons', []))[:300])}</td></tr>"
        )
    return (
        "<table><thead><tr><th>node</th><th>state</th><th>since</th><th>pool</th><th>rack</th>"
        f"<th>last report</th><th>why</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _flags(n: Mapping[str, Any]) -> list[str]:
    out = [n["state"]]
    if n.get("silent"):
        out.append("silent")
    if n.get("held"):
        out.append("held")
    return out


def fleet_summary(nodes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of every state (and silent, held) fleet-wide, per pool and per rack; the racks
    with the most nodes out come first. One pass over the nodes into one counter per rack (at
    7,500 nodes this is most of the glance's cost), then pools and totals from the racks."""
    per_rack: dict[tuple[str, str], Counter[str]] = {}
    for n in nodes:
        key = (n.get("pool") or "-", n.get("rack") or "-")
        c = per_rack.get(key)
        if c is None:
            c = per_rack[key] = Counter()
        c["nodes"] += 1
        c[n["state"]] += 1
        if n.get("silent"):
            c["silent"] += 1
        if n.get("held"):
            c["held"] += 1
    pools: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for (pool, _rack), c in per_rack.items():
        pools.setdefault(pool, Counter()).update(c)
        totals.update(c)

    def row(c: Counter[str]) -> dict[str, int]:
        return {k: c[k] for k in ("nodes", *COUNTED)}

    def trouble(c: Counter[str]) -> int:
        return c["quarantined"] + c["probation"] + c["suspect"]

    return {
        "totals": row(totals),
        "pools": [{"pool": p, **row(c)} for p, c in sorted(pools.items())],
        "racks": [
            {"pool": p, "rack": r, **row(c)}
            for (p, r), c in sorted(per_rack.items(), key=lambda kv: (-trouble(kv[1]), kv[0]))
        ],
    }


def active_systemic(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The systemic events still going on: a domain's latest "started" with no "ended" after it,
    and the shared-switch problems the probes point at now (state "active")."""
    now: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        key = (str(e.get("domain_kind")), str(e.get("domain")))
        if e.get("state") == "ended":
            now.pop(key, None)
        else:
            now[key] = dict(e)
    return list(now.values())


# -- the node list --------------------------------------------------------------------------------


class NodeFilter:
    """The node list's query: ``state`` (a state, ``silent``, ``held`` or ``out``), ``pool``,
    ``rack``, ``q`` (in the name or a reason, any case), ``page`` and ``per`` (page size)."""

    def __init__(self, query: Mapping[str, str]) -> None:
        self.state = query.get("state", "")
        self.pool = query.get("pool", "")
        self.rack = query.get("rack", "")
        self.q = query.get("q", "").strip()
        self.page = _int(query.get("page"), 1, 1, 1_000_000)
        self.per = _int(query.get("per"), PER_PAGE, 1, MAX_PER_PAGE)

    def matches(self, n: Mapping[str, Any]) -> bool:
        if self.state:
            if self.state == "out":
                if n["state"] not in ("quarantined", "probation"):
                    return False
            elif self.state not in _flags(n):
                return False
        if self.pool and (n.get("pool") or "-") != self.pool:
            return False
        if self.rack and (n.get("rack") or "-") != self.rack:
            return False
        if self.q:
            needle = self.q.lower()
            hay = [n["node"], *n.get("reasons", ())]
            if not any(needle in str(s).lower() for s in hay):
                return False
        return True

    def params(self) -> dict[str, str | int]:
        return {"state": self.state, "pool": self.pool, "rack": self.rack, "q": self.q, "per": self.per}


def _int(raw: str | None, default: int, lo: int, hi: int) -> int:
    try:
        return min(max(int(raw), lo), hi) if raw is not None else default
    except ValueError:
        return default


# -- the view ---------------------------------------------------------------------------------------


class StatusView:
    """Renders each page from ``source``; every method returns the page's HTML (or JSON data)."""

    def __init__(
        self,
        source: StatusSource,
        config: Config,
        clock: Clock,
        *,
        nodes_ttl_s: float = NODES_TTL_S,
        banner: str | None = None,
        others: OtherShards | None = None,
        leading: Callable[[], bool] | None = None,
    ) -> None:
        self.source = source
        self.banner = banner  # shown atop every page: what this view is of, when not a live fleet
        # Whether this replica holds the remediation Lease now (None: remediation off, no Lease).
        self.leading = leading
        self.config = config
        self.clock = clock
        self.nodes_ttl_s = nodes_ttl_s
        self._nodes: tuple[float, list[dict[str, Any]]] | None = None
        self._others = others
        # The other shards' nodes by who asked (a digest of the Authorization header): what one
        # caller's credentials fetched is never shown to another, a refusal is not either. At
        # most _OTHERS_KEPT callers' answers are kept, each for ``nodes_ttl_s``, and one fetch
        # is in flight per caller however many of its pages load at once.
        self._other_nodes: dict[bytes, tuple[float, ShardNodes]] = {}
        self._fetching: dict[bytes, asyncio.Future[ShardNodes]] = {}
        # What the page being rendered shows of them: set by ``refresh`` (or ``local``) right
        # before each render, which follows it with no await in between.
        self.current: ShardNodes | None = None

    def nodes(self) -> list[dict[str, Any]]:
        """The fleet's node summaries, read at most once every ``nodes_ttl_s`` however many
        browsers refresh: at 7,500 nodes the read is most of a page's cost (bench/status_page.py).
        With sharding, this shard's rows and the other shards' (as ``refresh`` last got them),
        each with its ``shard``, a node two shards hold at once listed once
        (``one_row_per_node``)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes[0] >= self.nodes_ttl_s:
            local = self.source.nodes()
            if self._others is not None:
                mine = self._others.shard
                local = [{**n, "shard": mine} for n in local]
            self._nodes = (now, local)
        if self.current is None:
            return self._nodes[1]
        return one_row_per_node([*self._nodes[1], *self.current.rows])

    def local(self) -> None:
        """The page about to be rendered shows this shard alone."""
        self.current = None

    async def refresh(self, authorization: str | None) -> None:
        """With sharding, the other shards' nodes for the page about to be rendered, asked with
        the caller's credentials at most once every ``nodes_ttl_s`` per caller: the pages that
        list nodes then show the whole fleet."""
        self.current = None
        if self._others is None:
            return
        key = hashlib.sha256((authorization or "").encode("utf-8", "surrogatepass")).digest()
        kept = self._other_nodes.get(key)
        if kept is not None and time.monotonic() - kept[0] < self.nodes_ttl_s:
            got = kept[1]
        elif (pending := self._fetching.get(key)) is not None:
            got = await asyncio.shield(pending)
        else:
            pending = asyncio.ensure_future(self._others.other_nodes(authorization))
            self._fetching[key] = pending
            try:
                got = await asyncio.shield(pending)
            finally:
                self._fetching.pop(key, None)
            if len(self._other_nodes) >= _OTHERS_KEPT:
                del self._other_nodes[min(self._other_nodes, key=lambda k: self._other_nodes[k][0])]
            self._other_nodes[key] = (time.monotonic(), got)
        self.current = got

    def _fleet_note(self) -> str:
        """What the node counts and lists cover, on a sharded replica."""
        if self._others is None or self.current is None:
            return ""
        got = self.current
        shards = sorted([self._others.shard, *got.answered])
        note = "nodes of shards " + ", ".join(map(str, shards))
        if got.missing:
            gone = "; ".join(f"shard {i} did not answer ({why[:120]})" for i, why in got.missing)
            note += f"; {gone}: its nodes are missing here"
        return note

    def _row_link(self, n: Mapping[str, Any]) -> str:
        """A node's link: its page here, or on its own shard's status page; a node listed by two
        shards at once (moving between them) says so."""
        shard = n.get("shard")
        also = ", ".join(str(int(s)) for s in n.get("also_on") or ())
        moving = f"moving, also on shard {also}" if also else ""
        if self._others is None or shard is None or shard == self._others.shard:
            link = _node_link(n["node"])
            return f'{link} <span class="muted">({moving})</span>' if moving else link
        href = self._others.page_url(int(shard)) + _node_href(n["node"])
        where = f"shard {int(shard)}; {moving}" if moving else f"shard {int(shard)}"
        return f'<a href="{h(href)}">{h(n["node"])}</a> <span class="muted">({where})</span>'

    def elsewhere(self, name: str) -> Mapping[str, Any] | None:
        """The other shards' row of ``name`` (as ``refresh`` got them for this page), if any."""
        if self.current is None:
            return None
        return next((n for n in self.current.rows if n.get("node") == name), None)

    # -- data ---------------------------------------------------------------------------------

    def _optional(self, name: str, *args: object) -> Any:
        call = getattr(self.source, name, None)
        return call(*args) if callable(call) else None

    def breaker(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self._optional("breaker")
        return found

    def systemic(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] | None = self._optional("systemic_events")
        return found or []

    def summary(self) -> dict[str, Any]:
        now = self.clock.time()
        nodes = self.nodes()
        systemic = self.systemic()
        out = {
            "time": now,
            "time_iso": iso(now),
            "remediation": self.config.remediation.mode,
            "breaker": self.breaker(),
            **fleet_summary(nodes),
            "systemic_active": active_systemic(systemic),
        }
        if self._others is not None and self.current is not None:
            got = self.current
            out["shards"] = {
                "this": self._others.shard,
                "answered": sorted([self._others.shard, *got.answered]),
                "missing": [{"shard": i, "error": why} for i, why in got.missing],
            }
        return out

    def story(self, name: str, found: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """One node (``found``: as the source gave it already): its state, why (every reason with
        its evidence), what next, the runbook."""
        n = self.source.node(name) if found is None else found
        if n is None:
            return None
        cfg = self.config
        reasons = n.get("reasons", [])
        out = n["state"] in ("quarantined", "probation")
        return {
            "node": n["node"],
            "state": n["state"],
            "since": n.get("since"),
            "since_iso": iso(n.get("since")),
            "held": n.get("held", False),
            "lemon": n.get("lemon", False),
            "silent": n.get("silent", False),
            "placement": n.get("placement", {}),
            "last_received_iso": iso(n.get("last_received")),
            "reasons": reasons,
            "next": next_step(
                n["state"],
                n.get("since"),
                held=n.get("held", False),
                lemon=n.get("lemon", False),
                probation_seconds=cfg.health.probation_seconds,
                clear_for_seconds=cfg.health.clear_for_seconds,
            ),
            "override": (
                override_note(cfg.remediation.taint_key, cfg.remediation.override_cooldown_seconds)
                if out and cfg.remediation.mode != "off"
                else None
            ),
            "runbook_url": runbook_url(
                cfg.notify.runbook_base_url,
                held=n.get("held", False),
                lemon=n.get("lemon", False),
                evidence=(r.get("evidence", {}) for r in reasons),
            ),
            # The runbook under notify.runbook_base_url (an internal copy, where the cluster has
            # no way out), beside a rule's own reference that ``runbook_url`` prefers.
            "local_runbook_url": runbook_url(
                cfg.notify.runbook_base_url, held=n.get("held", False), lemon=n.get("lemon", False)
            ),
        }

    # -- pages --------------------------------------------------------------------------------

    def page(self, title: str, body: str, *, refresh: int | None, started: float) -> str:
        request = _REQUEST.get()
        meta = note = ""
        if refresh and request is not None and request.query.get("refresh") == "off":
            back = request.rel_url.without_query_params("refresh")
            note = (
                f'<p class="muted refresh">Not refreshing. '
                f'<a href="{h(back)}">Refresh every {refresh} s</a></p>\n'
            )
        elif refresh:
            meta = f'<meta http-equiv="refresh" content="{refresh}">\n'
            if request is not None:
                off = request.rel_url.update_query(refresh="off")
                note = (
                    f'<p class="muted refresh">This page refreshes every {refresh} s. '
                    f'<a href="{h(off)}">Stop refreshing</a></p>\n'
                )
        return _PAGE.substitute(
            css=_CSS_HREF,
            title=h(title),
            body=body,
            refresh=meta,
            banner=self._banner() + note,
            now=h(iso(self.clock.time())),
            render_ms=f"{(time.perf_counter() - started) * 1000:.1f}",
        )

    def _banner(self) -> str:
        text = "; ".join(t for t in (self.banner, self._role(), self._fleet_note()) if t)
        return f'<p class="banner">{h(text)}</p>\n' if text else ""

    def _role(self) -> str:
        """Which replica this is, where several run (remediation's leader election): on-call in a
        fail-over wants to know whether the page is the one that writes to the nodes."""
        if self.leading is None:
            return ""
        if self.leading():
            return "this replica leads: it writes the taints"
        return "this replica is a standby: it decides as the leader does, and writes nothing to the nodes"

    def glance(self) -> str:
        started = time.perf_counter()
        s = self.summary()
        t = s["totals"]
        cards = [
            f'<div class="card"><a href="/nodes"><span class="n">{t["nodes"]}</span>nodes</a></div>',
            *(
                f'<div class="card {k}"><a href="{_href("/nodes", state=k)}">'
                f'<span class="n">{t[k]}</span>{"held by a limit" if k == "held" else k}</a></div>'
                for k in COUNTED
            ),
            self._breaker_card(s["breaker"]),
        ]
        body = [f'<div class="cards">{"".join(cards)}</div>']
        if not t["nodes"]:
            body.append(
                '<p class="banner">No node has reported yet: nothing below is about any node. '
                "Check that the agents run (the DaemonSet), reach this aggregator and are accepted "
                "(their tokens; the aggregator's log and gpuwarden_ingest_* metrics say why not).</p>"
            )
        active = s["systemic_active"]
        if active:
            body.append('<h2>Systemic events now <a class="muted" href="/systemic">(all)</a></h2>')
            body += [_systemic_line(e) for e in active[:_GLANCE_SYSTEMIC]]
            if len(active) > _GLANCE_SYSTEMIC:
                body.append(
                    f'<p class="muted">and {len(active) - _GLANCE_SYSTEMIC} more: '
                    '<a href="/systemic">the systemic events</a>.</p>'
                )
        body.append(self._quarantined_now())
        body.append("<h2>Pools</h2>" + _count_table(s["pools"], ("pool",)))
        troubled = [r for r in s["racks"] if r["nodes"] > r["healthy"] or r["silent"]]
        calm = len(s["racks"]) - len(troubled)
        body.append("<h2>Racks with nodes not healthy</h2>")
        every = "<p>Every rack is healthy.</p>" if s["racks"] else "<p>No rack has reported.</p>"
        body.append(_count_table(troubled[:200], ("pool", "rack")) if troubled else every)
        if len(troubled) > 200:
            body.append(f'<p class="muted">and {len(troubled) - 200} more racks: see the node list.</p>')
        body.append(f'<p class="muted">{calm} racks have every node healthy.</p>')
        recent = self._recent_decisions(10)
        body.append('<h2>Latest decisions <a class="muted" href="/decisions">(all)</a></h2>')
        body.append(_decision_table(recent, with_node=True, mode=self.config.remediation.mode))
        return self.page("Fleet", "\n".join(body), refresh=_REFRESH_S["glance"], started=started)

    def _quarantined_now(self) -> str:
        """The nodes out of scheduling now, newest first and linked: what on-call opens the page
        for, which the latest decisions alone would push off the page in a busy minute."""
        out = [n for n in self.nodes() if n["state"] == "quarantined"]
        every = _href("/nodes", state="quarantined")
        title = f'<h2>Quarantined now <a class="muted" href="{every}">(all)</a></h2>'
        if not out:
            return title + (
                "<p>No node is quarantined.</p>" if self.nodes() else "<p>No node has reported.</p>"
            )
        out.sort(key=lambda n: (-(n.get("since") or 0.0), n["node"]))
        more = (
            f'<p class="muted">and {len(out) - _GLANCE_QUARANTINED} more: '
            f'<a href="{every}">the node list</a>.</p>'
            if len(out) > _GLANCE_QUARANTINED
            else ""
        )
        return title + _node_table(out[:_GLANCE_QUARANTINED], self.clock.time(), self._row_link) + more

    def _breaker_card(self, b: Mapping[str, Any] | None) -> str:
        mode = self.config.remediation.mode
        if b is None:
            return f'<div class="card"><span class="n">-</span>breaker (remediation {h(mode)})</div>'
        if b.get("open"):
            return (
                '<div class="card breaker-open"><span class="n">OPEN</span>breaker since '
                f"{h(iso(b.get('since')))}: {h(b.get('reason') or '')}</div>"
            )
        reset = f", last reset {h(iso(b['reset_at']))} by {h(b.get('reset_by'))}" if b.get("reset_at") else ""
        return (
            '<div class="card breaker-closed"><span class="n">closed</span>'
            f"breaker (remediation {h(mode)}){reset}</div>"
        )

    def node_list(self, query: Mapping[str, str]) -> str:
        started = time.perf_counter()
        f = NodeFilter(query)
        nodes = self.nodes()
        pools = sorted({n.get("pool") or "-" for n in nodes})
        hits = [n for n in nodes if f.matches(n)]
        hits.sort(key=lambda n: (_TROUBLE.get(n["state"], 9), n["node"]))
        pages = max(1, math.ceil(len(hits) / f.per))
        page = min(f.page, pages)
        shown = hits[(page - 1) * f.per : page * f.per]
        now = self.clock.time()
        form = [
            '<form class="filter" method="get" action="/nodes">',
            _select("state", f.state, [("", "any state"), *((s, s) for s in (*COUNTED, "out"))]),
            _select("pool", f.pool, [("", "any pool"), *((p, p) for p in pools)]),
            f'<label>rack<input name="rack" value="{h(f.rack)}" size="10"></label>',
            f'<label>search name or reason<input name="q" value="{h(f.q)}" size="24"></label>',
            f'<input type="hidden" name="per" value="{f.per}">',
            '<button type="submit">Filter</button> <a href="/nodes">clear</a></form>',
        ]
        first = (page - 1) * f.per + 1 if shown else 0
        count = f"<p>{first}-{first + len(shown) - 1 if shown else 0} of {len(hits)} nodes"
        count += f" (of {len(nodes)} in the fleet)</p>" if len(hits) != len(nodes) else "</p>"
        table = _node_table(shown, now, self._row_link) if shown else "<p>No node matches.</p>"
        pager = _pager("/nodes", f.params(), page, pages)
        body = "".join(form) + count + pager + table + pager
        return self.page("Nodes", body, refresh=None, started=started)  # a form: never reloaded

    def node_page(self, name: str, found: Mapping[str, Any] | None = None) -> str | None:
        """The node's page (``found``: the node as the source gave it already); None if unknown."""
        started = time.perf_counter()
        n = self.source.node(name) if found is None else found
        st = self.story(name, n) if n is not None else None
        if st is None or n is None:
            return None
        pl = st["placement"]
        flags = " ".join(_badge(x) for x in _flags({**n, "state": st["state"]}))
        lemon = " <strong>lemon</strong> (keeps coming back)" if st["lemon"] else ""
        where = ", ".join(f"{k} {h(v)}" for k, v in pl.items() if v)
        body = [
            f"<p>{flags} since <span class='mono'>{h(st['since_iso'])}</span>{lemon}</p>",
            f"<p>{where}; last report received <span class='mono'>{h(st['last_received_iso'])}</span></p>",
            '<div class="next">',
            f"<p><strong>Next:</strong> {h(st['next'])}</p>",
        ]
        mode = self.config.remediation.mode
        if mode != "enforce" and st["state"] in ("quarantined", "probation"):
            body.append(
                f"<p><strong>Not applied:</strong> remediation is {h(mode)}, so this aggregator writes no "
                "taint and the scheduler still places work on the node (unless a taint written before "
                "a change of mode is still on it).</p>"
            )
        if st["override"]:
            body.append(f"<p><strong>By hand:</strong> {h(st['override'])}</p>")
        if st["state"] != "healthy":  # nothing to do for a node in service
            links = [st["runbook_url"], st["local_runbook_url"]]
            body.append(
                "<p><strong>Runbook:</strong> "
                + " · ".join(f'<a href="{h(u)}">{h(u)}</a>' for u in dict.fromkeys(links))
                + "</p>"
            )
        body.append("</div>")
        body.append("<h2>Why</h2>")
        if not st["reasons"]:
            body.append("<p>No reason on record: the node is healthy.</p>")
        for r in st["reasons"]:
            ev = r.get("evidence", {})
            rows = "".join(
                f"<tr><td>{h(k)}</td><td class='mono'>{h(evidence_value(k, v))}</td></tr>"
                for k, v in ev.items()
            )
            who = r.get("rule") or r.get("detector")
            body.append(
                f'<div class="reason"><div class="summary">{h(r.get("summary", ""))}</div>'
                f'<div class="muted">{h(r.get("severity", ""))} · {h(who)} ({h(r.get("detector", ""))})</div>'
                f'<table class="evidence">{rows}</table></div>'
            )
        body.append("<h2>Recent evidence</h2>" + _sparklines(n.get("history", [])))
        decisions = list(reversed(n.get("decisions", [])))
        mode = self.config.remediation.mode
        body.append("<h2>State history</h2>" + _decision_table(decisions, with_node=False, mode=mode))
        body.append("<h2>Latest reports</h2>" + _report_table(list(reversed(n.get("history", [])))[:10]))
        return self.page(f"Node {name}", "\n".join(body), refresh=_REFRESH_S["node"], started=started)

    def _recent_decisions(self, count: int, node: str = "") -> list[dict[str, Any]]:
        """The newest ``count`` decisions (about ``node``), newest first."""
        fast: list[dict[str, Any]] | None = self._optional("recent_decisions", count, node or None)
        if fast is not None:
            return fast
        since = self.clock.time() - DECISION_WINDOW_S
        found = self.source.decisions_since(since, 10_000)
        if node:
            found = [d for d in found if d.get("node") == node or d.get("peer") == node]
        return list(reversed(found[-count:]))

    def decision_feed(self, query: Mapping[str, str]) -> str:
        started = time.perf_counter()
        node = query.get("node", "").strip()
        page = _int(query.get("page"), 1, 1, 100)
        # One more than the page needs: whether there is a next page.
        found = self._recent_decisions(page * PER_PAGE + 1, node)
        shown = found[(page - 1) * PER_PAGE : page * PER_PAGE]
        more = len(found) > page * PER_PAGE
        form = (
            '<form class="filter" method="get" action="/decisions">'
            f'<label>node<input name="node" value="{h(node)}" size="24"></label>'
            '<button type="submit">Filter</button> <a href="/decisions">clear</a></form>'
        )
        params = {"node": node}
        prev = (
            f'<a href="{_href("/decisions", **params, page=page - 1)}">&lsaquo; newer</a>' if page > 1 else ""
        )
        nxt = f'<a href="{_href("/decisions", **params, page=page + 1)}">older &rsaquo;</a>' if more else ""
        pager = f'<p class="pager">{prev}<span>page {page}</span>{nxt}</p>'
        body = (
            form
            + "<p>The decisions the aggregator holds (its last 10,000), newest first.</p>"
            + pager
            + _decision_table(shown, with_node=True, mode=self.config.remediation.mode)
            + pager
        )
        return self.page("Decisions", body, refresh=None, started=started)  # a form: never reloaded

    def systemic_page(self) -> str:
        started = time.perf_counter()
        events = list(reversed(self.systemic()))
        body = "".join(_systemic_line(e) for e in events) or "<p>No systemic event on record.</p>"
        return self.page("Systemic events", body, refresh=_REFRESH_S["feed"], started=started)

    def links_page(self, query: Mapping[str, str]) -> str:
        started = time.perf_counter()
        rows: list[dict[str, Any]] = self._optional("link_matrix") or []
        kinds = sorted({r["kind"] for r in rows})
        kind = query.get("kind") or (kinds[0] if kinds else "")
        pool_of = {n["node"]: n.get("pool") or "-" for n in self.nodes()}
        pools = sorted({pool_of.get(r["a"], "-") for r in rows})
        pool = query.get("pool") or (pools[0] if pools else "")
        mine = [r for r in rows if r["kind"] == kind and pool_of.get(r["a"], "-") == pool]
        form = (
            '<form class="filter" method="get" action="/links">'
            + _select("pool", pool, [(p, p) for p in pools])
            + _select("kind", kind, [(k, k) for k in kinds])
            + '<button type="submit">Show</button></form>'
        )
        body = [form]
        if not mine:
            body.append("<p>No pair probe results yet (probes are off, or none has run in this pool).</p>")
        else:
            body.append(self._matrix(mine))
        bad = [r for r in rows if r.get("state", "healthy") != "healthy"]
        body.append("<h2>Links not healthy</h2>")
        if bad:
            body.append(
                "<table><thead><tr><th>pair</th><th>kind</th><th>state</th><th class='num'>bus GB/s</th>"
                "<th>probed</th></tr></thead><tbody>"
                + "".join(
                    f"<tr><td>{_node_link(r['a'])} &ndash; {_node_link(r['b'])}</td><td>{h(r['kind'])}</td>"
                    f"<td>{_badge(r['state'])}</td>"
                    f"<td class='num'>{r['busbw_bytes_per_second'] / 1e9:.1f}</td>"
                    f"<td>{h(iso(r['time']))}</td></tr>"
                    for r in bad
                )
                + "</tbody></table>"
            )
        elif rows:
            body.append("<p>Every probed link is healthy.</p>")
        else:
            body.append("<p>No link has been probed.</p>")
        return self.page("Links", "\n".join(body), refresh=None, started=started)  # a form: never reloaded

    def _matrix(self, rows: Sequence[Mapping[str, Any]]) -> str:
        bws = sorted(r["busbw_bytes_per_second"] for r in rows)
        typical = bws[len(bws) // 2] or 1.0
        # The slowest pairs' nodes first: at 7,500 nodes the whole matrix would not fit a screen.
        order: list[str] = []
        for r in sorted(rows, key=lambda r: r["busbw_bytes_per_second"]):
            for end in (r["a"], r["b"]):
                if end not in order and len(order) < MATRIX_MAX_NODES:
                    order.append(end)
        chosen = sorted(order)
        index = {name: i for i, name in enumerate(chosen)}
        cells: dict[tuple[int, int], tuple[float, str]] = {}
        for r in rows:
            i, j = index.get(r["a"]), index.get(r["b"])
            if i is None or j is None:
                continue
            ratio = r["busbw_bytes_per_second"] / typical
            cells[(min(i, j), max(i, j))] = (
                ratio,
                f"{r['a']} - {r['b']}: {r['busbw_bytes_per_second'] / 1e9:.1f} GB/s "
                f"({ratio:.0%} of typical), {r.get('state', 'healthy')}, {iso(r['time'])}",
            )
        nodes = {r["a"] for r in rows} | {r["b"] for r in rows}
        note = (
            f"<p class='muted'>{len(chosen)} of {len(nodes)} nodes: those in the slowest pairs.</p>"
            if len(nodes) > len(chosen)
            else ""
        )
        edges = (0.0, *svg.BANDS)
        legend = (
            "".join(f'<span><i class="r{k}"></i>≥ {edge:.0%}</span>' for k, edge in enumerate(edges))
            + '<span><i class="none"></i>not probed</span>'
        )
        return (
            f"<p>Bus bandwidth of each probed pair against the pool's typical pair "
            f"({typical / 1e9:.1f} GB/s); hover a cell for its figures.</p>{note}"
            f'<p class="legend">{legend}</p>{svg.heatmap(chosen, cells)}'
        )

    def probes_page(self) -> str:
        started = time.perf_counter()
        cov: dict[str, Any] | None = self._optional("probe_coverage", self.clock.time())
        if cov is None:
            body = "<p>Active probes are off on this aggregator (no probe key, or probes disabled).</p>"
            return self.page("Probe coverage", body, refresh=None, started=started)
        ratios = cov["pool_ratios"]
        rows = [
            f"<p>Bound: every pair in a group tested within {h(duration(cov['bound_seconds']))}; "
            f"{cov['nodes_overdue']} nodes untested for longer.</p>",
            "<table><thead><tr><th>pool</th><th class='num'>pairs tested</th><th></th></tr></thead><tbody>",
            *(
                f"<tr><td>{h(p)}</td><td class='num'>{r:.0%}</td>"
                f"<td>{svg.stacked_bar([('healthy', round(r * 1000)), ('suspect', 1000 - round(r * 1000))])}"
                "</td></tr>"
                for p, r in ratios.items()
            ),
            "</tbody></table><h2>Groups</h2><table><thead><tr><th>pool</th><th>group</th>"
            "<th class='num'>nodes</th><th class='num'>pairs</th><th class='num'>tested</th>"
            "</tr></thead><tbody>",
            *(
                f"<tr><td>{h(g['pool'])}</td><td>{h(g['group'])}</td><td class='num'>{g['nodes']}</td>"
                f"<td class='num'>{g['pairs']}</td><td class='num'>{g['pairs_tested']}</td></tr>"
                for g in cov["groups"][:500]
            ),
            "</tbody></table>",
        ]
        if cov.get("overdue"):
            rows.append("<h2>Nodes overdue</h2>")
            rows += [
                f"<p class='line'>{_node_link(n)} untested for {h(duration(s))}</p>"
                for n, s in cov["overdue"]
            ]
        return self.page("Probe coverage", "".join(rows), refresh=_REFRESH_S["feed"], started=started)


# -- pieces -----------------------------------------------------------------------------------------


def _select(name: str, chosen: str, options: Iterable[tuple[str, str]]) -> str:
    opts = "".join(
        f'<option value="{h(v)}"{" selected" if v == chosen else ""}>{h(label)}</option>'
        for v, label in options
    )
    return f'<label>{h(name)}<select name="{h(name)}">{opts}</select></label>'


def _pager(path: str, params: Mapping[str, object], page: int, pages: int) -> str:
    if pages <= 1:
        return ""
    prev = f'<a href="{_href(path, **params, page=page - 1)}">&lsaquo; previous</a>' if page > 1 else ""
    nxt = f'<a href="{_href(path, **params, page=page + 1)}">next &rsaquo;</a>' if page < pages else ""
    return f'<p class="pager">{prev}<span>page {page} of {pages}</span>{nxt}</p>'


def _count_table(rows: Sequence[Mapping[str, Any]], keys: tuple[str, ...]) -> str:
    head = "".join(f"<th>{k}</th>" for k in keys) + "<th class='num'>nodes</th>"
    head += "".join(f"<th class='num'>{'held' if k == 'held' else k}</th>" for k in COUNTED) + "<th></th>"
    out = [f"<table><thead><tr>{head}</tr></thead><tbody>"]
    for r in rows:
        where = {k: r[k] for k in keys}
        cells = "".join(f"<td>{h(r[k])}</td>" for k in keys)
        cells += f"<td class='num'><a href=\"{_href('/nodes', **where)}\">{r['nodes']}</a></td>"
        for k in COUNTED:
            n = r[k]
            cells += (
                f"<td class='num'><a href=\"{_href('/nodes', state=k, **where)}\">{n}</a></td>"
                if n
                else "<td class='num muted'>0</td>"
            )
        cells += f"<td>{svg.stacked_bar([(s, r[s]) for s in STATES])}</td>"
        out.append(f"<tr>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _systemic_line(e: Mapping[str, Any]) -> str:
    nodes = list(e.get("silent_nodes") or e.get("nodes") or [])
    shown = ", ".join(nodes[:12]) + (f" and {len(nodes) - 12} more" if len(nodes) > 12 else "")
    return (
        # The summary names its domain ("rack rack-003: 6 of 8 nodes stopped reporting ...").
        f"<p class='line'>{h(iso(e.get('time')))} {_badge(str(e.get('state')))} {h(e.get('summary'))}"
        f"{' (' + h(shown) + ')' if shown else ''}</p>"
    )


def _decision_table(decisions: Sequence[Mapping[str, Any]], *, with_node: bool, mode: str) -> str:
    """``mode``: ``remediation.mode`` now; a taint or untaint a decision records is applied only
    in ``enforce``, and the table says what the mode is otherwise (a decision does not record the
    mode it was made in: one from before a change of mode says the mode of now)."""
    if not decisions:
        return "<p>No decision on record.</p>"
    unapplied = "" if mode == "enforce" else f" (remediation {mode} now: not applied)"
    head = (
        "<th>time</th>"
        + ("<th>node</th>" if with_node else "")
        + "<th>change</th><th>action</th><th>why</th>"
    )
    rows = []
    for d in decisions:
        subject = _node_link(d["node"]) + (f" &ndash; {_node_link(d['peer'])}" if d.get("peer") else "")
        why = "; ".join(r.get("summary", "") for r in d.get("reasons", []))
        rows.append(
            f"<tr><td class='mono'>{h(iso(d['time']))}</td>"
            + (f"<td>{subject}</td>" if with_node else "")
            + f"<td>{h(d['previous'])} → {_badge(d['state'])}</td>"
            f"<td>{h(d['action'] + (unapplied if d['action'] in ('taint', 'untaint') else ''))}</td>"
            f"<td class='why'>{h(why[:400])}</td></tr>"
        )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


# (history key, caption, unit) of each sparkline on the node page.
_SPARKS: Final = (
    ("temp_max_c", "hottest GPU", "°C"),
    ("power_w", "power, all GPUs", "W"),
    ("ecc_dbe", "uncorrectable ECC errors", ""),
    ("gpus", "GPUs reporting", ""),
    ("errors", "collector errors", ""),
)


def _sparklines(history: Sequence[Mapping[str, Any]]) -> str:
    if not history:
        return "<p>No report yet.</p>"
    figs = []
    for key, caption, unit in _SPARKS:
        values: list[float | None] = []
        for rec in history:
            v = rec.get(key)
            values.append(
                float(len(v)) if isinstance(v, list) else float(v) if isinstance(v, int | float) else None
            )
        known = [v for v in values if v is not None]
        if not known:
            continue
        label = (
            f"{caption}: now {_num(known[-1])}{unit}, range {_num(min(known))} to {_num(max(known))}{unit}"
        )
        figs.append(
            f"<figure>{svg.sparkline(values, label=label)}<figcaption>{h(label)}</figcaption></figure>"
        )
    first, last = iso(history[0].get("received")), iso(history[-1].get("received"))
    span = f"the last {len(history)} reports, {first} to {last}"
    return f'<p class="muted">{h(span)}</p><div class="sparks">{"".join(figs)}</div>'


def _report_table(history: Sequence[Mapping[str, Any]]) -> str:
    if not history:
        return "<p>No report yet.</p>"
    rows = "".join(
        f"<tr><td class='mono'>{h(iso(r.get('received')))}</td><td class='num'>{h(r.get('seq'))}</td>"
        f"<td class='mono'>{h(r.get('boot_id'))}</td><td class='num'>{h(r.get('gpus'))}</td>"
        f"<td class='num'>{h(r.get('nics'))}</td><td class='num'>{h(r.get('events'))}</td>"
        f"<td class='why'>{h('; '.join(r.get('errors') or [])[:200])}</td></tr>"
        for r in history
    )
    return (
        "<table><thead><tr><th>received</th><th class='num'>seq</th><th>boot</th><th class='num'>GPUs</th>"
        "<th class='num'>NICs</th><th class='num'>events</th><th>errors</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


# -- routes -----------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _html(text: str, status: int = 200) -> web.Response:
    resp = web.Response(text=text, status=status, content_type="text/html", charset="utf-8")
    resp.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = "no-store"
    return resp


def _guard(
    what: str,
    render: Callable[[web.Request], web.Response],
    before: Callable[[web.Request], Awaitable[None]] | None = None,
) -> Handler:
    """``render``, with a plain error page if it raises; ``before`` is awaited first (a sharded
    replica's pages that list nodes ask the other shards for theirs)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        _REQUEST.set(request)  # this request's task only: aiohttp runs each in its own
        try:
            if before is not None:
                await before(request)
            return render(request)
        except Exception:
            log.exception("status page failed", extra={"page": what})
            return _html(
                "<!doctype html><title>error</title><p>This page failed; see the aggregator's log.</p>", 500
            )

    return handler


# The HTML pages and their assets (the routes below): what ``server.status_page_public`` opens and
# where a browser is asked for the viewer token by HTTP Basic authentication.
_PAGE_ROOTS: Final = ("/nodes", "/decisions", "/systemic", "/links", "/probes", "/static")


def is_page(path: str) -> bool:
    """Whether ``path`` is one of the status page's HTML pages or assets (not its JSON routes)."""
    return path == "/" or any(path == r or path.startswith(r + "/") for r in _PAGE_ROOTS)


def status_routes(
    source: StatusSource,
    *,
    config: Config,
    clock: Clock,
    banner: str | None = None,
    others: OtherShards | None = None,
    leading: Callable[[], bool] | None = None,
) -> list[web.RouteDef]:
    """The status page's routes; add them to the aggregator's app (``app.router.add_routes``).
    ``banner``: a line atop every page saying what is shown (a replayed trace, as of when).
    ``others``: with sharding, the glance, the node list and the summary show every shard's
    nodes, and a node of another shard links to its page there. ``leading``: whether this replica
    holds the remediation Lease now (every page says which role it has)."""
    view = StatusView(source, config, clock, banner=banner, others=others, leading=leading)

    async def fleet(request: web.Request) -> None:
        await view.refresh(request.headers.get("Authorization"))

    async def local(request: web.Request) -> None:
        view.local()

    async def fleet_if_elsewhere(request: web.Request) -> None:
        # A node page of this shard needs nothing from the others; an unknown name may be theirs.
        # The node is looked up once, here, and rendered from what was found.
        found = source.node(request.match_info["node"])
        if found is None:
            await fleet(request)
        else:
            request[_FOUND] = found
            view.local()

    def elsewhere(name: str) -> web.Response | None:
        n = view.elsewhere(name)
        if n is None or others is None:
            return None
        shard = int(n.get("shard", -1))
        href = others.page_url(shard) + _node_href(name)
        body = view.page(
            f"Node {name}",
            f"<p>{_badge(str(n.get('state', '')))} {h(name)} is on shard {shard}: "
            f'<a href="{h(href)}">its page there</a>.</p>',
            refresh=None,
            started=time.perf_counter(),
        )
        return _html(body)

    def not_found(name: str) -> web.Response:
        body = view.page(
            "Unknown node",
            f"<p>No node named {h(name)}. <a href='/nodes'>All nodes</a></p>",
            refresh=None,
            started=time.perf_counter(),
        )
        return _html(body, 404)

    def node_page(request: web.Request) -> web.Response:
        name = request.match_info["node"]
        page = view.node_page(name, request.get(_FOUND))
        if page is not None:
            return _html(page)
        return elsewhere(name) or not_found(name)

    def story(request: web.Request) -> web.Response:
        name = request.match_info["node"]
        found = view.story(name)
        if found is None:
            return web.json_response(
                {"error": "unknown_node", "message": f"no node named {name[:253]!r}"}, status=404
            )
        return web.json_response(found)

    async def asset(request: web.Request) -> web.StreamResponse:
        found = _ASSETS.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        body, ctype = found
        resp = web.Response(body=body, content_type=ctype)
        resp.headers["Cache-Control"] = "max-age=3600"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        return resp

    return [
        web.get("/", _guard("glance", lambda r: _html(view.glance()), fleet)),
        web.get("/nodes", _guard("nodes", lambda r: _html(view.node_list(r.query)), fleet)),
        web.get("/nodes/{node}", _guard("node", node_page, fleet_if_elsewhere)),
        web.get("/decisions", _guard("decisions", lambda r: _html(view.decision_feed(r.query)), local)),
        web.get("/systemic", _guard("systemic", lambda r: _html(view.systemic_page()), local)),
        web.get("/links", _guard("links", lambda r: _html(view.links_page(r.query)), local)),
        web.get("/probes", _guard("probes", lambda r: _html(view.probes_page()), local)),
        web.get("/static/{name}", asset),
        web.get("/api/v1/summary", _guard("summary", lambda r: web.json_response(view.summary()), fleet)),
        web.get("/api/v1/nodes/{node}/story", _guard("story", story, local)),
    ]
