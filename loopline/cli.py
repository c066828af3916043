"""The `loopline` command: train, sft, dpo, rm, eval, generate, plot, config, sandbox, k8s, bench, scale."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import os
import pkgutil
import sys
import tempfile
import traceback
from pathlib import Path

from loopline.checkpoint.run_dir import RESUMABLE
from loopline.config import ConfigError, RunConfig, check_preference, describe, load_config
from loopline.errors import EXIT_TEMPFAIL, UserError, WorkersLost
from loopline.rollout.config import VLLM_INSTALL_HINT


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.steps=10")


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1 (a sample count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text!r})")
    return value


def _temperature(text: str) -> float:
    """argparse type: a finite temperature >= 0 (0 = greedy)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, 0 for greedy (got {text!r})")
    return value


def _add_resume_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in out_dir from its newest whole checkpoint, with its saved config.yaml; a config "
        f"and overrides given too may change only: {', '.join(RESUMABLE)}",
    )
    p.add_argument(
        "--restart-unsaved",
        action="store_true",
        help="with --resume: a run stopped before its first checkpoint starts again from step 0 (its metrics "
        "cleared) instead of failing; for job controllers that rerun the same command (loopline k8s)",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: let any other field change too (recorded in out_dir/config_history.jsonl)",
    )


def _add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="out_dir holds an earlier run: delete its files (config, metrics, checkpoints, ...) and start afresh",
    )


def _split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    # `loopline train a.b=1` has no file: argparse puts the first override in `config`.
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    return config, overrides


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `train --resum` must not pass for `--resume` (nor any future --resume-x)
    parser = argparse.ArgumentParser(prog="loopline", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of a user error (accepted anywhere in the line)",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False),
    )

    p = sub.add_parser("train", help="SFT warm start then GRPO (the built-in default job with no config)")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)

    p = sub.add_parser("sft", help="supervised fine-tuning only")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)

    p = sub.add_parser("dpo", help="SFT warm start then DPO on preference pairs")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)

    p = sub.add_parser("rm", help="SFT warm start then a Bradley-Terry reward model on preference pairs")
    _add_config_args(p)
    _add_overwrite_arg(p)

    p = sub.add_parser(
        "eval",
        help="held-out accuracy of a model: model.path=DIR, or DIR first (a Hugging Face model, a checkpoint, "
        "or a run: its newest checkpoint, with the run's config); reads only, writes nothing",
    )
    _add_config_args(p)

    p = sub.add_parser(
        "generate", help="sample completions for prompts (the model as for eval); writes nothing"
    )
    _add_config_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument(
        "-n",
        type=_at_least_one,
        default=1,
        help="samples per prompt; n > 1 samples at temperature 1 unless --temperature",
    )
    p.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        help="sampling temperature (default: eval.sampling's)",
    )

    p = sub.add_parser("export", help="write a checkpoint (or a run's newest) as a Hugging Face model")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("out", help="directory to write the model to")

    p = sub.add_parser("plot", help="write PNG curves for a run directory")
    p.add_argument("run_dir")

    p = sub.add_parser("config", help="print every config field with its default and description")
    _add_config_args(p)

    # listed for `loopline -h` only: main() runs `agent ...` as `train env.name=calculator ...` (cli.AGENT)
    p = sub.add_parser(
        "agent",
        add_help=False,
        help="the agentic example: `train env.name=calculator` (SFT on tool traces, multi-turn GRPO) with its settings",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "sandbox", add_help=False, help="run or check code in the sandbox (see `loopline sandbox -h`)"
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "k8s",
        add_help=False,
        help="the run as a KubeRay RayJob: render, submit, status, logs, delete (see `loopline k8s -h`)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "scale", help="change a running ray job's workers: loopline scale OUT_DIR engines=N env_workers=M"
    )
    p.add_argument("run_dir", help="the run's out_dir")
    p.add_argument("counts", nargs="+", help="engines=N and/or env_workers=M (applied between two steps)")

    p = sub.add_parser("bench", help="benchmarks: loopline bench NAME [options]")
    p.add_argument("name", help=f"benchmark name ({', '.join(_benchmarks())})")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _scale(run_dir: str, counts: list[str]) -> int:
    """Write a scale request into a running job's directory; its loop applies it before the next step."""
    from pathlib import Path

    from loopline.loops.context import SCALABLE, write_scale_request

    def fail(why: str) -> int:
        print(f"loopline scale: {why}", file=sys.stderr)
        return 2

    config = Path(run_dir) / "config.yaml"
    if not config.exists():
        return fail(f"{run_dir} is not a run directory (no config.yaml): give the run's out_dir")
    request = {}
    for item in counts:
        key, _, value = item.partition("=")
        if key not in SCALABLE or not value.isdigit() or int(value) < 1:
            return fail(f"{item!r}: give engines=N and/or env_workers=M, integers >= 1")
        request[key] = int(value)
    backend = load_config(str(config)).runtime.backend
    if backend != "ray" and "engines" in request:
        return fail(
            f"the run in {run_dir} uses runtime.backend={backend}: its one engine runs in the run's process and "
            "cannot grow or shrink (env_workers can; runtime.backend=ray runs engines that can)"
        )
    path = write_scale_request(run_dir, request)
    print(f"wrote {path}: applied before the run's next step")
    return 0


# ---------------------------------------------------------------------------------------------------------
# Checks that need no torch: a bad path fails in a second, naming the key and the path
# ---------------------------------------------------------------------------------------------------------

RUN_COMMANDS = ("train", "sft", "dpo", "rm", "eval", "generate")  # build a run context (model and data)
WRITING_COMMANDS = ("train", "sft", "dpo", "rm")  # write into out_dir


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


def check_run(cfg: RunConfig, command: str) -> None:
    """What a run command needs on disk, before torch is imported: the model, the data files, a writable
    out_dir. Raises UserError (ConfigError for bad combinations of values) naming the key and the path."""
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
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(VLLM_INSTALL_HINT + " (no module named 'vllm')")
    if command in WRITING_COMMANDS:
        _check_out_dir(cfg.out_dir)


def _model_dir_first(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`loopline eval DIR`: DIR is the model (a model, checkpoint or run directory); a run's or checkpoint's
    config.yaml is the base config (its data, eval and model settings), later overrides on top."""
    if config is None or not Path(config).is_dir():
        return config, overrides
    path = Path(config)
    if not _is_model_source(path):
        raise UserError(
            f"'{path}' is not a model, checkpoint or run directory (no config.json, dcp/ or checkpoints/)"
        )
    base = path / "config.yaml"
    return (str(base) if base.is_file() else None), [f"model.path={path}", *overrides]


def _check_export(checkpoint: str, out: str) -> None:
    """Export reads a checkpoint and writes a new model directory: both checked before any work."""
    if not Path(checkpoint).is_dir():
        what = "does not exist" if not Path(checkpoint).exists() else "is not a directory"
        raise UserError(f"export: checkpoint '{checkpoint}' {what}")
    if Path(out).exists() and not Path(out).is_dir():
        raise UserError(f"export: destination '{out}' is a file: give a directory to write the model to")
    existing = next((p for p in Path(out).parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UserError(f"export: destination '{out}' is under '{existing}', a file")


def _benchmarks() -> list[str]:
    import loopline.bench

    return sorted(m.name for m in pkgutil.iter_modules(loopline.bench.__path__) if not m.name.startswith("_"))


# `loopline agent`: the agentic example's settings for `loopline train env.name=calculator`. Measured (see the
# README): the copies the task needs (expression into the call, result into the answer) are learned suddenly,
# between SFT steps ~250 and ~375 at lr 1e-3; T=0.7 keeps GRPO groups mixed (right and wrong answers); GRPO at
# lr 3e-5, since Adam's first steps move every weight by ~lr whatever its (sparse) gradient.
AGENT = [
    "env.name=calculator", "out_dir=runs/agent", "threads=1",
    "sft.steps=600", "sft.batch_size=32", "sft.micro_batch_size=32", "sft.eval_every=0", "sft.stop_at_accuracy=0.4",
    "sft.optim.lr=1e-3", "sft.optim.schedule=constant", "sft.optim.warmup_steps=10",
    "grpo.steps=40", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=8", "grpo.group_size=8", "grpo.micro_batch_size=32",
    "grpo.eval_every=10", "grpo.optim.lr=3e-5", "grpo.optim.warmup_steps=0", "grpo.optim.schedule=constant",
    "grpo.sampling.temperature=0.7", "grpo.sampling.max_new_tokens=96", "eval.sampling.max_new_tokens=96",
    "env.max_episode_tokens=192", "eval.num_prompts=128",
    "grpo.sampling.stop=[]", "eval.sampling.stop=[]",  # a turn ends at the calculator's tags, not at a newline
]  # fmt: skip


def agent_argv(words: list[str]) -> list[str]:
    """`loopline agent [k=v ...] [--options]` as the `loopline train` command line it stands for (AGENT first, so
    the words given win); with --print-config, the `loopline config` line that shows the resolved config; with
    --resume, the run in out_dir (runs/agent by default) as its config was saved."""
    if words and not words[0].startswith("-") and "=" not in words[0]:
        raise UserError(
            f"loopline agent takes key=value overrides, not a config file ({words[0]}): for a file, run "
            f"`loopline train {words[0]} env.name=calculator ...`"
        )
    if "--print-config" in words:
        return ["config", *AGENT, *(w for w in words if w != "--print-config")]
    if "--resume" in words:  # the run's saved config holds the example's settings (and any the run was given)
        return ["train", "out_dir=runs/agent", *words]
    return ["train", *AGENT, *words]


def _run(argv: list[str]) -> int:
    if argv[:1] == ["agent"]:
        return _run(agent_argv(argv[1:]))
    if argv[:1] == ["sandbox"]:  # likewise: `loopline sandbox -h` lists run and check
        from loopline.envs.cli import main as sandbox_main

        return sandbox_main(argv[1:])
    if argv[:1] == ["k8s"]:
        from loopline.k8s.cli import main as k8s_main

        return k8s_main(argv[1:])
    parser = build_parser()
    # argparse fills the overrides list only up to the first option; key=value words after an option
    # (`train run.yaml --resume grpo.steps=5`) come back unrecognised and are overrides too
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command in (*RUN_COMMANDS, "config"):
        config, overrides = _split_config(args)
        if args.command in ("eval", "generate"):
            config, overrides = _model_dir_first(config, overrides)
        cfg = load_config(config, overrides)  # a bad config fails in a second, before torch is imported
        if args.command == "config":  # every field: dotted key = value  # description (no torch: a second)
            print("\n".join(describe(cfg)))
            return 0
        check_run(
            cfg, args.command
        )  # missing files and an out_dir that cannot be written fail before torch too
        from loopline import commands

        return getattr(commands, args.command)(config, overrides, args)
    if args.command == "export":
        _check_export(args.checkpoint, args.out)
        from loopline.checkpoint.export import main as export_main

        return export_main([args.checkpoint, args.out])
    if args.command == "plot":
        if not (Path(args.run_dir) / "metrics.jsonl").is_file():
            raise UserError(f"plot: '{args.run_dir}' is not a run directory (no metrics.jsonl)")
        from loopline.metrics.plot import plot_run

        for path in plot_run(args.run_dir):
            print(path)
        return 0
    if args.command == "scale":
        return _scale(args.run_dir, args.counts)
    if args.command == "bench":
        if args.name not in _benchmarks():
            raise UserError(f"unknown benchmark '{args.name}': choose from {', '.join(_benchmarks())}")
        return importlib.import_module(f"loopline.bench.{args.name}").main(args.args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors (bad config, path, file, row) are one line on stderr and exit status 2,
    workers lost past runtime.max_restarts one line and exit status 75 (EX_TEMPFAIL: worth retrying), each with
    the traceback only under --debug. Other exceptions are bugs and keep their traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        status = _run(argv)
        sys.stdout.flush()  # a reader gone (`loopline config | head`) shows here, inside the handler below
        return status
    except BrokenPipeError:
        # the reader of our output left: not an error. Point stdout at /dev/null so that the flush at exit
        # does not fail again (the recipe of Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ConfigError as e:
        if debug:
            traceback.print_exc()
        sep = "\n" if "\n" in str(e) else " "  # one line for one bad key; a line per key for several
        print(f"loopline: bad config:{sep}{e}", file=sys.stderr)
        return 2
    except UserError as e:
        if debug:
            traceback.print_exc()
        print(f"loopline: {e}", file=sys.stderr)
        return 2
    except (
        WorkersLost
    ) as e:  # workers lost past runtime.max_restarts: a retry (a job controller's) may succeed
        if debug:
            traceback.print_exc()
        print(f"loopline: {e}", file=sys.stderr)
        return EXIT_TEMPFAIL


if __name__ == "__main__":
    sys.exit(main())
