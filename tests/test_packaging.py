"""Every Python package in the tree is listed in pyproject.toml (so it ships when installed)."""

from __future__ import annotations

import tomllib

from tests.conftest import REPO


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("agent", "aggregator", "gpuwarden", "sim")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert found == listed


def test_the_agent_does_not_import_numpy_or_sklearn() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from gpuwarden.cli import build_parser; build_parser(['agent']);"
        "import agent.collectors, agent.shipper, agent.metrics, agent.gpu.fake, agent.gpu.events;"
        "bad = [m for m in ('numpy', 'sklearn', 'aggregator') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
