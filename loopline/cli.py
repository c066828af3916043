"""The `loopline` command: train, sft, dpo, rm, eval, generate, plot, config, sandbox, bench, scale."""

from __future__ import annotations

import argparse
import importlib
import sys

from loopline.checkpoint.run_dir import RESUMABLE
from loopline.config import ConfigError, load_config


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.steps=10")


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
    parser = argparse.ArgumentParser(prog="loopline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="SFT warm start then GRPO (the built-in default job with no config)")
    _add_config_args(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in out_dir from its newest whole checkpoint, with its saved config.yaml; a config "
        f"and overrides given too may change only: {', '.join(RESUMABLE)}",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: let any other field change too (recorded in out_dir/config_history.jsonl)",
    )
    _add_overwrite_arg(p)

    p = sub.add_parser("sft", help="supervised fine-tuning only")
    _add_config_args(p)
    _add_overwrite_arg(p)

    p = sub.add_parser("dpo", help="SFT warm start then DPO on preference pairs")
    _add_config_args(p)

    p = sub.add_parser("rm", help="SFT warm start then a Bradley-Terry reward model on preference pairs")
    _add_config_args(p)

    p = sub.add_parser("eval", help="held-out accuracy of a model directory or checkpoint")
    _add_config_args(p)

    p = sub.add_parser("generate", help="sample completions for prompts")
    _add_config_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("-n", type=int, default=1, help="samples per prompt")

    p = sub.add_parser("export", help="write a checkpoint (or a run's newest) as a Hugging Face model")
    p.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("out", help="directory to write the model to")

    p = sub.add_parser("plot", help="write PNG curves for a run directory")
    p.add_argument("run_dir")

    p = sub.add_parser("config", help="print every config field with its default and description")
    _add_config_args(p)

    # listed for `loopline -h` only: main() hands `agent ...` to the agent's own parser
    p = sub.add_parser(
        "agent", add_help=False, help="the agentic example: SFT on tool traces, then multi-turn GRPO"
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "sandbox", add_help=False, help="run or check code in the sandbox (see `loopline sandbox -h`)"
    )
    p.add_argument("args", nargs=argparse.REMAINDER)

    p = sub.add_parser(
        "scale", help="change a running ray job's workers: loopline scale OUT_DIR engines=N env_workers=M"
    )
    p.add_argument("run_dir", help="the run's out_dir")
    p.add_argument("counts", nargs="+", help="engines=N and/or env_workers=M (applied between two steps)")

    p = sub.add_parser("bench", help="benchmarks: loopline bench NAME [options]")
    p.add_argument("name", help="benchmark name (sandbox, sync, restart)")
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
    if backend != "ray":
        return fail(
            f"the run in {run_dir} uses runtime.backend={backend}, one engine and one scorer in one process: "
            "nothing to scale (runtime.backend=ray runs worker groups that can grow and shrink)"
        )
    path = write_scale_request(run_dir, request)
    print(f"wrote {path}: applied before the run's next step")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["agent"]:
        # every word after `agent` is the agent's own (its --print-config, its --help): argparse
        # would take leading options for the top-level parser's and reject them
        from loopline.loops.agent import main as agent_main

        return agent_main(argv[1:])
    if argv[:1] == ["sandbox"]:  # likewise: `loopline sandbox -h` lists run and check
        from loopline.envs.cli import main as sandbox_main

        return sandbox_main(argv[1:])
    parser = build_parser()
    # argparse fills the overrides list only up to the first option; key=value words after an option
    # (`train run.yaml --resume grpo.steps=5`) come back unrecognised and are overrides too
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command in ("train", "sft", "dpo", "rm", "eval", "generate", "config"):
            config, overrides = _split_config(args)
            load_config(config, overrides)  # a bad config fails in a second, before torch is imported
            from loopline import commands

            return getattr(commands, args.command)(config, overrides, args)
        if args.command == "export":
            from loopline.checkpoint.export import main as export_main

            return export_main([args.checkpoint, args.out])
        if args.command == "plot":
            from loopline.metrics.plot import plot_run

            for path in plot_run(args.run_dir):
                print(path)
            return 0
        if args.command == "scale":
            return _scale(args.run_dir, args.counts)
        if args.command == "bench":
            try:
                module = importlib.import_module(f"loopline.bench.{args.name}")
            except ModuleNotFoundError:
                print(f"loopline: unknown benchmark '{args.name}'", file=sys.stderr)
                return 2
            return module.main(args.args)
    except ConfigError as e:
        print(f"loopline: bad config:\n{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
