"""The command line answers at once: ``--help`` and refused arguments never load scikit-learn.

The aggregator's pipeline imports scikit-learn (seconds on a small machine); only a subcommand
that runs the pipeline may pay for it, and only once it runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuwarden.cli import SUBCOMMANDS
from tests.conftest import REPO

# Runs the command line in-process, then says which heavy modules it had imported by the end.
_PROBE = """
import sys
from gpuwarden.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(sorted(m for m in ("sklearn", "aggregator.pipeline") if m in sys.modules))
print("exit", code)
"""


def _probe(*argv: str) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=REPO, capture_output=True, text=True, check=False
    )
    *_, loaded, code = out.stdout.splitlines()
    return loaded, code + "\n" + out.stderr


def test_importing_the_cli_does_not_import_sklearn() -> None:
    code = "import sys, gpuwarden.cli; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("command", [[], *([name] for name in SUBCOMMANDS)], ids=lambda c: c[0] if c else "")
def test_help_does_not_import_sklearn(command: list[str]) -> None:
    loaded, rest = _probe(*command, "--help")
    assert loaded == "[]", rest
    assert rest.startswith("exit 0"), rest


def test_a_bad_listen_address_is_refused_before_the_pipeline_loads() -> None:
    loaded, rest = _probe("aggregator", "--listen", "no-port-here", "--decisions", "/nonexistent/d.jsonl")
    assert loaded == "[]", rest
    assert rest.startswith("exit 2"), rest
    assert "--listen 'no-port-here': expected HOST:PORT" in rest
