"""Pre-flight checks of a run command, before torch is imported: the config and its rules, the files it names, an
out_dir it can write, whether it fits its nodes (loopline.plan). The CLI and loopline.api call them first, so a
mistake costs a second, not a model load."""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from pathlib import Path

from loopline import config_rules
from loopline.checkpoint.run_dir import RUN_CONFIG, holds_run, no_run_to_resume, resume_config
from loopline.config import RunConfig, check_preference, load_config
from loopline.errors import UserError
from loopline.metrics.config import WANDB_INSTALL_HINT
from loopline.models.config import is_moe, missing_tokenizer, shape_fields
from loopline.plan import PHASES
from loopline.rollout.config import VLLM_INSTALL_HINT

RUN_COMMANDS = ("train", "sft", "dpo", "rm", "eval", "generate")  # build a run context (model and data)
WRITING_COMMANDS = ("train", "sft", "dpo", "rm")  # write into out_dir
PLANNED = tuple(PHASES)  # the commands `loopline plan` plans and that check their plan before starting


def _is_model_source(path: Path) -> bool:
    """A Hugging Face model directory, a checkpoint (dcp/ inside) or a run directory (checkpoints/ inside)."""
    return (path / "config.json").is_file() or (path / "dcp").is_dir() or (path / "checkpoints").is_dir()


def _check_file(key: str, value: str, want_dir: bool = False) -> None:
    if not value:
        raise UserError(f"{key} is required here (a {'directory' if want_dir else 'file'})")
    path = Path(value)
    if not path.exists():
        raise UserError(f"{key}: '{path}' does not exist")
    if want_dir and not path.is_dir():
        raise UserError(f"{key}: '{path}' is not a directory")
    if not want_dir and not path.is_file():
        raise UserError(f"{key}: '{path}' is a directory, not a file")


def _check_out_dir(value: str) -> None:
    """out_dir must be a directory this process can write: made here (empty) when it does not exist."""
    path = Path(value)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"is under '{existing}', a file"
        raise UserError(f"out_dir: '{path}' {where}, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(f"out_dir: '{path}' cannot be written ({e.strerror or e})") from None


def check_run(
    cfg: RunConfig, command: str, plan: bool = False, resume: tuple[str | None, list[str]] | None = None
) -> None:
    """What a run command needs on disk, before torch is imported: the model, the data files, a writable
    out_dir; with `plan`, that the run fits its nodes' memory (loopline.plan), before out_dir is made. Raises
    UserError (ConfigError for bad combinations of values) naming the key and the path. resume: the config file
    and overrides of a resumed run, whose saved config (with them applied) is the one planned."""
    if command in ("dpo", "rm"):
        check_preference(cfg, command)
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not path.is_dir():
            _check_file("model.path", cfg.model.path, want_dir=True)
        if command in ("eval", "generate") and not _is_model_source(path):
            raise UserError(f"model.path: '{path}' is not a model, checkpoint or run directory")
        if command not in ("eval", "generate") and not (path / "config.json").is_file():
            raise UserError(
                f"model.path: '{path}' is not a Hugging Face model directory (no config.json; "
                "`loopline export` makes one from a checkpoint)"
            )
        # without tokenizer files: a one-token tokenizer, and a traceback seconds later
        if (
            cfg.model.init == "pretrained"
            and not cfg.model.tokenizer
            and (path / "config.json").is_file()
            and missing_tokenizer(path)
        ):
            raise UserError(missing_tokenizer(path))
    for key in ("config", "tokenizer"):  # model.init=random's shape, a local tokenizer: directories
        if getattr(cfg.model, key):
            _check_file(f"model.{key}", getattr(cfg.model, key), want_dir=True)
    if cfg.model.config and not (Path(cfg.model.config) / "config.json").is_file():
        raise UserError(
            f"model.config: '{cfg.model.config}' holds no config.json (a Hugging Face model config)"
        )
    if command in WRITING_COMMANDS and cfg.model.router_aux_loss_coef:
        _check_routed(
            cfg, f"model.router_aux_loss_coef={cfg.model.router_aux_loss_coef}", "no router to balance"
        )
    if command == "train" and cfg.grpo.routing_replay:
        _check_routed(cfg, "grpo.routing_replay=true", "no routes to replay")
    ep = cfg.runtime.trainer_ep
    if command in WRITING_COMMANDS and ep > 1:
        experts, what = _check_routed(cfg, f"runtime.trainer_ep={ep}", "no experts to split")
        if experts % ep:
            raise UserError(f"runtime.trainer_ep={ep} must divide the {experts} experts per layer of {what}")
    data = cfg.data
    if data.source != "builtin":
        if not data.train_path:
            raise UserError(f"data.train_path is required when data.source is '{data.source}'")
        for key in ("train_path", "eval_path"):
            if getattr(data, key):
                _check_file(f"data.{key}", getattr(data, key), want_dir=data.source == "hf_disk")
    if command in ("dpo", "rm") and cfg.preference.source == "jsonl":
        for key in ("train_path", "eval_path"):
            if getattr(cfg.preference, key) or key == "train_path":
                _check_file(f"preference.{key}", getattr(cfg.preference, key))
    if command == "train" and cfg.reward.source != "verifier":
        _check_file("reward.model_path", cfg.reward.model_path, want_dir=True)
    if command in WRITING_COMMANDS and cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError(WANDB_INSTALL_HINT + " (no module named 'wandb')")
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(VLLM_INSTALL_HINT + " (no module named 'vllm')")
    _check_bf16(cfg, command)
    if plan:
        from loopline.plan import check
        from loopline.plan_auto import resolve

        planned = resume_config(*resume, True, fresh_ok=True)[0] if resume else cfg
        check(resolve(planned, command).cfg, command)  # as the run will start: its auto settings resolved
    if command in WRITING_COMMANDS:
        _check_out_dir(cfg.out_dir)
    if command == "eval":
        _check_eval_set(cfg)


def _check_bf16(cfg: RunConfig, command: str) -> None:
    """bf16 asked for (training.mixed_precision, rollout.dtype, model.dtype) on a CPU where torch has no bf16 path
    is refused; where bf16 is emulated (no avx512_bf16/AMX), the new switches warn that it saves memory, not time."""
    from loopline.doctor import bf16_support

    mixed = cfg.training.mixed_precision == "bf16"  # auto asks for bf16 only where the probe found it native
    asked = [
        key
        for key, on in (
            (f"training.mixed_precision={cfg.training.mixed_precision}", mixed),
            ("rollout.dtype=bfloat16", cfg.rollout.dtype == "bfloat16"),
            ("model.dtype=bfloat16", cfg.model.dtype == "bfloat16"),
        )
        if on
    ]
    if not asked:
        return
    if mixed and command == "rm":
        raise UserError(
            f"training.mixed_precision={cfg.training.mixed_precision} covers the policy and its reference, not the "
            "reward model `loopline rm` trains: set training.mixed_precision=none"
        )
    level, why = bf16_support()
    if level == "none":
        raise UserError(f"{asked[0]}: this machine has no bf16 support ({why}): use float32 here")
    if level == "emulated" and command in WRITING_COMMANDS and not asked[0].startswith("model.dtype"):
        config_rules.warn(f"{asked[0]}: {why}")


def _check_routed(cfg: RunConfig, setting: str, lack: str) -> tuple[int, str]:
    """`setting` (the router's loss weight, routing replay, expert parallelism) needs a mixture of experts: a dense
    policy has `lack`. Returns the model's experts per layer and how to name the model (0 when unreadable)."""
    what = f"model.preset={cfg.model.preset}" if cfg.model.preset else "the built-in model"
    if cfg.model.config or cfg.model.path:
        what = f"{cfg.model.config or cfg.model.path}/config.json"
    try:
        fields = shape_fields(cfg.model)
    except (OSError, ValueError):
        return 0, what  # an unreadable config.json is refused where the model loads, naming it
    if not is_moe(fields):
        raise UserError(
            f"{setting}: {what} is not a mixture of experts (no num_experts or num_local_experts): it has {lack}"
        )
    assert fields is not None
    return int(fields.get("num_experts") or fields.get("num_local_experts")), what


# What a model learned that eval must score it on: a default here means the built-in addition task.
SCORED_ON = ("env.name", "data.source", "data.eval_path")


def _check_eval_set(cfg: RunConfig) -> None:
    """`loopline eval` scores a model exported from a run on what that run learned unless told otherwise: given no
    data or env settings, an exported model of another task is refused (it scored the built-in addition task
    without a word). (No held-out rows at all is refused once the data has loaded: commands.eval.)"""
    run_config = Path(cfg.model.path) / RUN_CONFIG if cfg.model.path else None
    if run_config is None or not run_config.is_file():
        return
    trained = load_config(run_config)
    if config_rules.changed_keys(cfg) & {*SCORED_ON, "data.train_path"}:
        return  # the user chose what to score it on
    value = config_rules.value_at
    differ = [f"{k}={value(trained, k)}" for k in SCORED_ON if value(trained, k) != value(cfg, k)]
    if differ:
        raise UserError(
            f"model.path {cfg.model.path} was trained with {' '.join(differ)} ({run_config}), but eval was given "
            "no data or env settings and would score its default, the built-in addition task: give them (the same, "
            "or others on purpose)"
        )


def _model_dir_first(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`loopline eval DIR`: DIR is the model (a model, checkpoint or run directory); a run's or checkpoint's
    config.yaml is the base config (its data, eval and model settings), later overrides on top. A missing path
    that is not named like a YAML file is taken for a missing directory, and said so."""
    if config is not None and not Path(config).exists() and Path(config).suffix not in (".yaml", ".yml"):
        raise UserError(
            f"model, checkpoint or run directory '{config}' does not exist (a config file is named *.yaml; "
            "model.path=DIR names the model too)"
        )
    if config is None or not Path(config).is_dir():
        return config, overrides
    path = Path(config)
    if not _is_model_source(path):
        raise UserError(
            f"'{path}' is not a model, checkpoint or run directory (no config.json, dcp/ or checkpoints/)"
        )
    base = path / "config.yaml"
    # DIR holds the trained weights: a run built from a shape with random weights (model.init=random) is read back
    # from them, not built afresh
    trained = [f"model.path={path}", "model.init=pretrained", "model.preset=", "model.config="]
    return (str(base) if base.is_file() else None), [*trained, *overrides]


def checked_config(
    command: str,
    config: str | None,
    overrides: list[str],
    *,
    resume: bool = False,
    plan: bool = False,
    planned_resume: bool = False,
) -> tuple[str | None, list[str]]:
    """What a run command is given (a config file and overrides, for eval and generate a model directory first), as
    its commands.py function takes them, after the checks that need no torch: a bad config, a refused combination
    of settings (config_rules), a --resume of a directory that holds no run, a missing file and an out_dir that
    cannot be written fail in a second, before torch is imported. The CLI and loopline.api both call it before the
    command. plan: check that the run fits its nodes (loopline.plan); planned_resume: plan the run's saved config
    with these overrides applied (a --resume)."""
    if command in ("eval", "generate"):
        config, overrides = _model_dir_first(config, overrides)
    cfg = load_config(config, overrides)
    # a refused combination raises ConfigError; the warnings say what a run would train (eval and generate of a
    # run's saved config need not hear them)
    warnings = config_rules.check(cfg, command)
    if command in WRITING_COMMANDS:
        for warning in warnings:
            config_rules.warn(warning)
    # before check_run makes out_dir: a misspelt one is refused and leaves nothing behind
    if resume and not holds_run(cfg.out_dir):
        raise UserError(no_run_to_resume(cfg.out_dir))
    # missing files, a run that does not fit, an out_dir that cannot be written: all fail before torch
    check_run(cfg, command, plan=plan, resume=(config, overrides) if planned_resume else None)
    return config, overrides


def check_export(checkpoint: str, out: str) -> None:
    """Export reads a checkpoint and writes a new model directory: both checked before any work."""
    if not Path(checkpoint).is_dir():
        what = "does not exist" if not Path(checkpoint).exists() else "is not a directory"
        raise UserError(f"export: checkpoint '{checkpoint}' {what}")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"export: destination '{out}' is a file: give a directory to write the model to")
    existing = next((p for p in Path(out).parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"export: destination '{out}' is under '{existing}', a file")
