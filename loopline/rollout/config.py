"""The rollout sections: how engines sample (SamplingConfig, turned into engine params by the loops), and the
held-out evaluation's greedy generation. Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from pydantic import Field

from loopline.section import Section


class SamplingConfig(Section):
    """How the engine samples completions."""

    max_new_tokens: int = Field(8, gt=0, description="Longest completion generated.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings (kept in the output).")


class EvalConfig(Section):
    """Held-out evaluation."""

    num_prompts: int = Field(2000, gt=0, description="Held-out prompts scored (at most the split size).")
    batch_size: int = Field(1000, gt=0, description="Prompts per generate call.")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.0), description="Greedy by default."
    )
