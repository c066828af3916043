"""Every shell block of the README and the docs marked runnable runs and exits 0.

The convention (docs/background/docs.md): an HTML comment on the line before a ```bash fence,

    <!-- runnable -->                           the block runs as written
    <!-- runnable: sft.steps=3 grpo.steps=2 --> ... with these overrides appended to each command that trains
                                                (loopline train, sft, dpo, rm, agent), so a guide can show the
                                                real command and the test still takes seconds

Each block runs with bash -e in a fresh directory of its own holding a link to the repository's examples/,
with this checkout's `loopline` first on the PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(?P<extra>.*?))?\s*-->\s*$")
TRAINS = re.compile(r"^loopline (train|sft|dpo|rm|agent)\b")

pytestmark = pytest.mark.e2e


class Block(NamedTuple):
    page: str
    line: int
    script: str


def commands(lines: list[str], extra: str) -> str:
    """The block as a script: continuation lines joined, `extra` appended to each command that trains."""
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
    out = []
    for line in joined:
        command, _, comment = line.partition(" #")
        if extra and TRAINS.match(command.strip()):
            line = f"{command.rstrip()} {extra}" + (f"  #{comment}" if comment else "")
        out.append(line)
    return "\n".join(out) + "\n"


def runnable_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, fenced = [], False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fenced = not fenced  # a marker shown inside a code block is an example, not a marker
        marker = MARKER.match(line.strip())
        if fenced or not marker:
            continue
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        assert fence in ("```bash", "```sh", "```shell"), (
            f"{page.relative_to(ROOT)}:{i + 1}: a runnable marker must come right before a ```bash block"
        )
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        blocks.append(
            Block(str(page.relative_to(ROOT)), i + 1, commands(lines[i + 2 : end], marker["extra"] or ""))
        )
    return blocks


BLOCKS = [block for page in PAGES for block in runnable_blocks(page)]


def test_the_guides_mark_commands_runnable() -> None:
    pages = {block.page for block in BLOCKS}
    assert "README.md" in pages and len(BLOCKS) >= 4, pages


def test_overrides_go_on_training_commands_only() -> None:
    script = commands(["loopline train out_dir=q \\", "  seed=1   # short", "loopline eval q"], "sft.steps=2")
    assert script == "loopline train out_dir=q seed=1 sft.steps=2  # short\nloopline eval q\n"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.page}:{b.line}")
def test_runnable_block_exits_0(block: Block, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    done = subprocess.run(
        ["bash", "-e", "-c", block.script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (
        f"{block.page}:{block.line} exited {done.returncode}:\n{block.script}\n"
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-3000:]}"
    )
