"""``gpuwarden breaker``: look at or reset the remediation safety breaker of a running aggregator.

    gpuwarden breaker status --aggregator URL --token-file FILE   (a viewer or admin token)
    gpuwarden breaker reset  --aggregator URL --token-file FILE --by NAME [--reason TEXT]

The reset is audited (the aggregator's audit log records who and why) and closes the breaker on
every replica (it is stored in the leader Lease). Held quarantines that fit the limits are then
applied; the rest stay held and the breaker opens again. When the Lease write is refused for now,
the reset holds on the replica that took it and is retried there; the command says so and exits
3, since the other replica (or that one after a restart) still reads the open breaker.

Both routes exist only on an aggregator with remediation on: a 404 from one of them, from a
server that answers its health check, means remediation is off there, and is said so.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from agent.errors import ConfigError

STATUS_PATH = "/api/v1/remediation"
RESET_PATH = "/api/v1/breaker/reset"
NOT_STORED_EXIT = 3  # reset here, not yet in the Lease that every replica reads
# Served by every aggregator, remediation on or off (aggregator/service.py).
HEALTH_PATH = "/readyz"


class _HTTPStatus(ConfigError):
    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {body}")
        self.status = status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["status", "reset"])
    p.add_argument("--aggregator", required=True, metavar="URL", help="the aggregator's base URL")
    p.add_argument(
        "--token-file",
        type=Path,
        help="an admin token (one of --admin-token-file's); status also takes a viewer's",
    )
    p.add_argument("--by", help="who resets it (recorded in the audit log)")
    p.add_argument("--reason", default="", help="why (recorded in the audit log)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the aggregator")


def _call(req: urllib.request.Request, timeout: float) -> dict[str, object]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data: dict[str, object] = json.loads(resp.read())
            return data
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:500]
        raise _HTTPStatus(req.full_url, exc.code, body) from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise ConfigError(f"{req.full_url}: {exc}") from exc


def _is_an_aggregator(base: str, timeout: float) -> bool:
    """Whether ``base`` answers the aggregator's health check (ready or not)."""
    try:
        _call(urllib.request.Request(base + HEALTH_PATH), timeout)
    except _HTTPStatus as exc:
        return exc.status != 404
    except ConfigError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    base = args.aggregator.rstrip("/")
    try:
        return _run(args, base)
    except _HTTPStatus as exc:
        if exc.status != 404 or not _is_an_aggregator(base, args.timeout):
            raise
        raise ConfigError(
            f"remediation is off on the aggregator at {base}: it has no safety breaker "
            "(start it with --remediation dry-run or enforce, or remediation.mode in its config)"
        ) from exc


def _token(args: argparse.Namespace) -> str:
    try:
        token: str = args.token_file.read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError) as exc:
        raise ConfigError(f"cannot read a token from {args.token_file}") from exc
    return token


def _run(args: argparse.Namespace, base: str) -> int:
    if args.action == "status":
        # Reading the status needs a viewer or admin token too (aggregator/service.py).
        headers = {"Authorization": f"Bearer {_token(args)}"} if args.token_file is not None else {}
        out = _call(urllib.request.Request(base + STATUS_PATH, headers=headers), args.timeout)
    else:
        if args.token_file is None or not args.by:
            raise ConfigError("breaker reset needs --token-file and --by")
        token = _token(args)
        body = json.dumps({"by": args.by, "reason": args.reason}).encode()
        req = urllib.request.Request(
            base + RESET_PATH,
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        out = _call(req, args.timeout)
    json.dump(out, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    if args.action == "reset" and out.get("stored") is False:
        sys.stderr.write(
            "gpuwarden breaker: the reset is applied on this replica but not yet stored in the "
            "Lease (the API server refused the write for now; it is retried every retry period). "
            "Until it is, the other replica, or this one after a restart, keeps the breaker open: "
            "check with `gpuwarden breaker status`.\n"
        )
        return NOT_STORED_EXIT
    return 0
