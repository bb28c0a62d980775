"""The probe routes agents call (protocol ``gpuwarden/probes/v1``, ``agent/probes/protocol.py``).

::

    GET  /v1/probes/assignments?node=<node>&address=<host:port>     -> AssignmentList
    PUT  /v1/probes/rendezvous/<id>   {"node": ..., "unique_id": "<hex>"}   -> {"status": "stored"}
    GET  /v1/probes/rendezvous/<id>?node=<node>                     -> {"unique_id": "<hex>"} | 404

Every call carries the agent's report token (``Authorization: Bearer``). A token is bound to one
node and acts only for it: ``node`` must be the token's node (403 ``node_mismatch``), so a node
can neither read another's assignments nor advertise an address for it. Polling is also what
tells the scheduler that a node's agent runs probes (``assignments_for`` records it).

Only the leader plans probes. A replica that is not the leader answers the poll with an empty
list and the usual ``poll_seconds``, so agents keep polling and find work once it leads, and
refuses the rendezvous (503 ``not_leader``): it knows no assignments.

The rendezvous hands the NCCL unique id of one pair probe from one end to the other. Only the two
ends of a probe the scheduler has in flight may write or read its entry; the first write wins
(the same value again is harmless, another is 409); an entry lives until the probe's deadline,
and the store never holds more entries than probes may be in flight. Bodies are bounded
(``rendezvous_max_bytes``) before they are parsed.

Refusals are JSON ``{"error": <code>, "message": <text>}`` as in ``aggregator/service.py``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
from aiohttp import web

from agent.clock import Clock
from agent.probes.protocol import ASSIGNMENTS_PATH, PROTOCOL, RENDEZVOUS_PATH, AssignmentList
from aggregator.auth import Authenticator, AuthError, AuthUnavailable, Identity, authorization, bearer_token
from aggregator.probes.scheduler import ProbeScheduler

log = logging.getLogger(__name__)

__all__ = ["Rendezvous", "probe_routes"]

# host:port, the host a DNS name or IPv4 address, or an IPv6 address in brackets.
_ADDRESS: Final = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})$")
_ADDRESS_MAX: Final = 261  # a 253-character name, ':' and a port
_HEX: Final = re.compile(r"^[0-9a-fA-F]+$")
_ID_MAX: Final = 128


class _Refuse(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def _json(status: int, payload: object) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


def _refused(exc: _Refuse) -> web.Response:
    resp = _json(exc.status, {"error": exc.code, "message": exc.message})
    if exc.status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="gpuwarden"'
    return resp


class _PutBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    node: str
    unique_id: str


_PUT_DECODER: Final = msgspec.json.Decoder(_PutBody)


@dataclass
class _Entry:
    nodes: tuple[str, ...]
    deadline: float
    unique_id: str


class Rendezvous:
    """Unique ids by assignment id, each kept until its probe's deadline; at most ``max_entries``."""

    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def expire(self, now: float) -> None:
        for key in [k for k, e in self._entries.items() if e.deadline <= now]:
            del self._entries[key]

    def get(self, probe_id: str, now: float) -> _Entry | None:
        entry = self._entries.get(probe_id)
        if entry is not None and entry.deadline <= now:
            del self._entries[probe_id]
            return None
        return entry

    def put(self, probe_id: str, entry: _Entry, now: float) -> bool:
        """False when full (after dropping the expired)."""
        if len(self._entries) >= self._max:
            self.expire(now)
            if len(self._entries) >= self._max:
                return False
        self._entries[probe_id] = entry
        return True


async def _identity(authenticator: Authenticator, request: web.Request) -> Identity:
    try:
        identity = await authenticator.authenticate(bearer_token(authorization(request.headers)))
    except AuthError as exc:
        raise _Refuse(exc.status, exc.reason, str(exc)) from exc
    except AuthUnavailable as exc:
        raise _Refuse(503, "auth_unavailable", f"the token cannot be checked now: {exc}") from exc
    if identity.node is None:
        raise _Refuse(403, "node_unbound", f"the token of {identity.subject} is not bound to a node")
    return identity


def _own_node(identity: Identity, claimed: str | None) -> str:
    if not claimed:
        raise _Refuse(400, "bad_request", "the node is required")
    if claimed != identity.node:
        raise _Refuse(
            403,
            "node_mismatch",
            f"the token is for node {identity.node}, the request names {claimed[:253]!r}",
        )
    return claimed


def _probe_id(request: web.Request) -> str:
    probe_id = request.match_info["id"]
    if not probe_id or len(probe_id) > _ID_MAX:
        raise _Refuse(400, "bad_request", "the assignment id is missing or too long")
    return probe_id


def probe_routes(
    scheduler: ProbeScheduler,
    authenticator: Authenticator,
    clock: Clock,
    *,
    is_leader: Callable[[], bool],
) -> list[web.RouteDef]:
    """The probe routes; add them to the aggregator's app (``app.router.add_routes``)."""
    config = scheduler.config
    # Two ends per probe in flight at most; twice that leaves room for entries whose probe
    # already reported but whose deadline has not passed.
    store = Rendezvous(max_entries=2 * config.max_concurrent)
    max_body = config.rendezvous_max_bytes

    async def assignments(request: web.Request) -> web.Response:
        try:
            identity = await _identity(authenticator, request)
            node = _own_node(identity, request.query.get("node"))
            address = request.query.get("address") or None
            if address is not None and (len(address) > _ADDRESS_MAX or not _valid_address(address)):
                raise _Refuse(400, "bad_request", f"address must be host:port, got {address[:64]!r}")
            if address is not None and not _own_address(address, node, request.remote):
                # Partners connect to it: a node may only advertise itself, never point them at
                # another machine's port (10.1.2.3:22).
                raise _Refuse(
                    403,
                    "forbidden",
                    f"address {address[:64]!r} is not {node}'s own (its name, or {request.remote!r} it "
                    f"connects from) with a port of at least {_MIN_PROBE_PORT}",
                )
        except _Refuse as exc:
            return _refused(exc)
        if not is_leader():
            found = []
        else:
            try:
                found = scheduler.assignments_for(node, clock.time(), address=address)
            except Exception:
                log.exception("planning probes failed", extra={"node": node})
                return _json(500, {"error": "internal_error", "message": "assignments could not be planned"})
        body = AssignmentList(
            protocol=PROTOCOL, node=node, assignments=found, poll_seconds=config.poll_seconds
        )
        return _json(200, body)

    async def put_rendezvous(request: web.Request) -> web.Response:
        try:
            identity = await _identity(authenticator, request)
            probe_id = _probe_id(request)
            raw = await _bounded_body(request, max_body)
            try:
                body = _PUT_DECODER.decode(raw)
            except msgspec.DecodeError as exc:
                raise _Refuse(400, "bad_request", f"expected {{'node', 'unique_id'}}: {exc}") from None
            node = _own_node(identity, body.node)
            if not _HEX.match(body.unique_id):
                raise _Refuse(400, "bad_request", "unique_id must be hexadecimal")
            if not is_leader():
                raise _Refuse(503, "not_leader", "this aggregator is not the leader; ask again")
            now = clock.time()
            existing = store.get(probe_id, now)
            if existing is not None:
                _check_end(existing.nodes, node, probe_id)
                if existing.unique_id != body.unique_id:
                    raise _Refuse(409, "conflict", f"assignment {probe_id} already has another unique id")
                return _json(200, {"status": "stored"})
            probe = scheduler.probe(probe_id)
            if probe is None or len(probe.nodes) != 2 or now >= probe.deadline:
                raise _Refuse(404, "unknown_assignment", f"no pair probe {probe_id!r} in flight")
            _check_end(probe.nodes, node, probe_id)
            if not store.put(probe_id, _Entry(probe.nodes, probe.deadline, body.unique_id), now):
                raise _Refuse(503, "rendezvous_full", "too many rendezvous entries; ask again")
        except _Refuse as exc:
            return _refused(exc)
        log.debug("rendezvous stored", extra={"node": node, "probe": probe_id})
        return _json(200, {"status": "stored"})

    async def get_rendezvous(request: web.Request) -> web.Response:
        try:
            identity = await _identity(authenticator, request)
            probe_id = _probe_id(request)
            node = _own_node(identity, request.query.get("node"))
            if not is_leader():
                raise _Refuse(503, "not_leader", "this aggregator is not the leader; ask again")
            now = clock.time()
            entry = store.get(probe_id, now)
            if entry is None:
                probe = scheduler.probe(probe_id)
                if probe is None or len(probe.nodes) != 2 or now >= probe.deadline:
                    raise _Refuse(404, "unknown_assignment", f"no pair probe {probe_id!r} in flight")
                _check_end(probe.nodes, node, probe_id)
                raise _Refuse(404, "not_published", f"the unique id of {probe_id} is not published yet")
            _check_end(entry.nodes, node, probe_id)
        except _Refuse as exc:
            return _refused(exc)
        return _json(200, {"unique_id": entry.unique_id})

    rendezvous = RENDEZVOUS_PATH + "/{id}"
    return [
        web.get(ASSIGNMENTS_PATH, assignments),
        web.put(rendezvous, put_rendezvous),
        web.get(rendezvous, get_rendezvous),
    ]


_MIN_PROBE_PORT: Final = 1024  # a probe listens on an unprivileged port; below it are sshd & co.


def _own_address(address: str, node: str, remote: str | None) -> bool:
    """The advertised host is the node's own: the IP it connects from, or its own name (``node``
    or a name under it, ``node.cluster.local``); and the port is unprivileged."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        same = remote is not None and ipaddress.ip_address(host) == ipaddress.ip_address(remote)
    except ValueError:
        same = host == node or host.startswith(node + ".")
    return same and int(port) >= _MIN_PROBE_PORT


def _valid_address(address: str) -> bool:
    m = _ADDRESS.match(address)
    return m is not None and 1 <= int(m.group(1)) <= 65535


def _check_end(nodes: tuple[str, ...], node: str, probe_id: str) -> None:
    if node not in nodes:
        raise _Refuse(403, "forbidden", f"{node} is not an end of assignment {probe_id}")


async def _bounded_body(request: web.Request, limit: int) -> bytes:
    length = request.content_length
    if length is not None and length > limit:
        raise _Refuse(413, "body_too_large", f"the body is {length} bytes, the limit is {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:
                raise _Refuse(413, "body_too_large", f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except (web.RequestPayloadError, ConnectionError) as exc:
        raise _Refuse(400, "incomplete_body", f"the body did not arrive whole: {exc}") from None
    return b"".join(chunks)
