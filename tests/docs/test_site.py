"""The docs site builds in MkDocs' strict mode (a broken link or anchor, or a page missing from the nav, fails),
and no page of the site or the README refers to a file outside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    shutil.rmtree(tmp_path / "site")


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    for bad in ("DESIGN.md", "STYLE.md", "FACTS.md", "/work/", "shared/"):
        assert bad not in text, f"{page.relative_to(ROOT)} refers to {bad!r}, a file outside the repository"
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or an anchor on the page (mkdocs checks those for docs/)
        resolved = (page.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), (
            f"{page.relative_to(ROOT)} links outside the repository: {target}"
        )
        assert resolved.exists(), f"{page.relative_to(ROOT)} links to a missing file: {target}"
