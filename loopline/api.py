"""loopline from Python: the CLI's commands as functions that return what they made.

A reward function is a plain function of the prompt, the completion and the row's fields; the run samples,
scores with it on the env workers, trains, and hands back its metrics, checkpoints and model:

    import loopline

    def reward(prompt: str, completion: str, answer: str, **row) -> float:
        return 1.0 if completion.split("\\n")[0].strip() == answer else 0.0

    result = loopline.train(
        {"out_dir": "runs/mine", "sft": {"steps": 200}, "grpo": {"steps": 20}}, reward_fn=reward, overwrite=True
    )
    print(result.metrics["eval_accuracy"], result.checkpoints[-1])

`config` is whatever the CLI takes, in any form: a `RunConfig` (the same typed sections: `loopline.RunConfig(
grpo=loopline.config.GRPOConfig(steps=20))`), a dict of sections, or a YAML path; `overrides` are the CLI's dotted
`key=value` words on top. Each function runs the CLI command's own code (loopline.commands, after preflight's checks),
so a run made here is a run directory like any other (`loopline train --resume out_dir=...` continues it). Bad
input raises ValueError (loopline.errors.UserError, loopline.config.ConfigError) with the CLI's message.

`reward_fn` (or an env factory: a callable of no arguments, an env class) runs on the env workers (clean processes
that never import the user's script, or Ray actors). A module-level function of an importable module goes by
reference: the run records it as `env.name=python:FILE:NAME` (or MODULE:NAME) and the workers import it. Any other
function (the script's own, a lambda, a closure, a notebook cell's) goes by value: pickled with cloudpickle into
out_dir/reward_fn-<hash>.pkl, which env.name then names; what cannot be pickled is refused in one line before
anything is written. So a script needs no `if __name__ == "__main__":` guard; a run started inside an env worker
is refused (errors.refuse_in_env_worker), and only the process that owns out_dir may overwrite it
(checkpoint.run_dir.owning).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loopline.config import RunConfig, load_config, save_config
from loopline.errors import UserError, refuse_in_env_worker

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
    """A command's arguments as commands.py takes them (a config file, overrides), and a reward function that the
    env workers cannot import by name, pickled by value, to be written where place_reward() says."""

    config: str | None
    overrides: list[str]
    pickled: bytes | None = None
    _reward_path: Path | None = None

    def place_reward(self, directory: Path) -> None:
        """The pickled reward function goes into `directory` (named by its hash: another function, another file);
        env.name names it there (replacing an earlier placement)."""
        if self.pickled is None:
            return
        if self._reward_path is not None:
            self.overrides.pop()
        digest = hashlib.sha256(self.pickled).hexdigest()[:12]
        self._reward_path = directory.resolve() / f"reward_fn-{digest}.pkl"
        self.overrides.append(f"env.name={json.dumps(f'python:{self._reward_path}:reward')}")

    def write_reward(self) -> None:
        """Write the pickled reward function (after the checks: nothing is written for a bad config)."""
        if self._reward_path is not None and self.pickled is not None:
            self._reward_path.parent.mkdir(parents=True, exist_ok=True)
            self._reward_path.write_bytes(self.pickled)


def _by_reference(fn: Callable[..., float]) -> str | None:
    """`env.name` for a reward function the env workers can import: python:FILE:NAME (a top-level module or a
    script, loaded by its file wherever it runs) or python:PACKAGE.MODULE:NAME (a module of a package, imported by
    name); None for one they cannot (a lambda, a nested function, a notebook's), which goes by value."""
    name = getattr(fn, "__name__", "")
    module_name = getattr(fn, "__module__", None) or ""
    module = sys.modules.get(module_name)
    if (
        module_name
        in ("__main__", "__mp_main__")  # the script being run: importing it again would run it again
        or not name.isidentifier()
        or getattr(module, name, None) is not fn
        or not getattr(module, "__file__", None)
    ):
        return None
    if "." in module_name and module_name != "__main__":
        try:
            if getattr(importlib.import_module(module_name), name, None) is fn:
                return f"python:{module_name}:{name}"
        except ImportError:
            pass
    return f"python:{Path(inspect.getfile(module)).resolve()}:{name}"  # type: ignore[arg-type]


def _pickled(fn: Callable[..., float]) -> bytes:
    """`fn` by value (its code and the globals it uses: cloudpickle), or a UserError naming it and what in it cannot
    be pickled, before anything is written."""
    from loopline.envs.frames import pickled_by_value

    try:
        return pickled_by_value(fn)
    except Exception as e:
        why = (str(e).strip().splitlines() or [""])[0]
        name = getattr(fn, "__qualname__", None) or repr(fn)
        where = getattr(getattr(fn, "__code__", None), "co_filename", None)
        at = f" ({where}:{fn.__code__.co_firstlineno})" if where else ""  # type: ignore[attr-defined]
        raise UserError(
            f"reward_fn {name}{at} cannot be sent to the env workers: cloudpickle cannot pickle it "
            f"({type(e).__name__}: {why}); make what it uses (an open file, a lock, a connection) inside the "
            "function, or define it in a module the workers can import"
        ) from e


def _words(overrides: Sequence[str] | None) -> list[str]:
    """The overrides as the CLI's words: None is none; one string is refused (it would be split into letters)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        raise UserError(f"overrides: a list of key=value words, not one string (got {overrides!r})")
    return [str(o) for o in overrides]


@contextmanager
def _call(
    config: ConfigLike, overrides: Sequence[str] | None, reward_fn: Callable[..., float] | None
) -> Iterator[_Call]:
    """The command's (config file, overrides): a RunConfig or a dict is written to a temporary YAML file for the
    command's own loader; reward_fn becomes an env.name override (by reference, or pickled: see _Call)."""
    refuse_in_env_worker("loopline's Python API")
    words = _words(overrides)
    pickled = None
    if reward_fn is not None:
        if not callable(reward_fn):
            raise UserError(
                f"reward_fn: a function (prompt, completion, **row_fields) -> float, not {reward_fn!r}"
            )
        spec = _by_reference(reward_fn)
        if spec is not None:
            words.append(f"env.name={json.dumps(spec)}")  # a quoted YAML string
        else:
            pickled = _pickled(reward_fn)
    with tempfile.TemporaryDirectory(prefix="loopline-api-") as tmp:
        path = Path(tmp) / "config.yaml"
        if isinstance(config, RunConfig):
            save_config(config, path)
        elif isinstance(config, dict):
            path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str)), sort_keys=False))
        elif config is not None and not isinstance(config, str | Path):
            raise UserError(f"config: a RunConfig, a dict, a YAML path or None, not {type(config).__name__}")
        file = str(path) if isinstance(config, RunConfig | dict) else (str(config) if config else None)
        call = _Call(file, words, pickled)
        # read-only commands: beside the temporary config (_run moves it into out_dir)
        call.place_reward(Path(tmp))
        yield call


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
    overrides: Sequence[str] | None,
    reward_fn: Callable[..., float] | None,
    **options: Any,
) -> RunResult:
    from loopline import preflight

    with _call(config, overrides, reward_fn) as call:
        if call.pickled is not None:  # into the run directory, where a resume (or the CLI's) finds it again
            call.place_reward(Path(load_config(call.config, call.overrides).out_dir))
        file, words = preflight.checked_config(
            command, call.config, call.overrides, resume=options.get("resume", False)
        )
        call.write_reward()
        # a resumed run's too: its saved config is found there
        run_dir = Path(load_config(file, words).out_dir)
        from loopline import commands

        args = argparse.Namespace(**{"restart_unsaved": False, "allow_config_change": False, **options})
        status = getattr(commands, command)(file, words, args)
    return _result(command, run_dir, status)


def train(
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline train`: SFT warm start then RL (GRPO and its family, PPO), scored by env.name or by reward_fn.

    resume: continue the run in out_dir from its newest checkpoint; overwrite: delete a run already in out_dir."""
    return _run(
        "train",
        config,
        overrides,
        reward_fn,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
    )


def sft(
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline sft`: supervised fine-tuning only; the model is `result.model` (out_dir/model). reward_fn, when
    given, scores the held-out evals."""
    return _run(
        "sft",
        config,
        overrides,
        reward_fn,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
    )


def dpo(
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline dpo`: SFT warm start then DPO on preference pairs; the model is `result.model`."""
    return _run(
        "dpo",
        config,
        overrides,
        reward_fn,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
    )


def rm(
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    reward_fn: Callable[..., float] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
) -> RunResult:
    """`loopline rm`: SFT warm start then a Bradley-Terry reward model; it is `result.model` (out_dir/reward_model)."""
    return _run(
        "rm",
        config,
        overrides,
        reward_fn,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
    )


def _model_first(
    model: str | Path | None, config: ConfigLike, overrides: Sequence[str] | None
) -> tuple[ConfigLike, list[str]]:
    """`model` with no config is the CLI's `loopline eval DIR` (a run's or checkpoint's config.yaml is the base
    config); with a config, it is model.path on top."""
    words = _words(overrides)
    if model is None:
        return config, words
    if config is None:
        return str(model), words
    return config, [*words, f"model.path={json.dumps(str(model))}"]


def evaluate(
    model: str | Path | None = None,
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    reward_fn: Callable[..., float] | None = None,
) -> dict[str, float]:
    """`loopline eval`: held-out accuracy of `model` (a Hugging Face model, a checkpoint or a run directory; None:
    model.path or the built-in model), scored by env.name or reward_fn. Writes nothing."""
    from loopline import preflight

    config, words = _model_first(model, config, overrides)
    with _call(config, words, reward_fn) as call:
        file, words = preflight.checked_config("eval", call.config, call.overrides)
        call.write_reward()
        from loopline import commands

        return commands.evaluation(file, words)


def generate(
    prompts: Sequence[str],
    model: str | Path | None = None,
    config: ConfigLike = None,
    overrides: Sequence[str] | None = (),
    *,
    n: int = 1,
    temperature: float | None = None,
) -> list[Generation]:
    """`loopline generate`: n completions of each prompt by `model` (as for evaluate), in order. n > 1 samples at
    temperature 1 unless `temperature` says otherwise (eval.sampling is greedy by default)."""
    from loopline import preflight

    if isinstance(prompts, str):
        raise UserError("prompts: a list of prompt texts, not one string")
    if n < 1:
        raise UserError(f"n must be an integer >= 1 (got {n!r})")
    if temperature is not None and not temperature >= 0:
        raise UserError(f"temperature must be a finite number >= 0, 0 for greedy (got {temperature!r})")
    config, words = _model_first(model, config, overrides)
    with _call(config, words, None) as call:
        file, words = preflight.checked_config("generate", call.config, call.overrides)
        from loopline import commands

        rows = commands.generations(file, words, list(prompts), n, temperature)
    return [Generation(**row) for row in rows]


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """`loopline export`: a checkpoint (or a run directory's newest) as a Hugging Face model directory in `out`."""
    from loopline import preflight
    from loopline.checkpoint.export import export as export_model

    preflight.check_export(str(checkpoint), str(out))
    return export_model(checkpoint, out)
