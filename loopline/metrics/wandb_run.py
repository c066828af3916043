"""A run's metrics rows on Weights & Biases: the config once, each row's numbers under `<phase>/<key>` plotted against
`<phase>/step` (the phases count steps from 0 each, so W&B's own step is not theirs).

The W&B run's id is kept in RUN_DIR/wandb_run.json: a run that resumes there (`--resume`, or a restart after a
worker failure) continues the same W&B run (resume="must"); `--overwrite` deletes the file with the rest of the run.
Steps replayed after a resume (metrics.jsonl is cut back to the checkpoint) are logged again, at the same
`<phase>/step`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from loopline.errors import UserError
from loopline.metrics.config import MetricsConfig

ID_FILE = "wandb_run.json"


class WandbRun:
    """One W&B run for one run directory: started (or resumed) here, fed rows by MetricsLogger, finished at close."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, config: dict[str, Any]) -> None:
        import wandb  # the extra: preflight.check_run names the install command when it is missing

        id_path = run_dir / ID_FILE
        resumed = id_path.is_file()
        run_id = json.loads(id_path.read_text())["id"] if resumed else None  # new: W&B makes one
        try:
            self._run = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name or run_dir.resolve().name,
                tags=cfg.wandb_tags or None,
                config=config,
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                id=run_id,
                resume="must" if resumed else None,
                # loopline prints its own lines; W&B's capture of stdout would wrap every print of the run
                settings=wandb.Settings(console="off"),
            )
        except wandb.errors.Error as e:
            raise UserError(
                f"metrics.wandb: W&B could not start the run: {e} (log in with `wandb login` or WANDB_API_KEY; "
                "WANDB_MODE=offline logs without an account, for `wandb sync` later)"
            ) from e
        if not resumed:
            id_path.write_text(json.dumps({"id": self._run.id, "project": cfg.wandb_project}) + "\n")
        self._phases: set[str] = set()

    @property
    def id(self) -> str:
        return self._run.id

    def log(self, row: dict[str, Any]) -> None:
        """The numbers of one metrics row, under `<phase>/<key>`, at `<phase>/step`."""
        phase = str(row.get("phase", "run"))
        if phase not in self._phases:
            self._run.define_metric(f"{phase}/step")
            self._run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        numbers = {
            f"{phase}/{k}": v
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if numbers:
            self._run.log(numbers)

    def finish(self) -> None:
        self._run.finish()
