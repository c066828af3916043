"""Settings that another setting makes meaningless, in one place: each rule a small named function that says
what is wrong in one line naming both fields, and whether the run is refused or warned about.

- **Refused** (ConfigError, exit status 2 before torch is imported) where the run would do something else than
  the user asked and learn it only after a whole run: a data file the built-in source never reads, a chat
  template the tokenizer does not have, a reward model the verifier reward never calls.
- **Warned** (one line on stderr, the run goes on) where the combination is legitimate in a config file that
  serves several runs (a `rollout.vllm` section kept for GPU runs, the tiny model's shape beside a model.path) or
  a deliberate choice (a short generation budget), but worth saying once.

`check(cfg, command)` runs the config-only rules at config load (cli, before torch; the warnings are printed for
the commands that train: eval and generate of a run's saved config need not hear them); the rules that need the
tokenizer or the rows (`chat_template_present`, `targets_fit`) run where those are loaded (loops.context).
Each rule has a test in tests/test_config_rules.py.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loopline.config import ConfigError, RunConfig
from loopline.section import flat_values


@dataclass(frozen=True)
class Rule:
    """One rule: `check` returns what is wrong ('' when nothing is); `refuse` makes it an error, else a warning."""

    name: str
    refuse: bool
    check: Callable[
        [RunConfig, str, set[str]], str
    ]  # (config, command, keys set off their defaults) -> message


def changed_keys(cfg: RunConfig) -> set[str]:
    """The dotted keys whose value differs from the default: what the user (or a config file) set."""
    given, default = (
        flat_values(cfg.model_dump(mode="json")),
        flat_values(RunConfig().model_dump(mode="json")),
    )
    return {k for k, v in given.items() if default.get(k) != v}


def _set_under(changed: set[str], prefix: str, but: tuple[str, ...] = ()) -> list[str]:
    return sorted(k for k in changed if k.startswith(prefix) and k not in but)


# ---------------------------------------------------------------------------------------------------------
# refused
# ---------------------------------------------------------------------------------------------------------


def data_path_without_source(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """data.train_path/eval_path with data.source=builtin: the run would train on the built-in task and never
    read the file."""
    given = [k for k in ("train_path", "eval_path") if getattr(cfg.data, k)]
    if cfg.data.source != "builtin" or not given:
        return ""
    key = f"data.{given[0]}"
    return (
        f"{key}={getattr(cfg.data, given[0])} is set but data.source is 'builtin', which never reads it (the run "
        f"would use the built-in task): add data.source=jsonl (or parquet, hf_disk), or drop {key}"
    )


def preference_path_without_source(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """preference.train_path/eval_path with preference.source=builtin: the built-in pairs would be used."""
    given = [k for k in ("train_path", "eval_path") if getattr(cfg.preference, k)]
    if cfg.preference.source != "builtin" or not given or command not in ("dpo", "rm"):
        return ""
    return (
        f"preference.{given[0]} is set but preference.source is 'builtin', which never reads it: add "
        f"preference.source=jsonl, or drop preference.{given[0]}"
    )


def chat_template_on_the_builtin_model(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """model.use_chat_template=true without model.path: the built-in byte tokenizer has no chat template."""
    if not cfg.model.use_chat_template or cfg.model.path:
        return ""
    return (
        "model.use_chat_template=true but model.path is empty: the built-in model's tokenizer has no chat "
        "template; give model.path a model whose tokenizer has one, or drop model.use_chat_template"
    )


def reward_model_with_the_verifier(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """reward.model_path with reward.source=verifier: the reward model would never be called."""
    if cfg.reward.source != "verifier" or not cfg.reward.model_path or command != "train":
        return ""
    return (
        f"reward.model_path={cfg.reward.model_path} is set but reward.source is 'verifier', which never calls it: "
        "add reward.source=model (or sum: verifier + model), or drop reward.model_path"
    )


# the sections with a token budget, and the commands that train each
BUDGETED = {"sft": ("train", "sft", "dpo", "rm"), "grpo": ("train",), "critic": ("train",), "dpo": ("dpo",),
            "rm": ("rm",)}  # fmt: skip


def _budgets(cfg: RunConfig, command: str) -> list[tuple[str, int]]:
    """(section, max_tokens_per_micro_batch) of the sections `command` trains with a token budget set."""
    out = [(name, getattr(cfg, name).max_tokens_per_micro_batch) for name, cmds in BUDGETED.items()]
    return [(name, budget) for name, budget in out if budget and command in BUDGETED[name]]


def known_longest_row(cfg: RunConfig, section: str) -> int:
    """The most tokens a row of `section`'s steps can have, when the config says (0 when it does not): the
    built-in addition task's on the built-in model (bos, 'a+b=' with padded operands; then the answer, newline and
    eos for SFT and pairs), or the file data's limits (data.max_prompt_tokens + max_new_tokens, data.max_seq_len)."""
    builtin = cfg.data.source == "builtin"
    # the built-in task's lengths are in the built-in byte tokenizer's tokens (another tokenizer's differ); an env
    # with long built-in prompts (code) writes prompts those lengths do not bound
    if cfg.env.multi_turn or cfg.env.long_builtin_prompts or (builtin and not cfg.model.builtin):
        return 0
    prompt = 1 + 2 * cfg.data.task.max_digits + 2 if builtin else cfg.data.max_prompt_tokens
    if section in ("grpo", "critic"):
        return prompt + cfg.grpo.sampling.max_new_tokens if prompt else 0
    if builtin and (section == "sft" or cfg.preference.source == "builtin"):
        return prompt + cfg.data.task.max_digits + 3
    return cfg.data.max_seq_len if section == "sft" else 0


def token_budget_under_a_row(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """A max_tokens_per_micro_batch smaller than the longest row the config allows: that row fits no micro-batch."""
    for name, budget in _budgets(cfg, command):
        longest = known_longest_row(cfg, name)
        if budget < longest:
            return (
                f"{name}.max_tokens_per_micro_batch={budget} is smaller than the longest row, {longest} tokens "
                f"(prompt + completion): raise it to {longest} or more, or set it to 0 (off)"
            )
    return ""


def token_budget_with_the_pipeline(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """A token budget with runtime.trainer_pp > 1: a pipeline schedule runs micro-batches of one shape."""
    budgets = _budgets(cfg, command)
    if cfg.runtime.trainer_pp == 1 or not budgets:
        return ""
    name, budget = budgets[0]
    return (
        f"{name}.max_tokens_per_micro_batch={budget} makes micro-batches of varying shape, which the pipeline's "
        f"schedule (runtime.trainer_pp={cfg.runtime.trainer_pp}) cannot run: set it to 0 and use "
        f"{name}.micro_batch_size, or runtime.trainer_pp=1"
    )


# ---------------------------------------------------------------------------------------------------------
# warned
# ---------------------------------------------------------------------------------------------------------


def tiny_shape_with_a_model(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """model.tiny.* with model.path when training: the model's own config.json gives its shape. (eval and generate
    of a run or checkpoint take the run's config, whose tiny shape is the model's: nothing to say.)"""
    keys = _set_under(changed, "model.tiny.")
    if not cfg.model.path or not keys or command in ("eval", "generate"):
        return ""
    return f"{', '.join(keys)} shape the built-in model only: model.path={cfg.model.path} has its own shape"


def task_with_a_file_source(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """data.task.* with a file source: the built-in task is not generated."""
    keys = _set_under(changed, "data.task.")
    if cfg.data.source == "builtin" or not keys:
        return ""
    return (
        f"{', '.join(keys)} shape the built-in task only: data.source={cfg.data.source} reads data.train_path"
    )


def vllm_with_the_torch_engine(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """rollout.vllm.* with rollout.engine=torch: vLLM is not started."""
    keys = _set_under(changed, "rollout.vllm.")
    if cfg.rollout.engine == "vllm" or not keys:
        return ""
    return f"{', '.join(keys)} configure vLLM, which rollout.engine=torch does not start (rollout.engine=vllm does)"


def critic_without_gae(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """critic.* without grpo.advantage=gae: no critic is built."""
    keys = _set_under(changed, "critic.")
    if cfg.grpo.advantage == "gae" or not keys or command != "train":
        return ""
    return f"{', '.join(keys)} configure PPO's critic, built only with grpo.advantage=gae (not {cfg.grpo.advantage})"


def lora_settings_without_a_rank(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """model.lora.* with model.lora.r=0: no adapters."""
    keys = _set_under(changed, "model.lora.", but=("model.lora.r",))
    if cfg.model.lora.r or not keys:
        return ""
    return f"{', '.join(keys)} shape LoRA adapters, which model.lora.r=0 turns off: set model.lora.r > 0"


def stop_at_accuracy_without_a_validation_split(cfg: RunConfig, command: str, changed: set[str]) -> str:
    """sft/grpo.stop_at_accuracy with a file dataset: there is no validation split to read, all steps run."""
    builtin_val = cfg.data.source == "builtin"  # the addition task, or calculator/code: their own problems
    keys = [k for k in ("sft.stop_at_accuracy", "grpo.stop_at_accuracy") if k in changed]
    keys = [k for k in keys if value_at(cfg, k) is not None]
    if builtin_val or not keys:
        return ""
    return (
        f"{', '.join(keys)} read a validation split, which only the built-in tasks have "
        f"(data.source={cfg.data.source}): every step runs"
    )


def value_at(cfg: RunConfig, key: str) -> Any:
    """The value of a dotted key ('data.source') in cfg."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


RULES: tuple[Rule, ...] = (
    Rule("data_path_without_source", True, data_path_without_source),
    Rule("preference_path_without_source", True, preference_path_without_source),
    Rule("chat_template_on_the_builtin_model", True, chat_template_on_the_builtin_model),
    Rule("reward_model_with_the_verifier", True, reward_model_with_the_verifier),
    Rule("token_budget_under_a_row", True, token_budget_under_a_row),
    Rule("token_budget_with_the_pipeline", True, token_budget_with_the_pipeline),
    Rule("tiny_shape_with_a_model", False, tiny_shape_with_a_model),
    Rule("task_with_a_file_source", False, task_with_a_file_source),
    Rule("vllm_with_the_torch_engine", False, vllm_with_the_torch_engine),
    Rule("critic_without_gae", False, critic_without_gae),
    Rule("lora_settings_without_a_rank", False, lora_settings_without_a_rank),
    Rule("stop_at_accuracy_without_a_validation_split", False, stop_at_accuracy_without_a_validation_split),
)


def check(cfg: RunConfig, command: str = "train") -> list[str]:
    """Apply RULES: raise ConfigError on the first refused combination; return the warnings (not yet printed)."""
    changed = changed_keys(cfg)
    warnings = []
    for rule in RULES:
        message = rule.check(cfg, command, changed)
        if message and rule.refuse:
            raise ConfigError(message)
        if message:
            warnings.append(message)
    return warnings


def warn(message: str) -> None:
    """A warning as the CLI prints them: one line on stderr."""
    print(f"loopline: warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# rules that need the tokenizer or the rows: run at start, where they are loaded
# ---------------------------------------------------------------------------------------------------------


def chat_template_present(cfg: RunConfig, has_template: bool) -> None:
    """Refuse model.use_chat_template=true when the loaded tokenizer has no chat template (it was ignored)."""
    if cfg.model.use_chat_template and not has_template:
        where = f"model.path '{cfg.model.path}'" if cfg.model.path else "the built-in model"
        raise ConfigError(
            f"model.use_chat_template=true but the tokenizer of {where} has no chat template: give a model "
            "whose tokenizer has one (tokenizer_config.json's chat_template, or chat_template.jinja), or drop "
            "model.use_chat_template"
        )


def targets_fit(cfg: RunConfig, needed: Sequence[int], what: str = "SFT targets") -> str:
    """'' when every target fits the generation budgets, else the warning: `needed` are the tokens each
    target takes to generate (its text and the end: EOS or a stop string), grpo.sampling and eval.sampling."""
    if not needed or cfg.env.multi_turn:  # multi-turn: max_new_tokens is per turn, episodes have their own
        return ""
    longest, median = max(needed), statistics.median(needed)
    short = [
        f"{key}={budget}"
        for key, budget in (
            ("grpo.sampling.max_new_tokens", cfg.grpo.sampling.max_new_tokens),
            ("eval.sampling.max_new_tokens", cfg.eval.sampling.max_new_tokens),
        )
        if budget < longest
    ]
    if not short:
        return ""
    budget = min(cfg.grpo.sampling.max_new_tokens, cfg.eval.sampling.max_new_tokens)
    cut = sum(n > budget for n in needed)
    return (
        f"{' and '.join(short)} cut {cut} of {len(needed)} {what} before they end (they take up to {longest} tokens, "
        f"median {median:g}, with the end token): such answers score as unfinished; raise "
        f"{' and '.join(s.split('=')[0] for s in short)} to {longest} or more"
    )
