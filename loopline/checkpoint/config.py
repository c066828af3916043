"""The checkpoint section: what a checkpoint holds, how it is written, how many are kept (read by
checkpoint.state). Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from pydantic import Field

from loopline.section import Section


class CheckpointConfig(Section):
    """Checkpoints: what they hold, how they are written, how many are kept."""

    keep_last: int = Field(3, ge=0, description="Whole checkpoints kept, the newest; 0 = keep all.")
    async_save: bool = Field(
        False,
        description="Copy the state at the save and write it in a background thread while training goes on; "
        "it becomes `latest` only once whole.",
    )
    hf_model: bool = Field(
        True,
        description="Also write the weights as model/model.safetensors (a Hugging Face directory) in each "
        "checkpoint; on ray this gathers the whole model on trainer rank 0. `loopline export` makes one "
        "from any checkpoint.",
    )
    save_timeout_s: float = Field(600.0, gt=0, description="Longest wait for a checkpoint write to finish.")
