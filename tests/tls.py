"""A throwaway self-signed certificate for the tests that speak TLS to 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import missing_tool


def self_signed(cert: Path, key: Path) -> None:
    """Writes a one-day certificate for IP 127.0.0.1 and its key; skips the test without openssl
    (fails it in CI, which must test TLS)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        missing_tool("openssl", "openssl")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
