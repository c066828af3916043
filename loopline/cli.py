"""The `loopline` command: train, sft, dpo, rm, eval, generate, plan, plot, config, sandbox, k8s, bench, scale,
doctor."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import math
import os
import pkgutil
import sys
import traceback
from pathlib import Path

from loopline.checkpoint.run_dir import RESUMABLE
from loopline.config import ConfigError, RunConfig, describe, load_config
from loopline.errors import EXIT_TEMPFAIL, UserError, WorkersLost
from loopline.preflight import PLANNED, RUN_COMMANDS, check_export, checked_config


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


def _add_plan_check_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-plan-check",
        action="store_true",
        help="start even when `loopline plan` says the run does not fit this machine's (or its pools') memory",
    )


def _split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    # `loopline train a.b=1` has no file: argparse puts the first override in `config`.
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    if config is not None and not Path(config).exists() and _looks_like_key(config):
        # `loopline train grpo.steps 4`: a space for the '=' (else "config file 'grpo.steps' does not exist")
        value = overrides[0] if overrides and "=" not in overrides[0] else "VALUE"
        raise ConfigError(f"'{config}' looks like a setting, not a config file: write {config}={value}")
    return config, overrides


def _looks_like_key(word: str) -> bool:
    """A word that names a config key (or a section's key spelt like one), not a file: dotted words with no
    path separator and no YAML suffix, or a top-level key."""
    from loopline.section import leaf_keys

    if word in leaf_keys(RunConfig):
        return True
    parts = word.split(".")
    return (
        len(parts) > 1
        and not word.endswith((".yaml", ".yml", ".json"))
        and all(p.isidentifier() for p in parts)
        and parts[0] in RunConfig.model_fields
    )


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
    _add_plan_check_arg(p)

    p = sub.add_parser("sft", help="supervised fine-tuning only")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)
    _add_plan_check_arg(p)

    p = sub.add_parser("dpo", help="SFT warm start then DPO on preference pairs")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)
    _add_plan_check_arg(p)

    p = sub.add_parser("rm", help="SFT warm start then a Bradley-Terry reward model on preference pairs")
    _add_config_args(p)
    _add_resume_args(p)
    _add_overwrite_arg(p)
    _add_plan_check_arg(p)

    p = sub.add_parser(
        "plan",
        help="the memory each role's rank will need, per node against its memory, and the step's FLOPs; starts "
        "nothing (exit 2 when the run cannot fit)",
    )
    _add_config_args(p)
    p.add_argument(
        "--command",
        dest="command_planned",
        choices=PLANNED,
        default="train",
        help="the command to plan for (default: train)",
    )

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
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="dtype of the written weights (default: the checkpoint's: float32 masters under mixed precision)",
    )

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
        help="the run as a KubeRay RayJob: render, stage, submit, status, logs, delete (see `loopline k8s -h`)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "scale", help="change a running ray job's workers: loopline scale OUT_DIR engines=N env_workers=M"
    )
    p.add_argument("run_dir", help="the run's out_dir")
    p.add_argument("counts", nargs="+", help="engines=N and/or env_workers=M (applied between two steps)")

    sub.add_parser(
        "doctor",
        help="versions, CPU features, GPUs, bubblewrap, Ray, and what each missing piece turns off (paste it in a "
        "bug report)",
    )

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


def _benchmarks() -> list[str]:
    import loopline.bench

    helpers = {"args"}  # modules the benchmarks share, not benchmarks (private ones start with "_")
    return sorted(
        m.name
        for m in pkgutil.iter_modules(loopline.bench.__path__)
        if not m.name.startswith("_") and m.name not in helpers
    )


# `loopline agent`: the agentic example's settings for `loopline train env.name=calculator`. Measured (see
# docs/guide/agents.md): the copies the task needs (expression into the call, result into the answer) are learned suddenly,
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
    if args.command == "config":  # every field: dotted key = value  # description (no torch: a second)
        print("\n".join(describe(load_config(*_split_config(args)))))
        return 0
    if args.command == "plan":
        from loopline import plan
        from loopline.plan_auto import resolve

        config, overrides = _split_config(args)
        resolved = resolve(load_config(config, overrides), args.command_planned)  # as the run would start
        cfg = resolved.cfg
        lines = plan.report(cfg, args.command_planned)
        print("\n".join([lines[0], *([resolved.line] if resolved.line else []), *lines[1:]]))
        plan.check(cfg, args.command_planned)
        return 0
    if args.command in RUN_COMMANDS:
        resume = getattr(args, "resume", False) and not args.restart_unsaved
        config, overrides = checked_config(
            args.command,
            *_split_config(args),
            resume=resume,
            plan=args.command in PLANNED and not args.no_plan_check,
            planned_resume=getattr(args, "resume", False),
        )
        from loopline import commands

        return getattr(commands, args.command)(config, overrides, args)
    if args.command == "export":
        check_export(args.checkpoint, args.out)
        from loopline.checkpoint.export import main as export_main

        return export_main([args.checkpoint, args.out, *(["--dtype", args.dtype] if args.dtype else [])])
    if args.command == "plot":
        if not (Path(args.run_dir) / "metrics.jsonl").is_file():
            raise UserError(f"plot: '{args.run_dir}' is not a run directory (no metrics.jsonl)")
        from loopline.metrics.plot import plot_run

        for path in plot_run(args.run_dir):
            print(path)
        return 0
    if args.command == "doctor":
        from loopline.doctor import main as doctor_main

        return doctor_main()
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
    the traceback only under --debug (an env worker's included). An error in the user's reward or env names
    their file and line below its line (envs.frames). SIGINT before a run handles it: exit status 130, no
    traceback. Other exceptions are bugs and keep their traceback."""
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
    except KeyboardInterrupt:
        # Ctrl-C before a run's own handler is on (loops.stop: while torch imports, the config is read, the roles
        # start) or in a command without one: stopped, as the shell reports a process SIGINT killed, no traceback
        if debug:
            traceback.print_exc()
        print("\nloopline: SIGINT: stopped (before the run's first step, if this was a run)", file=sys.stderr)
        return 130
    except (
        WorkersLost
    ) as e:  # workers lost past runtime.max_restarts: a retry (a job controller's) may succeed
        if debug:
            traceback.print_exc()
        print(f"loopline: {e}", file=sys.stderr)
        return EXIT_TEMPFAIL


if __name__ == "__main__":
    sys.exit(main())
