"""The CLI's run commands: each takes (config path, overrides, parsed args) and returns an exit code."""

from __future__ import annotations

import argparse
import json
import time

from loopline.checkpoint.state import RunState, latest_checkpoint, load_checkpoint, set_rng_state
from loopline.config import describe, load_config
from loopline.loops.context import RunContext, build_context, encode_prompt, evaluate, sampling_params, sync_engine
from loopline.loops.grpo import train_grpo
from loopline.loops.sft import train_sft


def _resume(ctx: RunContext) -> tuple[RunState, dict | None]:
    """State and trainer state of the newest checkpoint (weights and RNG restored), or a fresh start."""
    path = latest_checkpoint(ctx.run_dir)
    if path is None:
        print(f"no checkpoint in {ctx.run_dir}: starting fresh")
        ctx.logger.clear()
        return RunState(), None
    state, trainer_state, rng = load_checkpoint(path, ctx.model)
    ctx.actor.load_weights(ctx.model.state_dict())  # on Ray: to the trainer ranks (the engines get them at sync)
    set_rng_state(rng)
    ctx.logger.truncate_after(state.phase, state.step)
    print(f"resumed from {path} ({state.phase} step {state.step})")
    return state, trainer_state


def train(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then GRPO; prints held-out accuracy before and after RL."""
    cfg = load_config(config, overrides)
    t0 = time.perf_counter()
    ctx = build_context(cfg)
    try:
        if args.resume:
            state, trainer_state = _resume(ctx)
        else:
            ctx.logger.clear()  # a new run; without this, an earlier run's rows would be read as this one's
            state, trainer_state = RunState(), None

        if state.phase == "sft":
            sync_engine(ctx, version=0)
            if state.step == 0 and trainer_state is None:
                ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
            state = train_sft(ctx, state, trainer_state)
            state, trainer_state = RunState(phase="grpo", step=0), None
        sync_engine(ctx, version=state.step)
        if state.step == 0:
            ctx.logger.log({"phase": "grpo", "step": 0, **evaluate(ctx)})
        state = train_grpo(ctx, state, trainer_state)
    finally:
        ctx.close()  # also stops the Ray workers (and a Ray this run started) when the run fails
    before = _accuracy_at(ctx, "grpo", 0)
    after = _accuracy_at(ctx, "grpo", state.step)

    from loopline.metrics.plot import plot_run

    plots = plot_run(ctx.run_dir)
    minutes = (time.perf_counter() - t0) / 60
    print(f"held-out accuracy after SFT (before RL): {_pct(before)}")
    print(f"held-out accuracy after RL:              {_pct(after)}")
    print(f"run directory: {ctx.run_dir}  (curves: {plots[0].name}, wall time {minutes:.1f} min)")
    return 0


def _accuracy_at(ctx: RunContext, phase: str, step: int) -> float | None:
    from loopline.metrics.logger import read_metrics

    for row in read_metrics(ctx.run_dir):
        if row.get("phase") == phase and row.get("step") == step and "eval_accuracy" in row:
            return row["eval_accuracy"]
    return None


def _pct(x: float | None) -> str:
    return "n/a (no held-out set)" if x is None else f"{100 * x:.1f}%"


def sft(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT only; the result is the checkpoint's model/ directory."""
    cfg = load_config(config, overrides)
    ctx = build_context(cfg)
    try:
        ctx.logger.clear()
        sync_engine(ctx, version=0)
        ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
        train_sft(ctx, RunState(), None)
        model, _ = ctx.actor.state()
        model.save_pretrained(ctx.run_dir / "model")
        ctx.tokenizer.save_pretrained(ctx.run_dir / "model")
    finally:
        ctx.close()
    print(f"saved {ctx.run_dir / 'model'}")
    return 0


def eval(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:  # noqa: A001
    """Held-out accuracy of model.path (or the built-in model)."""
    cfg = load_config(config, overrides)
    ctx = build_context(cfg)
    try:
        sync_engine(ctx, version=0)
        print(json.dumps(evaluate(ctx)))
    finally:
        ctx.close()
    return 0


def generate(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """Sample completions for --prompt texts; prints one JSON line per completion."""
    from loopline.data.datasets import PromptRow

    cfg = load_config(config, overrides)
    ctx = build_context(cfg)
    try:
        sync_engine(ctx, version=0)
        rows = [PromptRow(index=i, prompt=p) for i, p in enumerate(args.prompt)]
        prompts = [encode_prompt(ctx.tokenizer, r, cfg.model.use_chat_template) for r in rows]
        params = sampling_params(cfg.eval.sampling, seed=cfg.seed)
        for c in ctx.rollout.generate(prompts, params, n=args.n):
            row = {"prompt": args.prompt[c.prompt_index], "completion": c.text, "finish": c.finish_reason}
            print(json.dumps(row))
    finally:
        ctx.close()
    return 0


def config(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """Print every field: dotted key = value  # description."""
    print("\n".join(describe(load_config(config, overrides))))
    return 0
