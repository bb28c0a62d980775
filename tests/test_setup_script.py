"""scripts/setup on a fresh VM: another apt process holding the dpkg lock is waited for, not fatal."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.conftest import REPO

# Stand-ins on PATH: every Debian package reads as missing, and apt-get fails as the real one does
# when unattended-upgrades holds the lock, unless it was told to wait for it.
_DPKG_QUERY = "#!/bin/sh\nexit 1\n"
_APT_GET = """#!/bin/sh
echo "$*" >> "$APT_LOG"
case "$*" in
  *DPkg::Lock::Timeout=*) exit 0 ;;
esac
echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1234 (unattended-upgr)" >&2
exit 100
"""


def _tool(bin_dir: Path, name: str, text: str) -> None:
    path = bin_dir / name
    path.write_text(text)
    path.chmod(0o755)


def test_setup_waits_for_the_dpkg_lock(tmp_path: Path) -> None:
    # A copy of the script in a tree whose virtualenv is already installed, so only apt runs.
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup", tmp_path / "scripts" / "setup")
    (tmp_path / "pyproject.toml").write_text("")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    _tool(venv_bin, "python", "#!/bin/sh\n")
    stamp = tmp_path / ".venv" / ".gpuwarden-installed"
    stamp.touch()
    os.utime(tmp_path / "pyproject.toml", (1, 1))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "dpkg-query", _DPKG_QUERY)
    _tool(bin_dir, "apt-get", _APT_GET)
    _tool(bin_dir, "sudo", '#!/bin/sh\nexec "$@"\n')
    log = tmp_path / "apt.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_LOG": str(log)}

    out = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup")], env=env, capture_output=True, text=True, check=False
    )

    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert [c.split()[2] for c in calls] == ["update", "install"]
    assert all("-o DPkg::Lock::Timeout=" in c for c in calls), calls
