"""A fresh clone passes on its own: the data the tests read is in the repository, with its licence."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import RECORDED_SYSFS, REPO

# A path that climbs out of the checkout: the parent of the repository root, or a relative `..`
# folder beside it (where a `shared/` folder used to be expected).
_OUTSIDE = re.compile(r"REPO\.parent|parents\[2\]|\.\./shared|\"\.\.\"\s*/")


def _tracked(*paths: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-s", "--", *paths], cwd=REPO, check=True, capture_output=True, text=True
    )
    return out.stdout.splitlines()


def test_no_test_reads_outside_the_repository() -> None:
    offenders = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((REPO / "tests").glob("*.py"))
        if path.name != "test_self_contained.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert offenders == []


def test_recorded_trees_are_in_the_repository_with_their_source_and_licence() -> None:
    readme = (RECORDED_SYSFS / "README.md").read_text()
    for tree in ("node_exporter", "procfs"):
        assert (RECORDED_SYSFS / tree / "sys" / "class" / "infiniband").is_dir()
        assert f"prometheus/{tree}" in readme
    assert "Apache License, Version 2.0" in (RECORDED_SYSFS / "LICENSE-Apache-2.0").read_text()
    inspector = REPO / "tests" / "fixtures" / "nccl-inspector"
    assert "BSD-3-Clause" in (inspector / "README.md").read_text()
    assert (inspector / "LICENSE-NCCL.txt").is_file()
    # Committed, not only present in this checkout: a clone gets them.
    assert _tracked("tests/fixtures/sysfs/recorded/README.md", "tests/fixtures/nccl-inspector/README.md")
    assert len(_tracked("tests/fixtures/sysfs/recorded")) > 300
