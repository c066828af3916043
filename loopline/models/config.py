"""The model sections: which policy to load (a Hugging Face directory, a real model's shape with random weights,
or the built-in tiny model's shape) and its LoRA adapters. Read by models.load and training.lora; pydantic only, so loading a config stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from loopline.models.presets import PRESETS
from loopline.section import LocalPath, Section


class TinyModelConfig(Section):
    """Shape of the built-in Qwen2-architecture model (used when model.path is empty)."""

    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Attention heads per block.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(384, gt=0, description="Width of the MLP.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest sequence the model accepts.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        return self


class LoRAConfig(Section):
    """LoRA adapters (peft): train low-rank updates of the target modules only; engines get merged weights."""

    r: int = Field(0, ge=0, description="Adapter rank; 0 = no LoRA, train every weight.")
    alpha: float = Field(16.0, gt=0.0, description="Scale numerator: the update is (alpha / r) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names (suffixes) of the linear modules that get adapters.",
    )


class ModelConfig(Section):
    """Which policy model and tokenizer to train."""

    path: Annotated[str, LocalPath("Hugging Face model directory")] = Field(
        "", description="Local Hugging Face model directory; empty = the built-in tiny model."
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description="pretrained = the weights in model.path (or the built-in model's seeded ones); random = build "
        "the architecture of model.preset, model.config or model.path's config.json with seeded random weights.",
    )
    preset: str = Field(
        "",
        description=f"A public model's published shape for model.init=random: {', '.join(PRESETS)}.",
    )
    config: Annotated[str, LocalPath("Hugging Face model config directory")] = Field(
        "", description="A directory holding a causal LM's config.json, for model.init=random."
    )
    tokenizer: Annotated[str, LocalPath("tokenizer directory")] = Field(
        "",
        description="A local tokenizer directory; empty = model.path's, or with model.init=random a byte-level "
        "BPE trained here on the built-in task's text and padded to the config's vocab_size.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Built-in model shape.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    use_chat_template: bool = Field(
        False, description="Wrap prompts with the tokenizer's chat template when it has one."
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (r > 0 turns them on).")
    packing: bool = Field(
        False,
        description="Train and score over packed sequences: every forward of the policy, reference, critic and "
        "reward model runs on the batch's real tokens laid end to end (no padding), with the padded forward's "
        "log-probs. Faster when response lengths vary; the first packed forward checks the model keeps "
        "sequences apart.",
    )
    logits_chunk_tokens: int = Field(
        0,
        ge=0,
        description="Log-probs and entropies from the LM head this many tokens at a time (each chunk's logits "
        "recomputed in the backward), so no forward of the policy or reference holds the whole (rows x tokens x "
        "vocabulary) float32 logits; 0 = all at once. Same values to rounding; 256-1024 at real vocabularies.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0.0,
        description="A mixture-of-experts policy's load-balancing loss (Switch Transformer's, over its routers' real "
        "tokens, pooled over layers) added to each training micro-batch's objective times this; null = as "
        "transformers trains the model's config: its router_aux_loss_coef when its output_router_logits is true, "
        "else 0 (the published Qwen3-MoE and Mixtral configs: 0). A dense model takes none.",
    )
    share_prompts: bool = Field(
        True,
        description="In padded forwards, compute each distinct prompt of a batch once and let its rows (a GRPO "
        "group) attend to its KV cache: the padded log-probs up to float reordering, and group_size times less "
        "prompt compute in training and scoring. false = every row its own full forward.",
    )

    @model_validator(mode="after")
    def _one_shape(self) -> ModelConfig:
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset '{self.preset}'; known: {', '.join(PRESETS)}")
        if self.preset and self.config:
            raise ValueError("model.preset and model.config both give a shape: set one")
        if self.init == "pretrained" and (self.preset or self.config):
            which = "model.preset" if self.preset else "model.config"
            raise ValueError(
                f"{which} gives a shape, not weights (nothing is downloaded): set model.init=random"
            )
        if self.init == "random" and not (self.preset or self.config or self.path):
            raise ValueError(
                f"model.init=random needs a shape: model.preset ({', '.join(PRESETS)}), model.config=DIR or "
                "model.path=DIR (a directory with a config.json)"
            )
        if self.init == "random" and self.path and (self.preset or self.config):
            raise ValueError("model.path and model.preset/model.config both give a shape: set one")
        return self

    @property
    def builtin(self) -> bool:
        """The built-in tiny model (model.tiny's shape), not one from a path, a preset or a config."""
        return not (self.path or self.preset or self.config)


# Files a Hugging Face tokenizer is loaded from (one is enough): without any, AutoTokenizer still builds one from
# the model's type, with a vocabulary of one token, and training fails seconds later deep in a worker.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
)  # fmt: skip


def missing_tokenizer(path: str | Path) -> str:
    """'' when the model directory `path` holds tokenizer files, else the one-line error that says so."""
    if any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return ""
    return (
        f"model.path: '{path}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): save the "
        "tokenizer beside the model (tokenizer.save_pretrained(DIR)), as `loopline export` does"
    )


def shape_fields(cfg: ModelConfig) -> dict[str, Any] | None:
    """The Hugging Face config numbers of the policy's shape, read without torch: model.preset's, or the config.json
    of model.config or model.path; None for the built-in model. OSError or ValueError when the file cannot be read."""
    if cfg.preset:
        return dict(PRESETS[cfg.preset])
    where = cfg.config or cfg.path
    if not where:
        return None
    fields = json.loads((Path(where) / "config.json").read_text())
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")
    return fields


def is_moe(fields: dict[str, Any] | None) -> bool:
    """Whether config numbers (shape_fields) are a mixture of experts' (Qwen3-MoE's num_experts, Mixtral's
    num_local_experts)."""
    return bool(fields and (fields.get("num_experts") or fields.get("num_local_experts")))
