"""The listening socket: a connection cap below the file limit, and TLS reloaded when it changes.

Every open connection is a file descriptor. When the process runs out of them, the accept loop
fails on every try ("Too many open files", logged each time) and every good node is locked out
as surely as the attacker's idle sockets are. So at start the soft ``RLIMIT_NOFILE`` is raised to
the hard limit (``raise_file_limit``), and the site takes at most ``connection_cap`` connections:
``server.max_connections``, but never closer than ``server.fd_reserve`` to the limit. At the cap a
new connection closes the oldest one without a request in progress (an idle socket, a slow
header sender: ``Busy`` knows which have one), so a flood of idle sockets cannot lock good nodes
out; only when every connection is busy is the new one answered ``503`` with ``Retry-After`` and
closed, nothing read. Both are counted (one log line per ``ratelog`` period). Idle connections
and slow headers are also closed by the HTTP server's keep-alive timeout
(``server.idle_timeout_seconds``, armed from the connection's start).

TLS: ``tls_context`` loads the certificate and key; ``watch_tls`` loads them again into the same
context when either file changes (cert-manager renewing a secret), so new connections get the new
certificate without a restart. A pair that does not load (half written) keeps the old one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from aggregator.config import ServerConfig
from aggregator.ratelog import RateLimitedLog

__all__ = ["Busy", "CappedSite", "connection_cap", "raise_file_limit", "tls_context", "watch_tls"]

log = logging.getLogger(__name__)
_ratelog: Final = RateLimitedLog(log)
ACCEPT_BATCH: Final = 32  # connections accepted per loop iteration; well inside fd_reserve


def raise_file_limit() -> int:
    """Raise the soft file limit to the hard one (where allowed); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning(
                "could not raise the file limit", extra={"soft": soft, "hard": hard, "error": str(exc)}
            )
    return soft


def connection_cap(config: ServerConfig, soft_limit: int) -> int:
    """How many connections the site takes: the configured cap, ``fd_reserve`` below the limit."""
    return max(1, min(config.max_connections, soft_limit - config.fd_reserve))


class Busy:
    """The connections (aiohttp request handlers) with a request in progress, kept by a middleware;
    the rest may be closed to make room. One request at a time per connection (HTTP/1.1)."""

    def __init__(self) -> None:
        self.handlers: set[object] = set()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        proto = request.protocol
        self.handlers.add(proto)
        try:
            return await handler(request)
        finally:
            self.handlers.discard(proto)


class _Refused(asyncio.Protocol):
    """A connection over the cap: told to come back later, then closed, nothing read."""

    def __init__(self, retry_after_s: int) -> None:
        body = b'{"error": "overloaded", "message": "too many connections; retry later"}'
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            f"Retry-After: {retry_after_s}\r\n"
            "Content-Type: application/json\r\n"
            "Connection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self._answer = head.encode() + body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._answer)
        transport.close()


class CappedSite(web.TCPSite):
    """A ``TCPSite`` that closes connections beyond ``cap`` at once (see the module docstring)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None,
        port: int | None,
        *,
        cap: int,
        retry_after_s: int,
        busy: Busy,
        ssl_context: ssl.SSLContext | None = None,
        shutdown_timeout: float = 60.0,
        backlog: int = 1024,
    ) -> None:
        super().__init__(
            runner, host, port, ssl_context=ssl_context, shutdown_timeout=shutdown_timeout, backlog=backlog
        )
        self.cap = cap
        self.refused = 0
        self.evicted = 0
        self._busy = busy
        self._retry_after_s = retry_after_s

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would bind without the cap
        server = self._runner.server
        assert server is not None
        handlers = server
        busy = self._busy.handlers

        def factory() -> asyncio.Protocol:
            connections = handlers.connections
            if len(connections) >= self.cap:
                # One closed to make room stays listed until its close completes: not counted.
                connections = [h for h in connections if h.transport is not None]
            if len(connections) >= self.cap:
                idle = next((h for h in connections if h not in busy), None)
                if idle is not None:
                    idle.force_close()
                    self.evicted += 1
                    _ratelog.warning(
                        "connection_evicted",
                        "idle connection closed: at the connection cap",
                        extra={"cap": self.cap, "evicted_total": self.evicted},
                    )
                    return handlers()
                self.refused += 1
                _ratelog.warning(
                    "connection_cap",
                    "connection refused: at the connection cap",
                    extra={"cap": self.cap, "refused_total": self.refused},
                )
                return _Refused(self._retry_after_s)
            return handlers()

        # asyncio accepts up to ``backlog`` connections per loop iteration before any protocol
        # exists, so the batch, not just the cap, decides how far past the cap the fds can go: a
        # small batch (within fd_reserve), but the kernel's queue stays deep for bursts.
        sock = socket.create_server(
            (self._host or "", self._port), backlog=self._backlog, reuse_port=bool(self._reuse_port)
        )
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            factory, sock=sock, ssl=self._ssl_context, backlog=ACCEPT_BATCH
        )
        sock.listen(self._backlog)
        self._bound_port = sock.getsockname()[1]


def _mtimes(cert: str, key: str) -> tuple[int, int]:
    return os.stat(cert).st_mtime_ns, os.stat(key).st_mtime_ns


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) with the certificate chain and key from PEM files."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


async def watch_tls(ctx: ssl.SSLContext, cert: str, key: str, every_s: float) -> None:
    """Load ``cert`` and ``key`` into ``ctx`` again whenever either changes; runs until cancelled."""
    seen = _mtimes(cert, key)
    while True:
        await asyncio.sleep(every_s)
        try:
            now = _mtimes(cert, key)
            if now == seen:
                continue
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            # Mid-renewal the pair can disagree for a moment: keep serving the old one.
            _ratelog.warning("tls_reload_failed", "TLS certificate reload failed", extra={"error": str(exc)})
            continue
        seen = now
        log.info("TLS certificate reloaded", extra={"cert_file": cert})
