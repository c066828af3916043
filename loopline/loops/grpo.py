"""GRPO-family RL: rollout -> score -> advantages -> update -> weight sync -> log, one step at a time; with
grpo.max_staleness = k >= 1 the rollouts of the next batches run on a thread meanwhile (loops.stream).

One loop runs the family; the config picks the parts once, up front:
- grpo.advantage: the estimator (loops.estimators.ESTIMATORS); `gae` adds a critic, which makes it PPO.
- grpo.policy_loss: the surrogate (algorithms.policy_loss.PolicyLoss, built by training.policy.grpo_loss), with
  clip-higher and dual clip.
- grpo.kl_in / kl_controller: KL to the reference as a loss term or a reward penalty; fixed or adaptive.
- DAPO extras: dynamic sampling (collect), overlong shaping and truncated-completion masking.

Checkpoints hold, besides the policy, the frozen reference (kl_coef > 0), the KL controller, the critic,
the engines' sampling generators and the batches generated ahead, so a resumed run continues exactly as the
uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from loopline.algorithms.dapo import mask_truncated, overlong_penalty
from loopline.algorithms.kl import AdaptiveKLController, FixedKLController
from loopline.algorithms.losses import BehaviourWeights, behaviour_weights, kl_estimate, logprob_mismatch
from loopline.checkpoint.faults import FAULTS
from loopline.checkpoint.state import CheckpointParts, LoopState, RunState, load_loop_state
from loopline.config import GRPOConfig
from loopline.data.batches import RolloutBatch, TokenBatch, collate
from loopline.data.sampler import Sampler

# Scored stays importable from here: the async checkpoints written before collect.py existed pickle it by this name
from loopline.loops.collect import Scored, StageTimer, collect, reward_function
from loopline.loops.context import (
    SCALE_REQUEST,
    RunContext,
    apply_scale_request,
    evaluate,
    sampling_params,
    sync_engine,
)
from loopline.loops.estimators import ESTIMATORS, Signals
from loopline.loops.no_signal import Sample, warn
from loopline.loops.stream import RolloutStream, too_stale
from loopline.rollout.engine import Completion
from loopline.runtime.protocols import Critic
from loopline.training.critic import ValueBatch, ValueStepStats
from loopline.training.policy import PolicyStepStats, grpo_loss
from loopline.training.replay import sample_routes

B = TypeVar("B", bound=TokenBatch)
log = logging.getLogger(__name__)


def model_mask(masks: list[list[int]], response_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) the response mask with each row's multi-turn mask laid over its first columns (0 on observations)."""
    out = torch.zeros_like(response_mask)
    for row, mask in enumerate(masks):
        out[row, : len(mask)] = torch.tensor(mask, dtype=response_mask.dtype)
    return out * response_mask


def _kl_controller(cfg: GRPOConfig) -> FixedKLController | AdaptiveKLController:
    if cfg.kl_controller == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def engine_logprobs(completions: list[Completion], width: int) -> torch.Tensor:
    """The log-probs the engine reported for each completion's tokens, as response columns (B, width), 0 past
    each completion's end (multi-turn: 0 on observations, which the mask leaves out)."""
    out = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, c in enumerate(completions):
        out[row, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return out


def minibatch_rows(size: int, minibatches: int) -> list[torch.Tensor]:
    """Row indices of `minibatches` equal slices of a shuffled batch; in order (no RNG drawn) for one."""
    order = torch.randperm(size) if minibatches > 1 else torch.arange(size)
    return list(order.chunk(minibatches))


def _check_resumable(
    cfg: GRPOConfig, state: RunState, resume: CheckpointParts | None, loop: LoopState
) -> None:
    """A resumed phase needs what its settings use from the checkpoint; fail before training on a stand-in."""
    # the reference comes with the actor's part of the checkpoint; the critic and the KL controller with the loop's
    needed = [
        (
            "frozen reference policy (grpo.kl_coef > 0)",
            cfg.kl_coef > 0,
            resume is not None and resume.reference is not None,
        ),
        ("critic (grpo.advantage=gae)", cfg.advantage == "gae", loop.critic is not None),
        (
            "adaptive KL controller (grpo.kl_controller=adaptive)",
            cfg.kl_controller == "adaptive",
            loop.kl is not None,
        ),
    ]
    missing = [what for what, need, has in needed if need and not has]
    if missing:
        raise ValueError(
            f"cannot resume grpo at step {state.step}: the checkpoint has no {' and no '.join(missing)}; it was "
            "written with other grpo settings (or by an older loopline). Resume with the settings it was "
            "written with, or start afresh without --resume"
        )


def _restore_loop(
    ctx: RunContext,
    state: RunState,
    loop: LoopState,
    kl_control: FixedKLController | AdaptiveKLController,
) -> None:
    """A resumed phase: the KL controller and engine generators as the checkpoint holds them (the critic
    restores itself as it starts: _start_critic)."""
    if loop.kl is not None:
        kl_control.load_state_dict(loop.kl)
    # a different number of engines cannot replay the samples: each engine is seeded from (seed, step, rank)
    reseed = ctx.cfg.seed + 1 + 1_000_003 * state.step
    if not ctx.rollout.set_rng_states(loop.engine_rng, reseed):
        log.warning(
            "grpo step %d: the checkpoint's engine sampling states do not fit these engines (another number of "
            "engines, or another backend): engines reseeded from %d, so this run does not replay the "
            "uninterrupted one exactly",
            state.step,
            reseed,
        )


def _loop_state(
    kl_control: FixedKLController | AdaptiveKLController,
    critic: Critic | None,
    engine_rng: list,
    pending: list[Scored],
) -> LoopState:
    """What a checkpoint needs of the loop beyond the policy: KL controller, critic, and as of the last weight
    sync the engines' generators and the batches generated ahead of training (grpo.max_staleness)."""
    return LoopState(
        kl=kl_control.state_dict(),
        engine_rng=engine_rng,
        buffer=pending,
        critic=critic.state()
        if critic is not None
        else None,  # local: its whole state; ray: where its shards are
    )


def _start_critic(
    ctx: RunContext,
    policy: PreTrainedModel,
    total_steps: int,
    loop: LoopState,
    resume: CheckpointParts | None,
) -> Critic | None:
    """PPO's critic (grpo.advantage=gae) from the policy's body, or as the resumed checkpoint holds it; from
    now on its part of each checkpoint is written with the actor's (CheckpointWithCritic)."""
    critic = ctx.critic
    if critic is None:  # the roles start one when grpo.advantage=gae
        return None
    checkpoint = resume.checkpoint if resume is not None else None
    critic.start_phase(policy, ctx.cfg.critic, total_steps, loop.critic, checkpoint)
    return critic


def train_grpo(ctx: RunContext, state: RunState, resume: CheckpointParts | None = None) -> RunState:
    """Run the GRPO family from `state` (phase 'grpo') to cfg.grpo.steps, or to the first validation check at
    cfg.grpo.stop_at_accuracy; returns the final state. resume: the parts of the checkpoint `state` was read from."""
    cfg = ctx.cfg.grpo
    params = sampling_params(cfg.sampling)
    sampler = Sampler(len(ctx.train_rows), seed=ctx.cfg.seed + 1)
    if state.sampler:
        sampler.load_state_dict(state.sampler)
    loop = load_loop_state(resume) if state.step > 0 else LoopState()
    if state.step > 0:
        _check_resumable(cfg, state, resume, loop)
    # PPO's critic starts from the policy as RL starts: the driver's model takes the trained weights here,
    # before start_phase makes the phase's optimizer (gathering a fresh optimizer's state would initialise it)
    policy = ctx.actor.policy() if ctx.critic is not None else ctx.model
    # The reference policy is the policy as RL starts (after SFT), frozen (a resumed run reads it back).
    # The policy objective is built once; each step passes only the KL coefficient the controller sets.
    loss = grpo_loss(cfg)
    ctx.actor.start_phase(
        cfg.optim,
        cfg.steps,
        resume,
        reference=cfg.kl_coef > 0,
        loss=loss,
        micro_batch_size=cfg.micro_batch_size,
    )
    estimate = ESTIMATORS[cfg.advantage]
    updates = cfg.steps * cfg.epochs_per_step * cfg.minibatches
    # Building the parts must not move the RNG: a resumed run builds them at a later point of its stream.
    with torch.random.fork_rng(devices=[]):
        reward = reward_function(ctx)
        # PPO: the critic starts as a copy of the policy's body (after SFT) with a zero head
        critic = _start_critic(ctx, policy, updates, loop, resume)
    kl_control = _kl_controller(cfg)
    if state.step > 0:
        _restore_loop(ctx, state, loop, kl_control)
    # trainer log-probs before the update: the ratio's denominator after the first update, and the reward KL
    need_old = cfg.epochs_per_step * cfg.minibatches > 1 or cfg.kl_in == "reward"
    sync_engine(ctx, version=state.step)

    def produce(b: int) -> Scored:
        """Batch b, collected on the rollout lane (the producer's thread with max_staleness >= 1)."""
        timer = StageTimer(ctx.watchdog, ctx.trace, "rollout")
        scored = collect(ctx, sampler, params, timer, reward)
        scored.seconds = timer.seconds
        return scored

    def snapshot() -> dict:
        """What a checkpoint needs of the rollout lane after a batch: the sampler (the engines' generators are read
        at the sync: exact on the fixed schedule, where no batch is in flight then)."""
        return sampler.state_dict()

    # max_staleness = k >= 1: batches are collected up to k versions ahead, on a thread, while the trainer trains
    stream = RolloutStream(
        produce, snapshot, cfg.max_staleness, state.step, cfg.steps, loop.buffer, state.step,
        partial=cfg.partial_rollouts != "none",
    )  # fmt: skip
    engine_rng, pending = loop.engine_rng, list(loop.buffer)  # as of the last sync: what a checkpoint holds
    bar = tqdm(total=cfg.steps, initial=state.step, desc="grpo", disable=not ctx.cfg.progress, leave=False)
    try:
        while state.step < cfg.steps and not state.done:
            row, engine_rng, pending = _grpo_step(ctx, state, stream, estimate, critic, kl_control, need_old)
            last = _evaluate(ctx, state, stream, row)
            ctx.logger.log(row)
            # test hook: a kill between a step's row and its checkpoint
            FAULTS.pause_point(f"step:grpo:{state.step}")
            stop = ctx.stop.requested  # SIGINT/SIGTERM came: checkpoint this step, then leave (loops.stop)
            if last or stop or (ctx.cfg.checkpoint_every and state.step % ctx.cfg.checkpoint_every == 0):
                _save(ctx, state, _loop_state(kl_control, critic, engine_rng, pending))
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=row.get("eval_accuracy", "-"))
            if stop:
                bar.close()
                ctx.stop.check(state)
    finally:
        stream.close()
        bar.close()
    return state


def _save(ctx: RunContext, state: RunState, loop_state: LoopState) -> None:
    """A checkpoint of the step (with the frozen reference when there is a KL term), and the trace so far."""
    with ctx.watchdog.stage("checkpoint"):
        ctx.checkpoints.save(state, loop_state, reference=ctx.cfg.grpo.kl_coef > 0)
        ctx.trace.write(ctx.run_dir / "trace.json")


def _evaluate(ctx: RunContext, state: RunState, stream: RolloutStream[Scored, dict], row: dict) -> bool:
    """After a step: the validation check of grpo.stop_at_accuracy and the eval of grpo.eval_every, into `row`;
    whether this is the phase's last step."""
    cfg = ctx.cfg.grpo
    if cfg.stop_at_accuracy is not None and ctx.val_rows and state.step % cfg.check_every == 0:
        with stream.engines(), ctx.watchdog.stage("eval"):
            state.val_accuracy = row["val_accuracy"] = evaluate(ctx, ctx.val_rows)["eval_accuracy"]
        # a fixed skill level, whatever step float noise puts it at (as SFT's stopping rule)
        state.done = state.val_accuracy >= cfg.stop_at_accuracy
    last = state.step == cfg.steps or state.done
    if last or (cfg.eval_every and state.step % cfg.eval_every == 0):
        with stream.engines(), ctx.watchdog.stage("eval"):
            t0 = time.perf_counter()
            row.update(evaluate(ctx))
            ctx.trace.span("trainer", "eval", t0, time.perf_counter())
    return last


def scale_between_batches(ctx: RunContext, stream: RolloutStream) -> dict[str, float]:
    """`loopline scale`: engines / env workers join or leave between two batches, when a request is there (only
    then does the trainer wait for a batch in flight: an unconditional wait would undo the overlap)."""
    if not (ctx.run_dir / SCALE_REQUEST).exists():
        return {}
    with stream.engines():
        return apply_scale_request(ctx)


def _grpo_step(
    ctx: RunContext,
    state: RunState,
    stream: RolloutStream[Scored, dict],
    estimate: Callable,
    critic: Critic | None,
    kl_control: FixedKLController | AdaptiveKLController,
    need_old: bool,
) -> tuple[dict, list, list[Scored]]:
    """One RL step on batch state.step: experience, update, weight sync. Returns its metrics row (before eval)
    and, as of the sync, the engines' generators and the batches generated ahead (what a checkpoint holds)."""
    cfg = ctx.cfg.grpo
    started = time.perf_counter()
    timer = StageTimer(ctx.watchdog, ctx.trace, "trainer")
    scaled = scale_between_batches(ctx, stream)

    # 1-2. Rollout and score: group_size samples of each prompt from the engine's policy, verifier scores
    # (collected ahead on the rollout lane with max_staleness >= 1, at most that many versions behind).
    asked = time.perf_counter()
    scored, waited = stream.take(state.step)
    if waited:
        ctx.trace.span("trainer", "wait", asked, asked + waited)
    dropped = sum(too_stale(state.step, c.policy_version, cfg.max_staleness) for c in scored.completions)
    if dropped:  # only a run resumed with a smaller max_staleness: this batch is collected again, now
        log.warning(
            "grpo step %d: %d samples were generated more than grpo.max_staleness=%d versions ago: dropped, and "
            "the batch collected again",
            state.step,
            dropped,
            cfg.max_staleness,
        )
        scored = stream.recollect(state.step)

    # 3. Experience: tokens, masks, shaped rewards, reference/old log-probs, values, advantages.
    with timer("experience"):
        exp = _experience(ctx, scored, estimate, critic, kl_control, need_old)

    # 4. Train: epochs_per_step passes, each of `minibatches` optimizer steps on shuffled slices.
    with timer("train"):
        update = _train(ctx, exp, critic, kl_control)

    # 5. Weight sync: the engine samples the next batches from the updated policy (with max_staleness = k,
    # once the batches due under the weights it holds are all generated: up to k versions old when trained).
    trained_at = state.step  # the policy version the batch was trained at
    with timer("sync"):
        state.step += 1
        ctx.ledger.record("grpo", state.step, scored.ids)
        waited += stream.ready_to_sync(state.step)
        sync_engine(ctx, version=state.step)
        state.policy_version = state.step
        # what a checkpoint of this step holds: the batches generated ahead and the sampler after them
        pending, state.sampler = stream.checkpoint()
        engine_rng = ctx.rollout.rng_states()
        stream.synced(state.step)

    # 6. Metrics (eval and checkpoint: the caller's)
    row = _metrics_row(ctx, state, scored, exp, update, timer, scaled)
    if cfg.max_staleness:
        row.update(_async_metrics(scored, trained_at, cfg.max_staleness, waited, stream, started))
    if cfg.max_staleness or dropped:
        row["stale_dropped"] = dropped
    if ctx.no_signal.needed:  # every advantage 0 for grpo.no_signal_steps in a row: say so
        _watch_signal(ctx, state, scored, exp.rewards, row["truncated_fraction"])
    row["time_step"] = time.perf_counter() - started  # the step's wall time, as the rows before eval
    return row, engine_rng, pending


@dataclass
class Experience:
    """Stage 3's output: the batch to train on, and what the critic and the metrics row read beside it."""

    tokens: TokenBatch  # (B, P + C); response_mask: the trained tokens
    batch: RolloutBatch
    lengths: torch.Tensor  # (B,) response tokens (multi-turn: the model's), before truncation masking
    truncated: torch.Tensor  # (B,) bool: the completion hit the token limit
    rewards: torch.Tensor  # (B,) shaped rewards
    reward_kl: torch.Tensor | None  # (B, C) grpo.kl_in=reward
    values: torch.Tensor | None  # (B, C) the critic's, PPO
    returns: torch.Tensor | None  # (B, C) the critic's targets, PPO
    correction: BehaviourWeights | None  # grpo.behaviour_correction
    mismatch: (
        tuple[float, float] | None
    )  # (KL, max-abs) of the engine's sampled log-probs against the trainer's


def _experience(
    ctx: RunContext,
    scored: Scored,
    estimate: Callable,
    critic: Critic | None,
    kl_control: FixedKLController | AdaptiveKLController,
    need_old: bool,
) -> Experience:
    """Tokens, masks, shaped rewards, reference/old log-probs, values and advantages of a scored batch."""
    cfg = ctx.cfg.grpo
    completions = scored.completions
    tokens = collate(scored.prompts, [c.token_ids for c in completions], ctx.tokenizer.pad_token_id)
    if scored.model_masks is not None:  # multi-turn: observations are not trained
        tokens = replace(tokens, response_mask=model_mask(scored.model_masks, tokens.response_mask))
    lengths = tokens.response_mask.sum(dim=1)  # (B,) trained tokens
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])  # (B,)
    rewards = scored.scores  # (B,)
    if cfg.overlong_buffer:
        rewards = rewards + overlong_penalty(
            lengths, cfg.sampling.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty
        )
    mask = mask_truncated(tokens.response_mask, truncated) if cfg.mask_truncated else tokens.response_mask
    # an MoE engine's routes: the trainer's forwards compare with them or replay them (grpo.routing_replay); a
    # pipelined trainer's forwards do not take them
    routes = (
        sample_routes(
            [c.routes for c in completions],
            [len(p) for p in scored.prompts],
            tokens.prompt_len,
            tokens.input_ids.shape[1],
        )
        if ctx.cfg.runtime.trainer_pp == 1
        else None
    )
    tokens = replace(tokens, response_mask=mask, routes=routes)  # (B, C) trained tokens
    ref_logprobs = ctx.actor.logprobs(tokens, reference=True) if cfg.kl_coef > 0 else None
    correction, mismatch = None, None
    if cfg.behaviour_correction != "none":
        # the trainer's log-probs as trained (the ratio's denominator) and as sampled (against the engine's)
        old_logprobs, proximal = ctx.actor.behaviour_logprobs(tokens, cfg.sampling.temperature)
        behaviour = engine_logprobs(completions, mask.shape[1])
        correction = behaviour_weights(proximal, behaviour, mask, cfg.behaviour_correction, cfg.behaviour_cap)
        mismatch = logprob_mismatch(proximal, behaviour, mask)
    else:
        old_logprobs = ctx.actor.logprobs(tokens) if need_old else None
        if ctx.cfg.engine_dtype != ctx.cfg.compute_dtype:  # engine and trainer differ: measure by how much
            _, proximal = ctx.actor.behaviour_logprobs(tokens, cfg.sampling.temperature)
            mismatch = logprob_mismatch(proximal, engine_logprobs(completions, mask.shape[1]), mask)
    reward_kl = kl_estimate(old_logprobs, ref_logprobs, cfg.kl_estimator) if cfg.kl_in == "reward" else None
    values = critic.values(tokens) if critic else None
    signals = Signals(rewards, mask, reward_kl, kl_control.value, values)
    advantages, returns = estimate(signals, cfg)  # (B,) or (B, C); returns (B, C) for the critic
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, mask, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs if cfg.kl_in == "loss" else None, advantages=advantages, rewards=rewards,
        is_weights=correction.weights if correction else None, routes=routes,
    )  # fmt: skip
    return Experience(
        tokens, batch, lengths, truncated, rewards, reward_kl, values, returns, correction, mismatch
    )


@dataclass
class Update:
    """Stage 4's output: the last minibatch's stats (the critic's too, PPO) and the KL the controller saw."""

    stats: PolicyStepStats
    critic_stats: ValueStepStats | None
    measured_kl: float
    kl_coef: float  # the coefficient the step trained with (the controller's before its update)


def _train(
    ctx: RunContext,
    exp: Experience,
    critic: Critic | None,
    kl_control: FixedKLController | AdaptiveKLController,
) -> Update:
    """epochs_per_step passes over the batch, each of `minibatches` optimizer steps on shuffled slices; then the
    KL controller's update."""
    cfg = ctx.cfg.grpo
    batch, tokens, mask = exp.batch, exp.tokens, exp.tokens.response_mask
    loss_kl_coef = kl_control.value if cfg.kl_in == "loss" else 0.0
    critic_stats = None
    for _ in range(cfg.epochs_per_step):
        for rows in minibatch_rows(len(batch), cfg.minibatches):
            stats = ctx.actor.policy_step(batch.select(rows), loss_kl_coef)
            if critic is not None and exp.values is not None and exp.returns is not None:
                value_batch = ValueBatch(
                    tokens.input_ids, tokens.attention_mask, mask, exp.values, exp.returns
                )
                critic_stats = critic.step(value_batch.select(rows))
    measured_kl = _masked_mean(exp.reward_kl, mask) if exp.reward_kl is not None else stats.kl
    kl_coef = kl_control.value
    kl_control.update(measured_kl, len(batch))
    return Update(stats, critic_stats, measured_kl, kl_coef)


def _metrics_row(
    ctx: RunContext,
    state: RunState,
    scored: Scored,
    exp: Experience,
    update: Update,
    timer: StageTimer,
    scaled: dict[str, float],
) -> dict:
    """The step's metrics row (keys declared in metrics/keys.py), before the async and the eval columns."""
    cfg = ctx.cfg.grpo
    stats, rewards, lengths = update.stats, exp.rewards, exp.lengths
    row = {
        "phase": "grpo",
        "step": state.step,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "accuracy": float(scored.correct.float().mean()),
        "loss": stats.loss,
        **stats.extra,
        "grad_norm": stats.grad_norm,
        "lr": stats.lr,
        "response_len_mean": float(lengths.mean()),
        "response_len_max": int(lengths.max()),
        "truncated_fraction": float(exp.truncated.float().mean()),
        "rollout_tokens_per_s": float(lengths.sum()) / max(scored.seconds["rollout"], 1e-9),
        "train_tokens_per_s": float(exp.tokens.attention_mask.sum())
        * cfg.epochs_per_step
        / max(timer.seconds["train"], 1e-9),
        **{f"time_{k}": v for k, v in {**scored.seconds, **timer.seconds}.items()},
        **ctx.scorer.take_stats(),  # ray: chunks scored again, env workers replaced, env workers now
    }
    row.update(scaled)
    row.update({f"episode_{k}": v for k, v in scored.episode_metrics.items()})
    if cfg.kl_coef > 0:
        row.update(kl_coef=update.kl_coef, measured_kl=update.measured_kl)
    if cfg.dynamic_sampling:
        row.update(sampling_rounds=scored.rounds, informative_fraction=scored.informative_fraction)
    if (correction := exp.correction) is not None:
        row.update(
            behaviour_weight_min=correction.low, behaviour_weight_max=correction.high,
            behaviour_weight_mean=correction.mean, behaviour_cut_fraction=correction.cut_fraction,
        )  # fmt: skip
    if exp.mismatch is not None:  # the engine's sampled log-probs against the trainer's, same tokens
        row.update(logprob_mismatch_kl=exp.mismatch[0], logprob_mismatch_max_abs=exp.mismatch[1])
    if (critic_stats := update.critic_stats) is not None:
        row.update(critic_stats.extra, value_loss=critic_stats.loss, value_grad_norm=critic_stats.grad_norm)
    return row


def _watch_signal(
    ctx: RunContext, state: RunState, scored: Scored, rewards: torch.Tensor, truncated_fraction: float
) -> None:
    """grpo.no_signal_steps: warn when every advantage has been 0 that many steps in a row, with a sample."""
    first = scored.completions[0]
    text = first.text or ctx.tokenizer.decode(first.token_ids, skip_special_tokens=True)  # multi-turn: tokens
    sample = Sample(text, ctx.train_rows[scored.ids[0][1]].answer, float(rewards[0]))
    warn(ctx.no_signal.update(state.step, rewards, scored.correct, truncated_fraction, sample))


def _async_metrics(
    scored: Scored,
    trained_at: int,
    k: int,
    waited: float,
    stream: RolloutStream[Scored, dict],
    started: float,
) -> dict[str, float]:
    """max_staleness >= 1: how far behind the trained samples were (versions), how long each side waited."""
    behind = torch.tensor([trained_at - c.policy_version for c in scored.completions], dtype=torch.float32)
    now = time.perf_counter()
    return {
        "staleness_mean": float(behind.mean()),
        "staleness_max": int(behind.max()),
        **{f"staleness_{v}": float((behind == v).float().mean()) for v in range(k + 1)},
        "partial_fraction": sum(c.partial for c in scored.completions) / len(scored.completions),
        "time_wait": waited,
        "trainer_idle_fraction": waited / max(now - started, 1e-9),
        "engine_idle_fraction": stream.idle_fraction(started, now),
    }
