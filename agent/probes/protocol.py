"""The probe assignment protocol between the aggregator's scheduler and the agents (docs/probes.md).

Version ``gpuwarden/probes/v1``. The agent polls::

    GET /v1/probes/assignments?node=<node>&address=<host:port>
    Authorization: Bearer <the agent's report token>

``address`` is where the agent's probe endpoint listens (the other end of a pair probe connects
there). The answer is an ``AssignmentList``. Each assignment is signed by the aggregator with
HMAC-SHA256 under the probe key (a secret shared by the aggregator and the agents, the
``--probe-key-file``), over its canonical JSON without the signature. An agent runs an
assignment only if the signature verifies, ``node`` is its own name, and the deadline has not
passed; the serving end of a ``tcp_pair`` probe checks the same of the assignment the client
presents, so nobody else can make a node serve bulk traffic.

Results travel in the agent's next report(s), in ``probes`` (report schema v1), failures included.

For ``nccl_allreduce_pair`` the rank-0 end publishes the NCCL unique id, and the other end fetches it::

    PUT /v1/probes/rendezvous/<assignment id>   body: {"node": ..., "unique_id": "<hex>"}
    GET /v1/probes/rendezvous/<assignment id>?node=<node>   -> {"unique_id": "<hex>"} or 404
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Final, Literal

import msgspec

from agent.errors import ConfigError

PROTOCOL: Final = "gpuwarden/probes/v1"
ASSIGNMENTS_PATH: Final = "/v1/probes/assignments"
RENDEZVOUS_PATH: Final = "/v1/probes/rendezvous"

ProbeKind = Literal["nccl_allreduce_local", "nccl_allreduce_pair", "tcp_pair"]
Role = Literal["local", "client", "server"]


class Assignment(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    id: str  # unique per probe; both ends of a pair share it
    kind: ProbeKind
    node: str  # who runs this side
    role: Role  # local probes: "local"; pairs: the "client" connects to the "server"
    not_before: float  # unix seconds (aggregator clock): start no earlier
    deadline: float  # unix seconds: give up (and report ok=false) after this
    size_bytes: int
    peer: str | None = None
    peer_address: str | None = None  # host:port of the peer's probe endpoint (client side)
    rank: int | None = None  # nccl pair: 0 publishes the unique id
    signature: str = ""  # hex HMAC-SHA256 of the canonical JSON of every other field


class AssignmentList(msgspec.Struct, kw_only=True, frozen=True):
    protocol: str
    node: str
    assignments: list[Assignment]
    poll_seconds: float  # when to ask again


_ENC = msgspec.json.Encoder(order="sorted")


def canonical(assignment: Assignment) -> bytes:
    """The signed bytes: sorted-key JSON of the assignment without its signature."""
    return _ENC.encode(msgspec.structs.replace(assignment, signature=""))


def sign(assignment: Assignment, key: bytes) -> Assignment:
    mac = hmac.new(key, canonical(assignment), hashlib.sha256).hexdigest()
    return msgspec.structs.replace(assignment, signature=mac)


def verify(assignment: Assignment, key: bytes) -> bool:
    expected = hmac.new(key, canonical(assignment), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, assignment.signature)


MIN_KEY_BYTES: Final = 16


def read_probe_key(path: Path) -> bytes:
    """The probe key from ``--probe-key-file`` (surrounding whitespace is not part of it); the
    aggregator and the agents read it the same way."""
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --probe-key-file {path}: {exc.strerror or exc}") from exc
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"--probe-key-file {path}: the key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}"
        )
    return key
