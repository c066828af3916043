"""Metrics: one JSON object per row in metrics.jsonl, TensorBoard when installed, W&B when asked, a progress bar."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from loopline.errors import UserError
from loopline.metrics.config import MetricsConfig

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends rows to RUN_DIR/metrics.jsonl (and TensorBoard); a resumed run cuts the file back to its length at the
    checkpoint (checkpoint.state.truncate_run_files)."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        wandb: MetricsConfig | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """wandb: the metrics section; with wandb=true every row also goes to W&B, and `config` (the run's) with it."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wandb = None
        if wandb is not None and wandb.wandb:
            from loopline.metrics.wandb_run import WandbRun

            self._wandb = WandbRun(Path(run_dir), wandb, config or {})
        self._tb = None
        self._notes: dict[str, Any] = {}
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                log.info("tensorboard not installed: logging to metrics.jsonl only")

    def note(self, fields: dict[str, Any]) -> None:
        """Fields to add to the next row logged (e.g. the data rows skipped at load, once per process)."""
        self._notes.update(fields)

    def note_sum(self, fields: dict[str, float]) -> None:
        """As note(), each value added to what was noted under its key since the last row (e.g. two heals in one
        step: their seconds and their count)."""
        self._notes.update({k: self._notes.get(k, 0) + v for k, v in fields.items()})

    def log(self, row: dict[str, Any]) -> None:
        row, self._notes = {**row, **self._notes}, {}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None and "step" in row:
            phase = row.get("phase", "run")
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(f"{phase}/{k}", v, row["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean)

    def clear(self) -> None:
        """Start metrics.jsonl afresh: rows of an earlier run in the same directory must not mix in."""
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of a run's metrics.jsonl. A last line cut short (a crash or a full disk while it was written: no
    newline at its end) is left out with a warning; any other line that is not a JSON object is an error naming
    the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in '{run_dir}'")
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                log.warning(
                    "%s: line %d was cut short as it was written (no newline after it): left out",
                    path,
                    number,
                )
                continue
            raise UserError(
                f"{path} line {number} is not a metrics row: {e.msg} (column {e.colno})"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{path} line {number} is not a metrics row: a JSON {type(row).__name__}, not an object"
            )
        rows.append(row)
    return rows
