"""What every loop shares: the config, model, tokenizer, roles, data, logger; prompt encoding; eval."""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline import config_rules
from loopline.checkpoint.ledger import Ledger
from loopline.checkpoint.state import Checkpointer, SaveInFlight
from loopline.config import ConfigError, RunConfig, save_config
from loopline.data.datasets import LengthLimits, PromptRow, load_splits
from loopline.data.tasks import arithmetic_validation
from loopline.data.transcripts import is_transcript
from loopline.envs.base import MAX_REWARD
from loopline.envs.episodes import builtin_rows, env_factory
from loopline.envs.multiturn import (
    ChatFormat,
    MultiTurnConfig,
    PlainFormat,
    TurnFormat,
    WorkerEnvs,
    rollout_metrics,
    run_rollout,
    transcript_trajectory,
)
from loopline.errors import UserError
from loopline.loops.no_signal import NoSignalWatch
from loopline.loops.stop import StopFlag
from loopline.metrics.logger import MetricsLogger
from loopline.metrics.trace import Trace
from loopline.models.load import load_policy
from loopline.rollout.config import SamplingConfig
from loopline.rollout.engine import SamplingParams
from loopline.rollout.trajectory import Trajectory
from loopline.runtime.actor import HealHooks
from loopline.runtime.critic import CheckpointWithCritic
from loopline.runtime.protocols import Actor, Critic, Rollout, Scorer
from loopline.runtime.ranks import setup_process
from loopline.runtime.recovery import Recovery
from loopline.runtime.roles import build_roles
from loopline.runtime.watchdog import Watchdog


@dataclass
class RunContext:
    """The objects of one run, built once from its config; close() when done."""

    cfg: RunConfig
    run_dir: Path
    model: PreTrainedModel  # the policy in this process: trained here (local), a copy for checkpoints (ray)
    tokenizer: PreTrainedTokenizerBase
    actor: Actor  # the policy trainer (runtime.backend: this process, or FSDP2 ranks on Ray)
    rollout: Rollout  # the generation engines
    scorer: Scorer  # the verifier (env workers)
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    logger: MetricsLogger
    stop_roles: Callable[[], None]
    checkpoints: Checkpointer  # saves through the actor (every trainer rank writes its shards); resumes
    ledger: Ledger  # which samples each step trained (ledger.jsonl)
    watchdog: Watchdog  # fails the run when a stage hangs (runtime.stage_timeout_s)
    no_signal: NoSignalWatch  # GRPO steps without learning signal, for the warning and the end-of-run report
    critic: Critic | None = None  # PPO's value model (grpo.advantage=gae), on the runtime's backend
    # the validation split (built-in task), read by SFT's stopping rule (sft.stop_at_accuracy)
    val_rows: list[PromptRow] = field(default_factory=list)
    stop: StopFlag = field(default_factory=StopFlag)  # SIGINT/SIGTERM: checkpoint at the step's end and stop
    trace: Trace = field(default_factory=Trace)  # the RL loop's stages as spans (trace.json in run_dir)
    restart_group: Callable[[str], None] | None = None  # ray: replace one role's ranks alone (roles.Roles)

    def close(self) -> None:
        """Finish the checkpoint in flight; flush the logger; stop the watchdog and the roles' workers."""
        try:
            self.checkpoints.wait()
        finally:
            self.watchdog.close()
            self.logger.close()
            self.stop_roles()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_context(
    cfg: RunConfig, need_answer: bool = True, stop: StopFlag | None = None, recovery: Recovery | None = None
) -> RunContext:
    """Seed, load model and data, start the roles, open the logger.
    stop: the command's SIGINT/SIGTERM flag (installed around the whole command), else one of the context's own;
    recovery: the run's allowances of restarts, heals and engine replacements, kept across its restarts (else
    the context's own)."""
    setup_process(cfg)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    seed_everything(cfg.seed)
    env_factory(cfg.env)  # a user's env imports here first: a bad module fails before anything starts
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    config_rules.chat_template_present(cfg, bool(getattr(tokenizer, "chat_template", None)))
    limits = length_limits(cfg, model, tokenizer)
    if cfg.env.has_builtin_rows and cfg.data.source == "builtin":  # the env's own task (calculator, code)
        (train_rows, eval_rows, val_rows), skipped = builtin_rows(cfg.env, cfg.seed), {}
    else:
        train_rows, eval_rows, skipped = load_splits(
            cfg.data,
            cfg.seed,
            need_answer,
            limits,
            fields=cfg.env.row_fields,
            answered=cfg.env.reads_answer,
            optional=cfg.env.optional_row_fields,
        )
        val_rows = arithmetic_validation(cfg.data.task, cfg.seed) if cfg.data.source == "builtin" else []
    checked = train_rows[:TARGETS_CHECKED]
    what = "SFT targets" + (
        f" (the first {len(checked)} of {len(train_rows)})" if len(checked) < len(train_rows) else ""
    )
    cut = config_rules.targets_fit(cfg, generation_lengths(cfg, tokenizer, checked), what)
    if cut:
        config_rules.warn(cut)
    # the run directory only once model and data have loaded: a bad row leaves no half-made run behind
    run_dir = Path(cfg.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    # before the roles: a W&B run that cannot start (no account, no network) fails before any worker starts
    logger = MetricsLogger(
        run_dir, tensorboard=cfg.tensorboard, wandb=cfg.metrics, config=cfg.model_dump(mode="json")
    )
    # the save in flight, and the logger: what a heal of the trainer drops (the save lost a rank's shards) and
    # where it logs its time (summed per step)
    in_flight = SaveInFlight(cfg.checkpoint.save_timeout_s)
    roles = build_roles(cfg, model, tokenizer, HealHooks(in_flight.abandon, logger.note_sum), recovery)
    if skipped:  # rows the data config let go (skip_bad_rows, overlong=skip), by reason, on the next row
        logger.note(
            {
                "data_skipped_rows": sum(skipped.values()),
                **{f"data_skipped_{k}": n for k, n in skipped.items()},
            }
        )
    # PPO's critic writes its part of every checkpoint once its phase has started
    saved = roles.actor if roles.critic is None else CheckpointWithCritic(roles.actor, roles.critic)
    checkpoints = Checkpointer(run_dir, cfg.checkpoint, saved, model, tokenizer, in_flight)
    rt = cfg.runtime
    ranks = {"actor": rt.trainer_ranks, "rollout": rt.engines, "env": rt.env_workers}
    watchdog = Watchdog(rt.stage_timeout_s, ranks)
    return RunContext(
        cfg, run_dir, model, tokenizer, roles.actor, roles.rollout, roles.scorer, train_rows, eval_rows, logger,
        roles.shutdown, checkpoints, Ledger(run_dir), watchdog, NoSignalWatch.for_run(cfg), roles.critic,
        val_rows=val_rows, restart_group=roles.restart_group, stop=stop or StopFlag(),
    )  # fmt: skip


TARGETS_CHECKED = 1000  # training rows whose SFT target length is checked against the generation budgets


def generation_lengths(
    cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, rows: Sequence[PromptRow]
) -> list[int]:
    """The tokens each row's SFT target takes to generate: its text, plus EOS unless it ends in a stop string."""
    stops = tuple(s for s in (*cfg.grpo.sampling.stop, *cfg.eval.sampling.stop) if s)
    lengths = []
    for row in rows:
        if row.messages and row.messages[-1]["role"] == "assistant":
            target = row.messages[-1]["content"]
        else:
            target = row.completion or row.answer
        if target:
            ends = target.endswith(stops) or tokenizer.eos_token_id is None
            lengths.append(len(tokenizer(target, add_special_tokens=False)["input_ids"]) + (0 if ends else 1))
    return lengths


def length_limits(cfg: RunConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> LengthLimits:
    """The longest rows the model can take (data.max_prompt_tokens and data.max_seq_len, or derived from its
    max positions): a longer row would grow memory without bound before failing deep in the model."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if not positions:
        positions = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 32_768
    new_tokens = max(cfg.grpo.sampling.max_new_tokens, cfg.eval.sampling.max_new_tokens)
    if cfg.env.multi_turn:  # an episode's response: model turns and observations
        new_tokens = max(new_tokens, cfg.env.max_episode_tokens)
    max_prompt = cfg.data.max_prompt_tokens or positions - new_tokens
    if max_prompt < 1:
        raise ConfigError(
            f"grpo/eval sampling.max_new_tokens ({new_tokens}) leaves no room for a prompt in the model's "
            f"{positions} positions: lower it, or set data.max_prompt_tokens"
        )
    use_chat_template = cfg.model.use_chat_template
    multi_turn = cfg.env.multi_turn and not cfg.env.agent_program
    fmt = _turn_format(cfg, tokenizer)

    def count(row: PromptRow) -> tuple[int, int]:
        if row.messages and is_transcript(row.messages, multi_turn):  # the whole episode, as SFT trains it
            traj = transcript_trajectory(row, fmt, tokenizer)
            return len(traj.prompt_ids), len(traj.prompt_ids) + len(traj.tokens)
        prompt = len(encode_prompt(tokenizer, row, use_chat_template))
        # the SFT target, as loops.sft.sft_pair builds it (plus its EOS)
        if row.messages and row.messages[-1]["role"] == "assistant":
            target = row.messages[-1]["content"]
        else:
            target = row.completion or row.answer
        return prompt, prompt + len(tokenizer(target, add_special_tokens=False)["input_ids"]) + 1

    return LengthLimits(count, max_prompt, cfg.data.max_seq_len or positions, cfg.data.overlong)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, row: PromptRow, use_chat_template: bool) -> list[int]:
    """Prompt token ids: the chat template when asked for and available, else the plain text."""
    if row.messages and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "chat rows (data.messages_field) need a tokenizer with a chat template, and this model's has none "
            "(the built-in model has none: give model.path a chat model)"
        )
    if row.messages or (use_chat_template and getattr(tokenizer, "chat_template", None)):
        messages = list(row.messages) or [{"role": "user", "content": row.prompt}]
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        # return_dict=False: transformers 5 returns a BatchEncoding by default (list() of it gives its keys)
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    return tokenizer(row.prompt)["input_ids"]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[PromptRow], use_chat_template: bool
) -> list[list[int]]:
    """encode_prompt of each row; plain-text rows in one call of the tokenizer (its batch path)."""
    if any(r.messages for r in rows) or (use_chat_template and getattr(tokenizer, "chat_template", None)):
        return [encode_prompt(tokenizer, r, use_chat_template) for r in rows]
    return list(tokenizer([r.prompt for r in rows])["input_ids"]) if rows else []


def sampling_params(cfg: SamplingConfig, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop=tuple(cfg.stop),
        seed=seed,
    )


def sync_engine(ctx: RunContext, version: int) -> None:
    """Push the trainer's weights to the engines (in-process copy locally, the planned transfer on Ray)."""
    # a trainer rank lost mid-sync (runtime.trainer_replicas > 1): the trainer is healed and the weights sent again
    ctx.actor.guarded(lambda: ctx.rollout.update_weights(version))


def turn_format(ctx: RunContext) -> TurnFormat:
    """How episodes' observations become tokens: the chat template when asked for and available, else plain text."""
    return _turn_format(ctx.cfg, ctx.tokenizer)


def _turn_format(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> TurnFormat:
    if cfg.model.use_chat_template and getattr(tokenizer, "chat_template", None):
        return ChatFormat(tokenizer)
    return PlainFormat(tokenizer)


def episodes(
    ctx: RunContext, rows: list[PromptRow], sampling: SamplingConfig, seed: int | None = None
) -> list[Trajectory]:
    """Multi-turn episodes (env.max_turns > 1), one per row: the engines write the model turns, the env workers
    step the env between them (envs.multiturn, WorkerEnvs); each turn samples as `sampling` says. For
    env.name=openai_agent, runs of the user's agent program (agent_episodes)."""
    env = ctx.cfg.env
    if env.agent_program:
        return agent_episodes(ctx, rows)
    limits = MultiTurnConfig(
        max_turns=env.turns,
        max_turn_tokens=sampling.max_new_tokens,
        max_total_tokens=env.max_episode_tokens,
        returns=env.returns,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(dict.fromkeys([*sampling.stop, *env.turn_stop])),
    )
    return run_rollout(ctx.rollout, WorkerEnvs(ctx.scorer), rows, turn_format(ctx), limits, seed)


def agent_episodes(ctx: RunContext, rows: list[PromptRow]) -> list[Trajectory]:
    """env.name=openai_agent: the agent program once per row, on the env workers, against an OpenAI-compatible
    endpoint on the engines (rollout.openai_server, in this process for the step); every call it makes is recorded
    with its tokens and log-probs. An episode is one sequence: its calls joined where each prompt continues the last
    (to_trajectories); an agent that rewrote its history leaves several, and the last is trained
    (info 'sequences' counts them). The agent sets its own sampling (temperature, max_tokens)."""
    from loopline.rollout.openai_server import (  # aiohttp: only here
        OpenAIServer,
        ServerConfig,
        to_trajectories,
    )

    ids = [f"episode-{uuid.uuid4().hex}" for _ in rows]
    server_cfg = ServerConfig(trajectory_from_api_key=True, request_timeout_s=ctx.cfg.env.agent_timeout_s)
    with OpenAIServer(ctx.rollout, ctx.tokenizer, server_cfg) as server:
        rewards = ctx.scorer.run_agents(rows, ids, server.base_url)
        served = server.pop_trajectories()
    out = []
    for row, episode, reward in zip(rows, ids, rewards, strict=True):
        sequences = to_trajectories(served.get(episode, []))
        if not sequences:
            raise UserError(
                f"env 'openai_agent' (command {ctx.cfg.env.command!r}) on prompt {row.index}: the agent made no "
                "call to the model (it must use OPENAI_BASE_URL and OPENAI_API_KEY from its environment)"
            )
        traj = sequences[-1]
        traj.sample = row
        traj.rewards = [reward]
        traj.info = {
            "correct": float(reward >= MAX_REWARD),  # the last line equals the answer (exact_match)
            "model_calls": len(served[episode]),
            "sequences": len(sequences),
        }
        traj.finish = "done"
        out.append(traj)
    return out


def episodes_correct(trajs: list[Trajectory]) -> torch.Tensor:
    """(B,) which episodes count as correct: those the env ended and judged so (info 'correct', set on the env
    workers by envs.base.counts_correct); an episode cut by a turn or token limit, or by an env error, is not."""
    return torch.tensor([t.finish == "done" and float(t.info.get("correct", 0)) > 0 for t in trajs])


def evaluate(ctx: RunContext, rows: list[PromptRow] | None = None) -> dict[str, float]:
    """Accuracy (greedy by default): the share of responses the env counts as correct (envs.base.counts_correct:
    full marks, or the env's own verdict; a code completion passes every test), the mean reward beside it, and the
    mean response length on `rows`, the held-out split by default. The env scores on the env workers, as in RL."""
    rows = ctx.eval_rows[: ctx.cfg.eval.num_prompts] if rows is None else rows
    if not rows:
        return {}
    # eval must not move the training RNG: a run with evals samples exactly like one without
    saved = torch.get_rng_state()
    if ctx.cfg.env.multi_turn:
        trajs: list[Trajectory] = []
        for start in range(0, len(rows), ctx.cfg.eval.batch_size):
            trajs += episodes(
                ctx, rows[start : start + ctx.cfg.eval.batch_size], ctx.cfg.eval.sampling, ctx.cfg.seed
            )
        torch.set_rng_state(saved)
        summary = rollout_metrics(trajs, ctx.cfg.env.returns)
        return {
            "eval_accuracy": float(episodes_correct(trajs).float().mean()),
            "eval_reward_mean": summary["return_mean"],
            "eval_response_len": summary.pop("model_tokens_mean"),
            **{f"eval_{k}": v for k, v in summary.items() if k != "correct"},
        }
    params = sampling_params(ctx.cfg.eval.sampling, seed=ctx.cfg.seed)
    texts, answered, lengths = [], [], 0
    for start in range(0, len(rows), ctx.cfg.eval.batch_size):
        chunk = rows[start : start + ctx.cfg.eval.batch_size]
        prompts = encode_prompts(ctx.tokenizer, chunk, ctx.cfg.model.use_chat_template)
        for c in ctx.rollout.generate(prompts, params, n=1):
            texts.append(c.text)
            answered.append(chunk[c.prompt_index])
            lengths += len(c.token_ids)
    torch.set_rng_state(saved)
    scores = ctx.scorer.score(texts, answered)
    return {
        "eval_accuracy": float(scores.correct.sum()) / len(rows),
        "eval_reward_mean": float(scores.rewards.sum()) / len(rows),
        "eval_response_len": lengths / len(rows),
    }


# ---------------------------------------------------------------------------------------------------------
# Elastic workers: `loopline scale OUT_DIR engines=N env_workers=M` asks, the loop applies between steps
# ---------------------------------------------------------------------------------------------------------

SCALE_REQUEST = "scale_request.json"
SCALABLE = {"engines": "rollout engines", "env_workers": "env workers"}


def write_scale_request(run_dir: str | Path, request: dict[str, int]) -> Path:
    """Ask the run in `run_dir` for these worker counts (keys of SCALABLE, >= 1); merged with a request not yet
    applied, written whole (rename) so that the loop never reads half a file."""
    bad = {k: v for k, v in request.items() if k not in SCALABLE or not isinstance(v, int) or v < 1}
    if bad or not request:
        raise ValueError(
            f"a scale request sets {' and/or '.join(SCALABLE)} to an integer >= 1; got {request}"
        )
    path = Path(run_dir) / SCALE_REQUEST
    pending = json.loads(path.read_text()) if path.exists() else {}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**pending, **request}))
    tmp.replace(path)
    return path


def apply_scale_request(ctx: RunContext) -> dict[str, float]:
    """Apply and delete the run's scale request, if there is one (call between steps); the new counts and the
    seconds it took, for the metrics row ({} without a request). A request that cannot be applied is reported
    and dropped: the run goes on with the workers it has."""
    path = ctx.run_dir / SCALE_REQUEST
    if not path.exists():
        return {}
    try:
        request = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    start, applied = time.perf_counter(), {}
    for key, count in request.items():
        role = ctx.rollout if key == "engines" else ctx.scorer
        try:
            if key not in SCALABLE:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(SCALABLE)})")
            role.resize(int(count))  # ValueError where the role cannot change (one of each in this process)
            applied[key] = float(count)
        except ValueError as e:  # PlacementError (no room in the cluster) is a ValueError too
            print(f"loopline: scale request {key}={count} not applied: {e}", flush=True)
    if applied:
        applied["scale_s"] = time.perf_counter() - start
        print(
            f"loopline: scaled to {', '.join(f'{k}={int(v)}' for k, v in applied.items() if k != 'scale_s')} "
            f"in {applied['scale_s']:.1f}s",
            flush=True,
        )
    return applied
