"""The sample ledger: which samples each optimizer step trained, to show none is lost or trained twice.

RUN_DIR/ledger.jsonl is append-only, one line per step: {"phase", "step", "samples"}, where each sample
is its stable id [epoch, prompt index, sample index] (SFT: sample index 0). A checkpoint records the
ledger's length, and a resumed run cuts it back there (as it does metrics.jsonl), so the lines of the
steps it repeats are written once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LEDGER_FILE = "ledger.jsonl"

SampleId = tuple[int, int, int]  # (epoch, prompt index, sample index)


class Ledger:
    """Appends one line per optimizer step to RUN_DIR/ledger.jsonl."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LEDGER_FILE

    def record(self, phase: str, step: int, samples: Sequence[SampleId]) -> None:
        """The samples trained by `step` of `phase` (written before that step's checkpoint)."""
        line = json.dumps({"phase": phase, "step": step, "samples": [list(s) for s in samples]})
        with self.path.open("a") as f:
            f.write(line + "\n")

    def clear(self) -> None:
        """Start afresh: a new run must not inherit an earlier run's lines."""
        self.path.unlink(missing_ok=True)


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every line of a run's ledger, in order."""
    path = Path(run_dir) / LEDGER_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def repeats(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int, int], int]:
    """Samples trained more than once within a phase: (phase, epoch, prompt, sample) -> times trained."""
    counts = Counter((r["phase"], *s) for r in rows for s in r["samples"])
    return {k: n for k, n in counts.items() if n > 1}
