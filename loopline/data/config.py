"""The data sections: where prompts and preference pairs come from and how rows map to fields (read by
data.datasets, data.tasks, data.preference). Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from loopline.section import LocalPath, Section


class TaskConfig(Section):
    """The built-in verifiable task: integer addition, generated from a seed."""

    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of an operand.")
    max_digits: int = Field(3, ge=1, le=9, description="Most digits of an operand.")
    num_train: int = Field(20000, gt=0, description="Training problems generated.")
    num_eval: int = Field(
        2000, gt=0, description="Held-out problems, disjoint from training (2000: a 1-point change is 20)."
    )
    num_val: int = Field(
        2000, ge=0, description="Validation problems, disjoint from both: sft.stop_at_accuracy reads them."
    )
    teacher_drops_carries: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of the training problems whose sum carries that the SFT teacher writes with every carry "
        "dropped (042+079=0011 for 0121); the RL reward still checks the true sum. 0 = a perfect teacher.",
    )

    def distinct_problems(self) -> int:
        """How many distinct 'a+b=' problems these operand lengths allow."""
        return sum(9 * 10 ** (d - 1) + (d == 1) for d in range(self.min_digits, self.max_digits + 1)) ** 2

    @model_validator(mode="after")
    def _digits_order(self) -> TaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        # Checked here, not when the rows are drawn, so a bad size fails at load with one line.
        count, space = self.num_train + self.num_eval + self.num_val, self.distinct_problems()
        if count > space // 2:
            raise ValueError(
                f"asks for {count} distinct problems (num_train + num_eval + num_val) but "
                f"{self.min_digits}-{self.max_digits} digit operands allow {space} (at most half are drawn); "
                "lower num_train/num_eval/num_val or raise max_digits"
            )
        return self


class DataConfig(Section):
    """Where prompts come from and how rows map to fields."""

    source: Literal["builtin", "jsonl", "parquet", "hf_disk"] = Field(
        "builtin",
        description="builtin: generated problems (the addition task; env.name=calculator or code: their own), or a "
        "file/dataset on disk.",
    )
    train_path: Annotated[str, LocalPath("dataset")] = Field(
        "", description="Training prompts (file or saved HF dataset directory)."
    )
    eval_path: Annotated[str, LocalPath("dataset")] = Field(
        "", description="Held-out prompts; empty = no held-out set for file sources."
    )
    prompt_field: str = Field("prompt", description="Row field holding the prompt text.")
    answer_field: str = Field("answer", description="Row field holding the reference answer.")
    completion_field: str = Field("completion", description="Row field holding an SFT target completion.")
    messages_field: str = Field("messages", description="Row field holding chat messages (SFT).")
    skip_bad_rows: bool = Field(
        False, description="Skip malformed rows (bad bytes, JSON, fields; no answer for RL) and count them."
    )
    max_prompt_tokens: int = Field(
        0, ge=0, description="Longest prompt in tokens; 0 = the model's max positions minus max_new_tokens."
    )
    max_seq_len: int = Field(
        0, ge=0, description="Longest prompt + SFT target in tokens; 0 = the model's max positions."
    )
    overlong: Literal["error", "skip"] = Field(
        "error", description="A row over a length limit: stop naming file and row, or skip and count it."
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="Built-in task settings.")


class PreferenceDataConfig(Section):
    """Preference pairs for DPO and reward models (loopline.data.preference describes the row formats)."""

    source: Literal["builtin", "jsonl"] = Field(
        "builtin", description="builtin: pairs from the task (correct vs a wrong sum); jsonl: files."
    )
    train_path: Annotated[str, LocalPath("preference pairs")] = Field(
        "", description="Training pairs (jsonl)."
    )
    eval_path: Annotated[str, LocalPath("preference pairs")] = Field(
        "", description="Held-out pairs (jsonl); empty = no held-out metrics."
    )
    prompt_field: str = Field("prompt", description="Row field holding the prompt (text or messages).")
    chosen_field: str = Field("chosen", description="Row field holding the preferred completion.")
    rejected_field: str = Field("rejected", description="Row field holding the dispreferred completion.")
    margin_field: str = Field("margin", description="Optional row field with a Bradley-Terry margin.")
    num_train: int = Field(4096, gt=0, description="Built-in pairs made from the first N training prompts.")
    num_eval: int = Field(500, gt=0, description="Held-out pairs scored (at most the split size).")
    rejected: Literal["synthetic", "policy"] = Field(
        "synthetic",
        description="builtin pairs' rejected side: a synthetic wrong sum, or each distinct wrong sample of "
        "the policy (after SFT; grpo.sampling, policy_samples per prompt): the mistakes RL will meet.",
    )
    policy_samples: int = Field(4, gt=0, description="Samples per prompt with rejected=policy.")

    @model_validator(mode="after")
    def _paths_given(self) -> PreferenceDataConfig:
        if self.source == "jsonl" and not self.train_path:
            raise ValueError("source 'jsonl' needs train_path")
        if self.rejected == "policy" and self.source != "builtin":
            raise ValueError("rejected 'policy' needs source 'builtin' (the verifier labels the samples)")
        return self
