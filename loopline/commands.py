"""The CLI's run commands: each takes (config path, overrides, parsed args) and returns an exit code."""

from __future__ import annotations

import argparse
import json
import time

from loopline.checkpoint.state import RunState
from loopline.config import ConfigError, RunConfig, describe, load_config
from loopline.loops.context import (
    RunContext,
    build_context,
    encode_prompt,
    evaluate,
    sampling_params,
    sync_engine,
)
from loopline.loops.grpo import train_grpo
from loopline.loops.sft import train_sft
from loopline.runtime.workers import WorkerError
from loopline.training.lora import merged_state_dict


def _start_fresh(ctx: RunContext) -> None:
    """A new run: without this, an earlier run's metrics and ledger lines would be read as this one's."""
    ctx.logger.clear()
    ctx.ledger.clear()


def _resume(ctx: RunContext) -> tuple[RunState, dict | None]:
    """State and trainer state of the newest whole checkpoint (weights on the trainer ranks, RNG, metrics and
    ledger cut back to it), or a fresh start."""
    found = ctx.checkpoints.resume()
    if found is None:
        print(f"no checkpoint in {ctx.run_dir}: starting fresh")
        _start_fresh(ctx)
        return RunState(), None
    state, trainer_state = found
    print(f"resumed from {ctx.checkpoints.resumed_from} ({state.phase} step {state.step})")
    return state, trainer_state


def train(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then GRPO; prints held-out accuracy before and after RL.

    A failed call on a worker group (ray: a rank that died, a collective broken by one, a call past its
    timeout) restarts the roles from the newest checkpoint, at most runtime.max_restarts times; the time
    from the failure to the resumed run is printed.
    """
    cfg = load_config(config, overrides)
    t0 = time.perf_counter()
    resume, failed_at = args.resume, None
    for attempt in range(cfg.runtime.max_restarts + 1):
        ctx = build_context(cfg)
        try:
            state = _train(ctx, resume, failed_at)
            break
        except WorkerError as e:
            ctx.checkpoints.abandon()  # a save in flight may have died with the ranks
            if attempt == cfg.runtime.max_restarts:
                raise
            restarts = cfg.runtime.max_restarts
            print(f"{e}\nrestarting the roles from the last checkpoint (restart {attempt + 1} of {restarts})")
            resume, failed_at = True, time.perf_counter()
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


def _train(ctx: RunContext, resume: bool, failed_at: float | None) -> RunState:
    """One attempt of `train` on the roles of `ctx`, fresh or from the newest checkpoint; the final state."""
    if resume:
        state, trainer_state = _resume(ctx)
        if failed_at is not None:
            print(f"recovered in {time.perf_counter() - failed_at:.1f}s (roles restarted, checkpoint loaded)")
    else:
        _start_fresh(ctx)
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
    return state


def _accuracy_at(ctx: RunContext, phase: str, step: int, key: str = "eval_accuracy") -> float | None:
    from loopline.metrics.logger import read_metrics

    for row in read_metrics(ctx.run_dir):
        if row.get("phase") == phase and row.get("step") == step and key in row:
            return row[key]
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
        model.save_pretrained(ctx.run_dir / "model", state_dict=merged_state_dict(model))  # LoRA folded in
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


def _preference_run(cfg: RunConfig, command: str) -> None:
    """Checks for `loopline dpo` / `loopline rm` that a plain config load cannot make."""
    if cfg.runtime.backend != "local":
        raise ConfigError(f"runtime.backend: `loopline {command}` runs on 'local' only for now")
    if cfg.preference.source == "builtin" and cfg.data.source != "builtin":
        raise ConfigError(f"preference.source 'builtin' needs data.source 'builtin', got {cfg.data.source!r}")


def _warm_start(ctx: RunContext) -> None:
    """The SFT warm start before preference training (sft.steps; 0 = start from model.path as it is)."""
    sync_engine(ctx, version=0)
    if ctx.cfg.sft.steps:
        ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
        train_sft(ctx, RunState(), None)


def dpo(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then DPO on preference pairs; the result is out_dir/model."""
    from loopline.data.preference import load_pair_splits
    from loopline.loops.preference import train_dpo

    cfg = load_config(config, overrides)
    _preference_run(cfg, "dpo")
    ctx = build_context(cfg)
    try:
        ctx.logger.clear()
        _warm_start(ctx)
        train_pairs, eval_pairs = load_pair_splits(cfg.preference, ctx.train_rows, ctx.eval_rows, cfg.seed)
        steps = train_dpo(ctx, train_pairs, eval_pairs)
        ctx.model.save_pretrained(ctx.run_dir / "model", state_dict=merged_state_dict(ctx.model))
        ctx.tokenizer.save_pretrained(ctx.run_dir / "model")
    finally:
        ctx.close()
    for key, what in (
        ("eval_logp_accuracy", "held-out pairs the policy prefers, log p(chosen) > log p(rejected)"),
        ("eval_pref_accuracy", "held-out implicit-reward preference accuracy"),
        ("eval_accuracy", "held-out task accuracy"),
    ):
        before, after = _accuracy_at(ctx, "dpo", 0, key), _accuracy_at(ctx, "dpo", steps, key)
        print(f"{what}: before DPO {_pct(before)}, after DPO {_pct(after)}")
    print(f"saved {ctx.run_dir / 'model'}")
    return 0


def rm(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then a Bradley-Terry reward model on pairs; the result is out_dir/reward_model."""
    from loopline.data.preference import load_pair_splits
    from loopline.loops.preference import train_rm

    cfg = load_config(config, overrides)
    _preference_run(cfg, "rm")
    ctx = build_context(cfg)
    try:
        ctx.logger.clear()
        _warm_start(ctx)
        train_pairs, eval_pairs = load_pair_splits(cfg.preference, ctx.train_rows, ctx.eval_rows, cfg.seed)
        model = train_rm(ctx, train_pairs, eval_pairs)
        model.save(ctx.run_dir / "reward_model")
        ctx.tokenizer.save_pretrained(ctx.run_dir / "reward_model")
    finally:
        ctx.close()
    before = _accuracy_at(ctx, "rm", 0, "eval_pair_accuracy")
    after = _accuracy_at(ctx, "rm", cfg.rm.steps, "eval_pair_accuracy")
    print(f"held-out pairwise accuracy: before {_pct(before)}, after {_pct(after)}")
    print(f"saved {ctx.run_dir / 'reward_model'}")
    return 0
