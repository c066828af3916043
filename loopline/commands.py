"""The CLI's run commands: each takes (config path, overrides, parsed args) and returns an exit code."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from loopline.checkpoint.run_dir import (
    RESUMED_PHASES,
    owning,
    prepare_new_run,
    record_config,
    resume_config,
)
from loopline.checkpoint.state import (
    CheckpointParts,
    RunState,
    checkpoint_name,
    checkpoint_root,
    newest_whole_checkpoint,
)
from loopline.config import RunConfig, absolute_paths, load_config
from loopline.errors import UserError, refuse_in_env_worker
from loopline.loops.context import (
    RunContext,
    build_context,
    encode_prompts,
    evaluate,
    sampling_params,
    sync_engine,
)
from loopline.loops.grpo import train_grpo
from loopline.loops.sft import train_sft
from loopline.loops.stop import Interrupted, StopFlag
from loopline.plan_auto import resolve as resolve_auto
from loopline.runtime.recovery import Recovery
from loopline.runtime.supervisor import Attempt, Supervisor
from loopline.training.lora import merged_state_dict

T = TypeVar("T")


def _start_fresh(ctx: RunContext) -> None:
    """A new run (out_dir held none, or --overwrite deleted it), or a restart of this process's run before its
    first save: without this, earlier metrics and ledger lines would be read as this run's."""
    ctx.logger.clear()
    ctx.ledger.clear()


def _run_config(
    config: str | None, overrides: list[str], args: argparse.Namespace, command: str
) -> tuple[RunConfig, dict[str, tuple]]:
    """The run's config (its auto settings resolved) and, resumed, what differs from the one saved in out_dir
    (checkpoint.run_dir): a resume needs something to resume from. Never inside an env worker: there a run is a
    script starting itself again as the worker loads it."""
    refuse_in_env_worker(f"`loopline {command}`")
    if getattr(args, "restart_unsaved", False) and not args.resume:
        raise UserError("--restart-unsaved goes with --resume (what to do when there is nothing to resume)")
    if getattr(args, "resume", False):
        if args.overwrite:
            raise UserError("--resume continues the run in out_dir, --overwrite deletes it: give one of them")
        fresh_ok = getattr(args, "restart_unsaved", False)
        cfg, changes = resume_config(config, overrides, args.allow_config_change, fresh_ok)
        cfg = _auto(cfg, command)  # a resumed run's saved config holds its choices: only a fresh one's change
        run_dir = Path(cfg.out_dir)
        metrics = run_dir / "metrics.jsonl"
        newest, _ = newest_whole_checkpoint(run_dir)  # raises, before anything is written, if all are damaged
        unsaved = newest is None and metrics.is_file() and metrics.stat().st_size > 0
        if unsaved and not getattr(args, "restart_unsaved", False):
            raise UserError(
                f"cannot resume {run_dir}: it has metrics but no checkpoint (it stopped before its first save); "
                f"start it again with `loopline {command} --overwrite out_dir={run_dir}` (deletes it)"
            )
        if unsaved:
            print(
                f"{run_dir} stopped before its first checkpoint: --restart-unsaved starts it again from step 0"
            )
        return cfg, changes
    # paths absolute in the run's saved config: a resume from another directory reads the same files
    return _auto(absolute_paths(load_config(config, overrides), Path.cwd()), command), {}


def _auto(cfg: RunConfig, command: str) -> RunConfig:
    """The config with its auto settings resolved (loopline.plan_auto), their choice printed in one line."""
    resolved = resolve_auto(cfg, command)
    if resolved.line:
        print(resolved.line, flush=True)
    return resolved.cfg


def _resume(
    ctx: RunContext, changes: dict[str, tuple] | None, command: str = "train"
) -> tuple[RunState, CheckpointParts | None]:
    """State and parts of the newest checkpoint that loads (weights on the trainer ranks, RNG, metrics and
    ledger cut back to it), or a fresh start where there is none (_run_config refused a run with metrics).
    `command`'s phases only: train continues SFT and GRPO, dpo its SFT warm start and DPO, sft SFT."""
    found = ctx.checkpoints.resume()  # raises when there are checkpoints and every one is damaged
    for path, fault in ctx.checkpoints.skipped:
        warning = f"loopline: warning: checkpoint {path} is damaged: {fault}; using an older one"
        print(warning, file=sys.stderr)
    if found is None:
        print(f"no checkpoint in {ctx.run_dir}: starting fresh")
        _start_fresh(ctx)
        record_config(ctx.run_dir, "start")
        return RunState(), None
    state, resume = found
    if state.phase not in RESUMED_PHASES[command]:  # another command's run
        raise UserError(
            f"cannot resume {ctx.run_dir} with `loopline {command}`: its newest checkpoint, "
            f"{ctx.checkpoints.resumed_from}, is of phase '{state.phase}'"
        )
    print(f"resumed from {ctx.checkpoints.resumed_from} ({state.phase} step {state.step})")
    event = "resume" if changes is not None else "restart"  # restart: after a worker failure, same config
    record_config(ctx.run_dir, event, changes, checkpoint=ctx.checkpoints.resumed_from.name)
    return state, resume


def _stopped(e: Interrupted, run_dir: str, command: str) -> int:
    """After SIGINT/SIGTERM stopped a run at a step's end (its checkpoint whole): where, and how to go on."""
    print(f"{e}: checkpoint {checkpoint_root(run_dir) / checkpoint_name(e.state)}")
    print(f"continue with: loopline {command} --resume out_dir={run_dir}")
    return e.exit_code


def _supervised(
    command: str,
    cfg: RunConfig,
    args: argparse.Namespace,
    changes: dict[str, tuple],
    body: Callable[[RunContext, Attempt], T],
    need_answer: bool = True,
) -> tuple[RunContext, T] | int:
    """Run `body` under the run's Supervisor (runtime.supervisor: restarts after lost workers, one line and exit 75
    past runtime.max_restarts) and the SIGINT/SIGTERM flag, while this process owns out_dir
    (checkpoint.run_dir.owning: a new run's --overwrite deletes the old run from here, the owner, once); the last
    run context and the body's result, or the exit status (130/143) when a signal stopped it at a step's end."""
    with owning(cfg.out_dir):
        if not args.resume:
            prepare_new_run(cfg.out_dir, args.overwrite, command)
        return _run_supervised(command, cfg, args.resume, changes, body, need_answer)


def _run_supervised(
    command: str,
    cfg: RunConfig,
    resume: bool,
    changes: dict[str, tuple],
    body: Callable[[RunContext, Attempt], T],
    need_answer: bool,
) -> tuple[RunContext, T] | int:
    """_supervised's run, once out_dir is this process's."""
    stop = StopFlag()

    def build(recovery: Recovery) -> RunContext:
        return build_context(cfg, need_answer=need_answer, stop=stop, recovery=recovery)

    supervisor = Supervisor(cfg.runtime, command, cfg.out_dir, build, cfg.seed)
    with stop.handling():
        try:
            return supervisor.run(body, resume, changes)
        except Interrupted as e:
            return _stopped(e, cfg.out_dir, command)


def _begin(ctx: RunContext, attempt: Attempt, command: str) -> tuple[RunState, CheckpointParts | None]:
    """An attempt's start: from the newest checkpoint (a --resume, or a restart after a failure: its recovery
    time logged), or a fresh run."""
    if attempt.resume:
        state, parts = _resume(ctx, attempt.changes, command)
        attempt.recovered(ctx.logger.note)
        return state, parts
    _start_fresh(ctx)
    record_config(ctx.run_dir, "start")
    return RunState(), None


def train(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then GRPO; prints held-out accuracy before and after RL.

    A failed call on a worker group (ray: a rank that died, a collective broken by one, a call past its
    timeout) restarts from the newest checkpoint, at most runtime.max_restarts times, the failed role alone or
    every role (runtime.restart_scope: runtime.supervisor); the time from the failure to the resumed run is
    printed and logged (recover_<role>_s on the next metrics row). SIGINT/SIGTERM: the step in progress ends, its
    checkpoint is written, and the exit status is 130/143 (loops.stop). sft, dpo and rm do the same.
    """
    cfg, changes = _run_config(config, overrides, args, "train")
    t0 = time.perf_counter()
    done = _supervised("train", cfg, args, changes, _train)
    if isinstance(done, int):
        return done
    ctx, state = done
    before = _accuracy_at(ctx, "grpo", 0)
    after = _accuracy_at(ctx, "grpo", state.step)

    from loopline.metrics.plot import plot_run

    plots = plot_run(ctx.run_dir)
    minutes = (time.perf_counter() - t0) / 60
    # accuracy: the env's exact answers (envs.base.counts_correct); the mean reward beside it (partial credit)
    print(f"held-out accuracy after SFT (before RL): {_pct(before)}{_mean_reward(ctx, 'grpo', 0)}")
    print(f"held-out accuracy after RL:              {_pct(after)}{_mean_reward(ctx, 'grpo', state.step)}")
    # grpo.stop_at_accuracy: then the RL steps it took, not the accuracy, are what varies from run to run
    for line in ctx.no_signal.report(cfg, before):
        print(line)  # a run that learned nothing says so, and why it likely did not
    if state.done:
        print(
            f"RL reached grpo.stop_at_accuracy={cfg.grpo.stop_at_accuracy:.0%} on the validation split at step "
            f"{state.step} of at most {cfg.grpo.steps} (validation {state.val_accuracy:.1%})"
        )
    print(f"run directory: {ctx.run_dir}  (curves: {plots[0].name}, wall time {minutes:.1f} min)")
    return 0


def _train(ctx: RunContext, attempt: Attempt) -> RunState:
    """What `train` runs (one attempt, on the roles of `ctx`): SFT then GRPO, fresh or from the newest
    checkpoint; the final state."""
    state, resume = _begin(ctx, attempt, "train")
    if state.phase == "sft":
        sync_engine(ctx, version=0)
        if state.step == 0 and resume is None:
            ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
        state = train_sft(ctx, state, resume)
        state, resume = RunState(phase="grpo", step=0), None
    sync_engine(ctx, version=state.step)
    if state.step == 0:
        ctx.logger.log({"phase": "grpo", "step": 0, **evaluate(ctx)})
    state = train_grpo(ctx, state, resume)
    agree = ctx.actor.replicas_agree()  # runtime.trainer_replicas: heals and all, they made the same updates
    if agree is not None:
        print(f"trainer replicas bitwise equal at the end: {'yes' if agree else 'NO'}")
        if not agree:
            raise RuntimeError("the trainer's replicas hold different weights or optimizer state at the end")
    return state


def _accuracy_at(ctx: RunContext, phase: str, step: int, key: str = "eval_accuracy") -> float | None:
    from loopline.metrics.logger import read_metrics

    for row in read_metrics(ctx.run_dir):
        if row.get("phase") == phase and row.get("step") == step and key in row:
            return row[key]
    return None


def _mean_reward(ctx: RunContext, phase: str, step: int) -> str:
    """', mean reward R' of the held-out eval at (phase, step), or "" where there was none."""
    reward = _accuracy_at(ctx, phase, step, "eval_reward_mean")
    return "" if reward is None else f", mean reward {reward:.3f}"


def _pct(x: float | None) -> str:
    return "n/a (no held-out set)" if x is None else f"{100 * x:.1f}%"


def _sft(ctx: RunContext, attempt: Attempt) -> None:
    """What `sft` runs (one attempt): SFT fresh or from the newest checkpoint, then out_dir/model written."""
    state, parts = _begin(ctx, attempt, "sft")
    sync_engine(ctx, version=0)
    if parts is None:
        ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
    train_sft(ctx, state, parts)
    model, _ = ctx.actor.state()
    model.save_pretrained(ctx.run_dir / "model", state_dict=merged_state_dict(model))  # LoRA folded in
    ctx.tokenizer.save_pretrained(ctx.run_dir / "model")


def sft(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT only; the result is out_dir/model. --resume, lost workers, SIGINT/SIGTERM: as for `train`."""
    cfg, changes = _run_config(config, overrides, args, "sft")
    # SFT learns completions and assistant turns; no RL scoring
    done = _supervised("sft", cfg, args, changes, _sft, need_answer=False)
    if isinstance(done, int):
        return done
    print(f"saved {Path(cfg.out_dir) / 'model'}")
    return 0


@contextlib.contextmanager
def _read_only_context(config: str | None, overrides: list[str]) -> Iterator[RunContext]:
    """The run context of a command that only reads (eval, generate): nothing is written into out_dir or any
    run directory (the context's own files go to a temporary directory, removed at the end). model.path may
    be a checkpoint or a run directory: its policy is exported there first."""
    from loopline.checkpoint.export import export

    cfg = load_config(config, overrides).model_copy(deep=True)
    with tempfile.TemporaryDirectory(prefix="loopline-read-") as tmp:
        cfg.out_dir, cfg.tensorboard, cfg.metrics.wandb = str(Path(tmp) / "run"), False, False
        model = Path(cfg.model.path) if cfg.model.path else None
        if model is not None and not (model / "config.json").is_file():  # a checkpoint or a run directory
            cfg.model.path = str(export(model, Path(tmp) / "model"))
        ctx = build_context(cfg)
        try:
            yield ctx
        finally:
            ctx.close()


def evaluation(config: str | None, overrides: list[str]) -> dict[str, float]:
    """`eval`'s result: held-out accuracy (and mean response length) of model.path or the built-in model."""
    with _read_only_context(config, overrides) as ctx:
        if not ctx.eval_rows:  # it printed {} and exited 0
            cfg = ctx.cfg
            raise UserError(
                f"eval has no held-out rows to score: data.source={cfg.data.source} with data.eval_path empty; give "
                "data.eval_path=FILE (rows like the training file's)"
            )
        print(f"loopline: scoring {_held_out(ctx)}", file=sys.stderr, flush=True)
        sync_engine(ctx, version=0)
        return evaluate(ctx)


def eval(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:  # noqa: A001
    """Held-out accuracy of model.path (a model, checkpoint or run directory) or the built-in model."""
    print(json.dumps(evaluation(config, overrides)))
    return 0


def _held_out(ctx: RunContext) -> str:
    """Which held-out rows eval scores and how, in words: said at the start, so a default is never a surprise."""
    cfg = ctx.cfg
    n = min(len(ctx.eval_rows), cfg.eval.num_prompts)
    if cfg.data.source != "builtin":
        rows = f"{n} rows of {cfg.data.eval_path}"
    elif cfg.env.has_builtin_rows:
        rows = f"{n} problems of the built-in {cfg.env.name} task's held-out split"
    else:
        task = cfg.data.task
        rows = (
            f"{n} problems of the built-in addition task's held-out split ({task.min_digits}-{task.max_digits} "
            "digit operands; data.source=jsonl data.eval_path=FILE scores your own)"
        )
    return f"{rows} with env.name={cfg.env.name}"


def generations(
    config: str | None, overrides: list[str], prompts: list[str], n: int = 1, temperature: float | None = None
) -> list[dict[str, str]]:
    """`generate`'s result: {prompt, completion, finish} for each of n samples per prompt, in order."""
    from loopline.data.datasets import PromptRow

    with _read_only_context(config, overrides) as ctx:
        cfg = ctx.cfg
        sync_engine(ctx, version=0)
        rows = [PromptRow(index=i, prompt=p) for i, p in enumerate(prompts)]
        encoded = encode_prompts(ctx.tokenizer, rows, cfg.model.use_chat_template)
        params = sampling_params(cfg.eval.sampling, seed=cfg.seed)
        if temperature is None and n > 1 and params.temperature == 0:
            temperature = 1.0
        if temperature is not None:
            params = dataclasses.replace(params, temperature=temperature)
        return [
            {"prompt": prompts[c.prompt_index], "completion": c.text, "finish": c.finish_reason}
            for c in ctx.rollout.generate(encoded, params, n=n)
        ]


def generate(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """Sample completions for --prompt texts; prints one JSON line per completion. With -n > 1 and greedy
    eval sampling (the default), samples at temperature 1: n greedy samples would all be the same."""
    for row in generations(config, overrides, args.prompt, args.n, args.temperature):
        print(json.dumps(row))
    return 0


def _warm_start(
    ctx: RunContext, state: RunState | None = None, resume: CheckpointParts | None = None
) -> None:
    """The SFT warm start before preference training (sft.steps; 0 = start from model.path as it is), from
    `state` where a resumed run stopped in it."""
    sync_engine(ctx, version=0)
    if ctx.cfg.sft.steps:
        if resume is None:
            ctx.logger.log({"phase": "sft", "step": 0, **evaluate(ctx)})
        train_sft(ctx, state or RunState(), resume)


def _dpo(ctx: RunContext, attempt: Attempt) -> int:
    """What `dpo` runs (one attempt): the SFT warm start and DPO, fresh or from the newest checkpoint of either,
    then out_dir/model written; the DPO steps run."""
    from loopline.data.preference import load_pair_splits
    from loopline.loops.preference import train_dpo

    state, resume = _begin(ctx, attempt, "dpo")
    if state.phase == "sft":
        _warm_start(ctx, state, resume)
        state, resume = RunState(phase="dpo"), None
    pairs = load_pair_splits(ctx.cfg.preference, ctx.train_rows, ctx.eval_rows, ctx.cfg.seed)
    steps = train_dpo(ctx, *pairs, state, resume)
    policy = ctx.actor.policy()  # the trained weights in this process (ray: gathered from the ranks)
    policy.save_pretrained(ctx.run_dir / "model", state_dict=merged_state_dict(policy))
    ctx.tokenizer.save_pretrained(ctx.run_dir / "model")
    return steps


def dpo(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then DPO on preference pairs; the result is out_dir/model. --resume continues from the newest
    checkpoint (of the warm start or of DPO); lost workers, SIGINT/SIGTERM: as for `train`."""
    cfg, changes = _run_config(config, overrides, args, "dpo")  # preflight.check_run checked what dpo needs
    done = _supervised("dpo", cfg, args, changes, _dpo)
    if isinstance(done, int):
        return done
    ctx, steps = done
    for key, what in (
        ("eval_logp_accuracy", "held-out pairs the policy prefers, log p(chosen) > log p(rejected)"),
        ("eval_pref_accuracy", "held-out implicit-reward preference accuracy"),
        ("eval_accuracy", "held-out task accuracy"),
    ):
        before, after = _accuracy_at(ctx, "dpo", 0, key), _accuracy_at(ctx, "dpo", steps, key)
        print(f"{what}: before DPO {_pct(before)}, after DPO {_pct(after)}")
    print(f"saved {ctx.run_dir / 'model'}")
    return 0


def _rm(ctx: RunContext, attempt: Attempt) -> None:
    """What `rm` runs (one attempt): the SFT warm start and the reward model, fresh or from the newest
    checkpoint of either, then out_dir/reward_model written."""
    from loopline.data.preference import load_pair_splits
    from loopline.loops.preference import train_rm

    state, resume = _begin(ctx, attempt, "rm")
    if state.phase == "sft":
        _warm_start(ctx, state, resume)
        state, resume = RunState(phase="rm"), None
    train_pairs, eval_pairs = load_pair_splits(
        ctx.cfg.preference, ctx.train_rows, ctx.eval_rows, ctx.cfg.seed
    )
    model = train_rm(ctx, train_pairs, eval_pairs, state, resume)
    model.save(ctx.run_dir / "reward_model")
    ctx.tokenizer.save_pretrained(ctx.run_dir / "reward_model")


def rm(config: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    """SFT warm start then a Bradley-Terry reward model on pairs; the result is out_dir/reward_model. --resume,
    lost workers, SIGINT/SIGTERM: as for `train`."""
    cfg, changes = _run_config(config, overrides, args, "rm")  # preflight.check_run checked what rm needs
    done = _supervised("rm", cfg, args, changes, _rm)
    if isinstance(done, int):
        return done
    ctx, _ = done
    before = _accuracy_at(ctx, "rm", 0, "eval_pair_accuracy")
    after = _accuracy_at(ctx, "rm", cfg.rm.steps, "eval_pair_accuracy")
    print(f"held-out pairwise accuracy: before {_pct(before)}, after {_pct(after)}")
    print(f"saved {ctx.run_dir / 'reward_model'}")
    return 0
