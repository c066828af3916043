"""loopline from Python: the CLI's commands as functions that return what they made.

A reward function is a plain function of the prompt, the completion and the row's fields; the run samples,
scores with it on the env workers, trains, and hands back its metrics, checkpoints and model:

    import loopline

    def reward(prompt: str, completion: str, answer: str, **row) -> float:
        return 1.0 if completion.split("\\n")[0].strip() == answer else 0.0

    if __name__ == "__main__":  # env workers are processes that import this file: guard the run
        result = loopline.train(
            {"out_dir": "runs/mine", "sft": {"steps": 200}, "grpo": {"steps": 20}}, reward_fn=reward, overwrite=True
        )
        print(result.metrics["eval_accuracy"], result.checkpoints[-1])

`config` is whatever the CLI takes, in any form: a `RunConfig` (the same typed sections: `loopline.RunConfig(
grpo=loopline.config.GRPOConfig(steps=20))`), a dict of sections, or a YAML path; `overrides` are the CLI's dotted
`key=value` words on top. Each function runs the CLI command's own code (loopline.commands, after cli's checks),
so a run made here is a run directory like any other (`loopline train --resume out_dir=...` continues it). Bad
input raises ValueError (loopline.errors.UserError, loopline.config.ConfigError) with the CLI's message.

`reward_fn` must be importable by the env workers (spawned processes, or Ray actors): a module-level function of a
.py file or an importable module (a script's own `__main__` functions work; they are loaded from its file, so the
script's run must sit under `if __name__ == "__main__":`). Its run records it as `env.name=python:FILE:NAME`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loopline.config import RunConfig, load_config, save_config
from loopline.errors import UserError

ConfigLike = RunConfig | dict[str, Any] | str | Path | None

# What a command leaves in the run directory as its model (train leaves checkpoints: loopline.export makes one).
MODEL_DIRS = {"sft": "model", "dpo": "model", "rm": "reward_model"}


@dataclass(frozen=True)
class RunResult:
    """What a training command made: its run directory, config, metrics, checkpoints and model."""

    command: str  # train, sft, dpo or rm
    run_dir: Path  # out_dir: config.yaml, metrics.jsonl, checkpoints/, ...
    config: RunConfig  # the run's resolved config (its config.yaml)
    metrics: dict[str, Any]  # the last phase's final values: each key's last value in that phase's rows
    phases: dict[
        str, dict[str, Any]
    ]  # the same for every phase the run logged (sft, grpo, dpo, rm), in order
    history: list[dict[str, Any]]  # every metrics row (metrics.jsonl)
    checkpoints: list[Path]  # whole checkpoints, oldest first
    model: Path | None  # the exported model (sft, dpo: out_dir/model; rm: out_dir/reward_model); train: None
    interrupted: bool = False  # stopped by SIGINT/SIGTERM at a step's end (its checkpoint written): resume it


@dataclass(frozen=True)
class Generation:
    """One sampled completion of `generate`."""

    prompt: str
    completion: str
    finish: str  # why it ended: "stop" (a stop string or EOS) or "length"


@dataclass
class _Call:
    """A command's arguments as commands.py takes them (a config file, overrides, the parsed options)."""

    config: str | None
    overrides: list[str]
    options: dict[str, Any] = field(default_factory=dict)


def reward_fn_spec(fn: Callable[..., float]) -> str:
    """`env.name` for a reward function: python:FILE:NAME (a top-level module or a script, loaded by its file
    wherever it runs) or python:PACKAGE.MODULE:NAME (a module of a package, imported by name)."""
    name = getattr(fn, "__name__", "")
    module_name = getattr(fn, "__module__", None)
    module = sys.modules.get(module_name or "")
    why = ""
    if not callable(fn) or not name.isidentifier() or getattr(module, name, None) is not fn:
        why = "is not a module-level function (a lambda, a nested function or a method cannot be imported)"
    elif module is None or not getattr(module, "__file__", None):
        why = "is defined in a notebook or an interactive session, which other processes cannot import"
    if why:
        raise UserError(
            f"reward_fn {name or fn!r} {why}: the env workers import it by name; define it at the top level of a "
            ".py file (e.g. rewards.py) and import it from there"
        )
    assert module is not None and module_name is not None
    if "." in module_name and module_name != "__main__":
        try:
            if getattr(importlib.import_module(module_name), name, None) is fn:
                return f"python:{module_name}:{name}"
        except ImportError:
            pass
    return f"python:{Path(inspect.getfile(module)).resolve()}:{name}"


@contextmanager
def _call(
    config: ConfigLike, overrides: Sequence[str], reward_fn: Callable[..., float] | None
) -> Iterator[_Call]:
    """The command's (config file, overrides): a RunConfig or a dict is written to a temporary YAML file for the
    command's own loader; reward_fn becomes an env.name override."""
    words = [str(o) for o in overrides]
    if reward_fn is not None:
        words.append(f"env.name={json.dumps(reward_fn_spec(reward_fn))}")  # a quoted YAML string
    with tempfile.TemporaryDirectory(prefix="loopline-api-") as tmp:
        path = Path(tmp) / "config.yaml"
        if isinstance(config, RunConfig):
            save_config(config, path)
        elif isinstance(config, dict):
            path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str)), sort_keys=False))
        elif config is not None and not isinstance(config, str | Path):
            raise UserError(f"config: a RunConfig, a dict, a YAML path or None, not {type(config).__name__}")
        yield _Call(
            str(path) if isinstance(config, RunConfig | dict) else (str(config) if config else None), words
        )


def _final(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each phase's last value of each key, phases in the order they first appear."""
    phases: dict[str, dict[str, Any]] = {}
    for row in rows:
        phases.setdefault(str(row.get("phase", "run")), {}).update(row)
    return phases


def _result(command: str, run_dir: Path, status: int) -> RunResult:
    from loopline.checkpoint.state import checkpoint_fault, checkpoints_newest_first
    from loopline.metrics.logger import read_metrics

    history = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    phases = _final(history)
    model = run_dir / MODEL_DIRS[command] if command in MODEL_DIRS else None
    checkpoints = [p for p in reversed(checkpoints_newest_first(run_dir)) if checkpoint_fault(p) is None]
    return RunResult(
        command=command,
        run_dir=run_dir,
        config=load_config(run_dir / "config.yaml"),
        metrics=next(reversed(phases.values())) if phases else {},
        phases=phases,
        history=history,
        checkpoints=checkpoints,
        model=model if model is not None and (model / "config.json").is_file() else None,
        interrupted=status != 0,
    )


def _run(
    command: str,
    config: ConfigLike,
    overrides: Sequence[str],
    reward_fn: Callable[..., float] | None,
    **options: Any,
) -> RunResult:
    from loopline import cli

    with _call(config, overrides, reward_fn) as call:
        file, words = cli.checked_config(command, call.config, call.overrides)
        run_dir = Path(
            load_config(file, words).out_dir
        )  # a resumed run's too: its saved config is found there
        from loopline import commands

        args = argparse.Namespace(**{"restart_unsaved": False, "allow_config_change": False, **options})
        status = getattr(commands, command)(file, words, args)
    return _result(command, run_dir, status)


def train(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline train`: SFT warm start then RL (GRPO and its family, PPO), scored by env.name or by reward_fn.

    resume: continue the run in out_dir from its newest checkpoint; overwrite: delete a run already in out_dir."""
    return _run(
        "train", config, overrides, reward_fn, resume=resume, overwrite=overwrite,
        allow_config_change=allow_config_change,
    )  # fmt: skip


def sft(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline sft`: supervised fine-tuning only; the model is `result.model` (out_dir/model). reward_fn, when
    given, scores the held-out evals."""
    return _run(
        "sft", config, overrides, reward_fn, resume=resume, overwrite=overwrite,
        allow_config_change=allow_config_change,
    )  # fmt: skip


def dpo(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline dpo`: SFT warm start then DPO on preference pairs; the model is `result.model`."""
    return _run(
        "dpo", config, overrides, reward_fn, resume=resume, overwrite=overwrite,
        allow_config_change=allow_config_change,
    )  # fmt: skip


def rm(
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    overwrite: bool = False,
) -> RunResult:
    """`loopline rm`: SFT warm start then a Bradley-Terry reward model; it is `result.model` (out_dir/reward_model)."""
    return _run("rm", config, overrides, reward_fn, resume=False, overwrite=overwrite)


def _model_first(
    model: str | Path | None, config: ConfigLike, overrides: Sequence[str]
) -> tuple[ConfigLike, list[str]]:
    """`model` with no config is the CLI's `loopline eval DIR` (a run's or checkpoint's config.yaml is the base
    config); with a config, it is model.path on top."""
    if model is None:
        return config, list(overrides)
    if config is None:
        return str(model), list(overrides)
    return config, [*overrides, f"model.path={json.dumps(str(model))}"]


def evaluate(
    model: str | Path | None = None,
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    reward_fn: Callable[..., float] | None = None,
) -> dict[str, float]:
    """`loopline eval`: held-out accuracy of `model` (a Hugging Face model, a checkpoint or a run directory; None:
    model.path or the built-in model), scored by env.name or reward_fn. Writes nothing."""
    from loopline import cli

    config, words = _model_first(model, config, overrides)
    with _call(config, words, reward_fn) as call:
        file, words = cli.checked_config("eval", call.config, call.overrides)
        from loopline import commands

        return commands.evaluation(file, words)


def generate(
    prompts: Sequence[str],
    model: str | Path | None = None,
    config: ConfigLike = None,
    overrides: Sequence[str] = (),
    *,
    n: int = 1,
    temperature: float | None = None,
) -> list[Generation]:
    """`loopline generate`: n completions of each prompt by `model` (as for evaluate), in order. n > 1 samples at
    temperature 1 unless `temperature` says otherwise (eval.sampling is greedy by default)."""
    from loopline import cli

    if isinstance(prompts, str):
        raise UserError("prompts: a list of prompt texts, not one string")
    if n < 1:
        raise UserError(f"n must be an integer >= 1 (got {n!r})")
    if temperature is not None and not temperature >= 0:
        raise UserError(f"temperature must be a finite number >= 0, 0 for greedy (got {temperature!r})")
    config, words = _model_first(model, config, overrides)
    with _call(config, words, None) as call:
        file, words = cli.checked_config("generate", call.config, call.overrides)
        from loopline import commands

        rows = commands.generations(file, words, list(prompts), n, temperature)
    return [Generation(**row) for row in rows]


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """`loopline export`: a checkpoint (or a run directory's newest) as a Hugging Face model directory in `out`."""
    from loopline import cli
    from loopline.checkpoint.export import export as export_model

    cli.check_export(str(checkpoint), str(out))
    return export_model(checkpoint, out)
