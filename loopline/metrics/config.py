"""The `metrics` section: where a run's metrics rows go besides metrics.jsonl (TensorBoard: `tensorboard`). Pydantic
only (loading a config imports no torch or wandb)."""

from __future__ import annotations

from pydantic import Field

from loopline.section import Section

WANDB_INSTALL_HINT = (
    "metrics.wandb=true needs the wandb package: pip install 'loopline[wandb]' (or pip install wandb)"
)


class MetricsConfig(Section):
    """Weights & Biases logging of every metrics row (the curves) and of the run's config, beside metrics.jsonl.

    WANDB_MODE=offline writes the run under WANDB_DIR (default: out_dir) for `wandb sync` later; a resumed run
    continues the same W&B run (its id is kept in out_dir/wandb_run.json)."""

    wandb: bool = Field(
        False, description="Also log to Weights & Biases (needs `pip install 'loopline[wandb]'`)."
    )
    wandb_project: str = Field("loopline", min_length=1, description="The W&B project the run goes to.")
    wandb_run_name: str = Field(
        "", description="The W&B run's display name; empty: out_dir's last component."
    )
    wandb_tags: list[str] = Field(
        default_factory=list, description="Tags on the W&B run, e.g. [grpo, qwen-0.5b]."
    )
