"""The agent's side of the probe protocol over HTTP: assignments and the NCCL rendezvous.

One ``AggregatorClient`` per aggregator replica (``--aggregator``, repeatable). Requests carry the
agent's bearer token, read from its file at every request: the poll is rare (tens of seconds) and
a projected service-account token rotates underneath us.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from pathlib import Path
from typing import Final

import msgspec

from agent import __version__
from agent.errors import ConfigError
from agent.probes.base import ProbeFailure
from agent.probes.protocol import ASSIGNMENTS_PATH, PROTOCOL, RENDEZVOUS_PATH, AssignmentList

_MAX_BODY: Final = 4 << 20
_decode_list = msgspec.json.Decoder(AssignmentList).decode


class AggregatorClient:
    def __init__(
        self, url: str, token_file: Path | None, *, ca_file: Path | None = None, timeout_s: float = 10.0
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"aggregator URL {url!r} must be http(s)://HOST[:PORT][/PATH]")
        self.url = url
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._base = parts.path.rstrip("/")
        self._token_file = token_file
        self._timeout = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    def _token(self) -> str | None:
        if self._token_file is None:
            return None
        try:
            return self._token_file.read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise ProbeFailure(f"token file {self._token_file}: {exc}") from exc

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        headers = {"User-Agent": f"gpuwarden-agent/{__version__}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, self._base + path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read(_MAX_BODY)
        except (OSError, http.client.HTTPException) as exc:
            raise ProbeFailure(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    def assignments(self, node: str, address: str | None) -> AssignmentList:
        query = {"node": node}
        if address:
            query["address"] = address
        path = f"{ASSIGNMENTS_PATH}?{urllib.parse.urlencode(query)}"
        status, body = self.request("GET", path)
        if status != 200:
            raise ProbeFailure(f"GET {self.url}{ASSIGNMENTS_PATH}: HTTP {status}: {body[:200]!r}")
        try:
            answer = _decode_list(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProbeFailure(f"GET {self.url}{ASSIGNMENTS_PATH}: not an AssignmentList: {exc}") from exc
        if answer.protocol != PROTOCOL:
            raise ProbeFailure(f"aggregator speaks {answer.protocol!r}, this agent {PROTOCOL!r}")
        return answer

    def publish_unique_id(self, assignment_id: str, node: str, unique_id: str) -> None:
        path = f"{RENDEZVOUS_PATH}/{urllib.parse.quote(assignment_id, safe='')}"
        body = json.dumps({"node": node, "unique_id": unique_id}).encode()
        status, answer = self.request("PUT", path, body)
        if not 200 <= status < 300:
            raise ProbeFailure(f"PUT {self.url}{path}: HTTP {status}: {answer[:200]!r}")

    def fetch_unique_id(self, assignment_id: str, node: str) -> str | None:
        """The unique id rank 0 published, or None while it has not yet (404)."""
        path = (
            f"{RENDEZVOUS_PATH}/{urllib.parse.quote(assignment_id, safe='')}"
            f"?{urllib.parse.urlencode({'node': node})}"
        )
        status, body = self.request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise ProbeFailure(f"GET {self.url}{path}: HTTP {status}: {body[:200]!r}")
        try:
            value = json.loads(body)["unique_id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ProbeFailure(f"GET {self.url}{path}: no unique_id in the answer") from exc
        if not isinstance(value, str):
            raise ProbeFailure(f"GET {self.url}{path}: unique_id is not a string")
        return value
