"""The model card `loopline export` writes beside the weights (README.md): what the model is and how it was made.

Everything comes from the checkpoint and its run directory, nothing is asked of the user: the base model, the data
and env from the checkpoint's copy of config.yaml; the algorithm's key settings from the same; the final metrics from
the run's metrics.jsonl as it was when the checkpoint was written (its cursors.json holds the file's length then, so
rows logged after the checkpoint are not this model's); the loopline version and commit the run started with (its
config_history.jsonl) and the one that exported it. What cannot be known says "unknown".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loopline.config import RunConfig, load_config
from loopline.version import version

# Per phase: the settings that say what the algorithm did (dotted paths within the phase's section).
KEY_SETTINGS = {
    "sft": ("steps", "batch_size", "optim.lr", "optim.schedule", "stop_at_accuracy"),
    "grpo": (
        "steps", "prompts_per_step", "group_size", "advantage", "policy_loss", "loss_agg", "clip_low", "clip_high",
        "kl_coef", "kl_estimator", "entropy_coef", "optim.lr", "sampling.temperature", "max_staleness",
    ),
    "dpo": ("steps", "batch_size", "loss", "beta", "reference", "optim.lr"),
}  # fmt: skip
# The metrics a card shows, when the phase logged them.
CARD_METRICS = (
    "eval_accuracy", "val_accuracy", "eval_response_len", "reward_mean", "accuracy", "loss", "kl", "entropy",
    "eval_logp_accuracy", "eval_pref_accuracy",
)  # fmt: skip
PHASE_NAMES = {"sft": "supervised fine-tuning (SFT)", "grpo": "RL (the GRPO family, PPO)", "dpo": "DPO"}


def _get(section: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


def _rows(ckpt: Path) -> list[dict[str, Any]] | None:
    """The run's metrics rows as of the checkpoint, None when its run directory's metrics.jsonl is not there."""
    run_dir = ckpt.parent.parent
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    data = metrics.read_bytes()
    cursors = ckpt / "cursors.json"
    if cursors.is_file():
        data = data[: json.loads(cursors.read_text()).get("metrics.jsonl", len(data))]
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _trained_with(ckpt: Path) -> str:
    """The loopline the run started with (its config_history.jsonl's first line that says), or "unknown"."""
    history = ckpt.parent.parent / "config_history.jsonl"
    if history.is_file():
        for line in history.read_text(errors="replace").splitlines():
            try:
                found = json.loads(line).get("loopline")
            except (json.JSONDecodeError, AttributeError):
                continue
            if found:
                return str(found)
    return "unknown"


def _base_model(cfg: RunConfig) -> list[str]:
    model = cfg.model
    if model.path:
        lines = [f"- `model.path`: `{model.path}`"]
    else:
        tiny = model.tiny
        lines = [
            f"- loopline's built-in tiny model, trained from random weights (a Qwen2: hidden_size {tiny.hidden_size}, "
            f"{tiny.num_layers} layers, {tiny.num_heads} heads) with its byte tokenizer"
        ]
    lines.append(f"- dtype: {model.dtype}")
    if model.lora.r:
        lines.append(
            f"- LoRA: r={model.lora.r}, alpha={model.lora.alpha} (adapters folded into these weights)"
        )
    return lines


def _data(cfg: RunConfig, phase: str) -> list[str]:
    data = cfg.data
    if data.source == "builtin":
        lines = [f"- `data.source`: builtin (the task env.name={cfg.env.name} generates)"]
    else:
        lines = [
            f"- `data.source`: {data.source}; train: `{data.train_path}`; eval: `{data.eval_path or 'none'}`"
        ]
    if phase == "dpo":
        pref = cfg.preference
        where = f"`{pref.train_path}`" if pref.source == "jsonl" else "built from the task's rows"
        lines.append(f"- preference pairs: `preference.source`: {pref.source} ({where})")
    else:
        lines.append(f"- reward / scoring: `env.name`: {cfg.env.name}")
    return lines


def _algorithm(cfg: RunConfig, phase: str) -> list[str]:
    phases = (["sft"] if cfg.sft.steps and phase != "sft" else []) + [phase]
    lines = [f"- phases: {' then '.join(PHASE_NAMES.get(p, p) for p in phases)}"]
    for p in phases:
        section = getattr(cfg, p, None)
        if section is None:
            continue
        settings = ", ".join(f"{k}={_get(section, k)!r}" for k in KEY_SETTINGS.get(p, ()))
        lines.append(f"- `{p}`: {settings}")
    lines.append(
        f"- seed: {cfg.seed}; trainer ranks: {cfg.runtime.trainer_ranks}; backend: {cfg.runtime.backend}"
    )
    return lines


def _metrics(rows: list[dict[str, Any]] | None) -> list[str]:
    if rows is None:
        return ["unknown: the run's metrics.jsonl was not found beside the checkpoint"]
    final: dict[
        str, dict[str, tuple[Any, Any]]
    ] = {}  # phase -> key -> (the step it was logged at, its value)
    for row in rows:
        logged = final.setdefault(str(row.get("phase", "run")), {})
        logged.update({k: (row.get("step", ""), v) for k, v in row.items()})
    lines = ["| phase | step | metric | value |", "|---|---|---|---|"]
    for phase, values in final.items():
        for key in CARD_METRICS:
            step, value = values.get(key, (None, None))
            if isinstance(value, int | float) and not isinstance(value, bool):
                lines.append(f"| {phase} | {step} | {key} | {value:.4g} |")
    return lines if len(lines) > 2 else ["none logged before this checkpoint"]


# The classes a tokenizer built by loopline (the built-in byte one, the BPE of a random-weight preset) is saved as.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _loading(model_dir: Path, name: str) -> list[str]:
    """How to load the model and the tokenizer saved beside it, as the run encoded (models.tokenizer.load_tokenizer:
    AutoTokenizer rebuilds a qwen2/qwen3 model's own tokenizer class from a generic one's vocabulary)."""
    config = model_dir / "tokenizer_config.json"
    saved = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    generic = saved in GENERIC_TOKENIZERS
    cls = "PreTrainedTokenizerFast" if generic else "AutoTokenizer"
    lines = [
        "## Load it",
        "",
        "```python",
        f"from transformers import AutoModelForCausalLM, {cls}",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = {cls}.from_pretrained("{name}")  # the tokenizer saved beside the weights',
        "```",
        "",
    ]
    if generic:
        lines += [
            "Load the tokenizer as it was saved (its class, `PreTrainedTokenizerFast`), not with "
            "`AutoTokenizer.from_pretrained`: for a model type with a tokenizer class of its own (qwen2, qwen3) "
            "that rebuilds that class from the vocabulary, with one token more and another encoding than the run "
            "trained with. `loopline.models.tokenizer.load_tokenizer` loads it as the line above does.",
            "",
        ]
    return lines


def model_card(ckpt: Path, name: str) -> str:
    """The card of the policy exported from checkpoint `ckpt` (a checkpoint directory), titled `name`."""
    state = json.loads((ckpt / "state.json").read_text()) if (ckpt / "state.json").is_file() else {}
    phase, step = state.get("phase", "unknown"), state.get("step", "unknown")
    config = ckpt / "config.yaml"
    cfg = load_config(config) if config.is_file() else None
    lines = [
        f"# {name}",
        "",
        f"A causal language model trained with loopline and exported from checkpoint "
        f"`{ckpt.name}` (phase {phase}, step {step}).",
        "",
        f"- trained with loopline {_trained_with(ckpt)}",
        f"- exported by loopline {version()}",
        "",
        *_loading(ckpt / "model", name),
    ]
    if cfg is None:
        lines += ["The checkpoint holds no config.yaml: base model, data and settings unknown.", ""]
    else:
        lines += ["## Base model", "", *_base_model(cfg), "", "## Data", "", *_data(cfg, phase), ""]
        lines += ["## Algorithm", "", *_algorithm(cfg, phase), ""]
    lines += ["## Final metrics", "", *_metrics(_rows(ckpt)), ""]
    if cfg is not None:
        lines += [
            "## Reproduce",
            "",
            "The run's whole config is below; `loopline train config.yaml` (or sft, dpo: the command of its phases) "
            "runs it again.",
            "",
            "```yaml",
            config.read_text().rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)
