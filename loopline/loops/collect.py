"""Stages 1-2 of a GRPO step: sample a batch of prompt groups on the engines (or run multi-turn episodes) and
score it (the env workers' verdicts, a reward model's scores or their sum), with DAPO's dynamic sampling; and the
per-stage timer the loop and the rollout lane share. loops.grpo trains on what `collect` returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from loopline.algorithms.dapo import informative_groups
from loopline.algorithms.reward import whiten_clip
from loopline.checkpoint.ledger import SampleId
from loopline.data.sampler import Sampler, SampleRef
from loopline.envs.multiturn import rollout_metrics
from loopline.loops.context import RunContext, encode_prompts, episodes, episodes_correct
from loopline.metrics.trace import Trace
from loopline.rollout.engine import Completion, SamplingParams
from loopline.rollout.trajectory import Trajectory
from loopline.runtime.watchdog import Watchdog
from loopline.training.critic import RewardModelScorer


class StageTimer:
    """Wall time per named stage of one step; the run's watchdog (if given) fails a stage that hangs; the run's
    trace (if given) gets each stage as a span on `lane`."""

    def __init__(
        self, watchdog: Watchdog | None = None, trace: Trace | None = None, lane: str = "trainer"
    ) -> None:
        self.seconds: dict[str, float] = {}
        self.watchdog, self.trace, self.lane = watchdog, trace, lane

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        with self.watchdog.stage(stage) if self.watchdog else nullcontext():
            yield
        t1 = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + t1 - t0
        if self.trace is not None:
            self.trace.span(self.lane, stage, t0, t1)


@dataclass
class Scored:
    """One step's scored completions: group_size per prompt, the samples of a prompt contiguous. A multi-turn
    episode is one completion: its tokens are the model's turns and the observations between them."""

    prompts: list[list[int]]  # (B) prompt token ids of each completion
    completions: list[Completion]  # (B)
    ids: list[SampleId]  # (B) stable id of each completion: (epoch, prompt index, sample index)
    scores: torch.Tensor  # (B,) rewards: the verifier's, a reward model's or their sum (reward.source)
    verified: torch.Tensor  # (B,) the env's rewards alone
    correct: torch.Tensor  # (B,) bool: the env counts the completion correct (accuracy)
    rounds: int  # generate calls it took
    informative_fraction: float  # of all groups generated, those whose scores were not all equal
    model_masks: list[list[int]] | None = None  # (B) multi-turn: 1 on the model's tokens, 0 on observations
    episode_metrics: dict[str, float] = field(default_factory=dict)  # multi-turn: turns, tool calls, endings
    seconds: dict[str, float] = field(default_factory=dict)  # time per stage of its collect (rollout, score)


@dataclass
class _Group:
    """One prompt's group_size completions, scored."""

    prompts: list[list[int]]  # of each completion (an agent program may prompt each of its runs its own way)
    completions: list[Completion]
    scores: torch.Tensor
    verified: torch.Tensor
    correct: torch.Tensor
    ref: SampleRef
    model_masks: list[list[int]] | None


def _episodes_as_completions(trajs: list[Trajectory], n: int) -> list[Completion]:
    """Multi-turn episodes in the shape of the engine's completions (group g's samples at g*n..g*n+n-1); an episode
    that ended without the env ending it (turn or token limit) counts as truncated."""
    return [
        Completion(
            k // n,
            k % n,
            t.tokens,
            t.logprobs,
            "",
            "stop" if t.finish == "done" else "length",
            t.policy_version,
            partial=t.partial,
        )
        for k, t in enumerate(trajs)
    ]


def collect(
    ctx: RunContext,
    sampler: Sampler,
    params: SamplingParams,
    timer: StageTimer,
    reward: RewardFn | None = None,
) -> Scored:
    """Sample and score prompts_per_step groups (multi-turn envs: run group_size episodes of each prompt). With
    dynamic_sampling, groups whose scores are all equal (no gradient) are set aside and more prompts sampled, for at
    most max_sampling_rounds generate calls; if the batch is still short, set-aside groups fill it, so every step
    trains on the same number of rows."""
    cfg = ctx.cfg.grpo
    env = ctx.cfg.env
    reward = reward or verifier_reward
    n = cfg.group_size
    kept: list[_Group] = []
    spare: list[_Group] = []
    trajs_seen: list[Trajectory] = []
    generated, rounds = 0, 0
    while len(kept) < cfg.prompts_per_step and rounds < (
        cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    ):
        rounds += 1
        masks: list[list[int]] | None = None
        with timer("rollout"):
            refs = sampler.next_batch(cfg.prompts_per_step)
            rows = [ctx.train_rows[ref.index] for ref in refs]
            if env.multi_turn:  # the env workers step the episodes between the engines' turns
                trajs = episodes(ctx, [row for row in rows for _ in range(n)], cfg.sampling)
                trajs_seen += trajs
                prompts = [t.prompt_ids for t in trajs]  # (B)
                completions = _episodes_as_completions(trajs, n)
                masks = [t.mask for t in trajs]
            else:
                encoded = encode_prompts(ctx.tokenizer, rows, ctx.cfg.model.use_chat_template)
                completions = ctx.rollout.generate(encoded, params, n=n)
                prompts = [encoded[c.prompt_index] for c in completions]  # (B)
        with timer("score"):
            if env.multi_turn:  # scored as they ran
                verified = torch.tensor([t.total_return(env.returns) for t in trajs])  # (B,)
                correct = episodes_correct(trajs)  # (B,)
            else:
                answered = [rows[c.prompt_index] for c in completions]
                verdicts = ctx.scorer.score([c.text for c in completions], answered)
                verified, correct = verdicts.rewards, verdicts.correct  # (B,) the env's rewards, (B,) bool
            scores = reward(verified, prompts, completions)  # (B,)
        informative = (
            informative_groups(scores, n) if cfg.dynamic_sampling else torch.ones(len(rows), dtype=torch.bool)
        )
        for g, useful in enumerate(informative.tolist()):
            rows_g = slice(g * n, (g + 1) * n)
            group = _Group(
                prompts[rows_g], completions[rows_g], scores[rows_g], verified[rows_g], correct[rows_g], refs[g],
                masks[rows_g] if masks is not None else None,
            )  # fmt: skip
            (kept if useful else spare).append(group)
        generated += len(rows)
    groups = (kept + spare)[: cfg.prompts_per_step]
    return Scored(
        prompts=[p for g in groups for p in g.prompts],
        completions=[c for g in groups for c in g.completions],
        ids=[(g.ref.epoch, g.ref.index, c.sample_index) for g in groups for c in g.completions],
        scores=torch.cat([g.scores for g in groups]),
        verified=torch.cat([g.verified for g in groups]),
        correct=torch.cat([g.correct for g in groups]),
        rounds=rounds,
        informative_fraction=len(kept) / generated,
        model_masks=[m for g in groups for m in g.model_masks] if env.multi_turn else None,
        episode_metrics=rollout_metrics(trajs_seen, env.returns) if trajs_seen else {},
    )


# (verifier scores (B,), prompt ids of each completion, completions) -> rewards (B,)
RewardFn = Callable[[torch.Tensor, list[list[int]], list[Completion]], torch.Tensor]


def verifier_reward(
    verified: torch.Tensor, prompts: list[list[int]], completions: list[Completion]
) -> torch.Tensor:
    """reward.source=verifier: the verifier's scores as they are."""
    return verified


def reward_function(ctx: RunContext) -> RewardFn:
    """The reward of reward.source: the verifier's, a trained reward model's, or their sum (RLHF); the model's
    scores whitened over the step's batch and/or clipped first (reward.model_norm, model_clip)."""
    cfg = ctx.cfg.reward
    if cfg.source == "verifier":
        return verifier_reward
    tok = ctx.tokenizer
    model = RewardModelScorer.load(
        cfg.model_path, tok.pad_token_id, tok.eos_token_id, cfg.batch_size, ctx.cfg.model.packing
    )
    verifier_weight = 1.0 if cfg.source == "sum" else 0.0

    def reward(
        verified: torch.Tensor, prompts: list[list[int]], completions: list[Completion]
    ) -> torch.Tensor:
        learned = model.score(prompts, [c.token_ids for c in completions])  # (B,)
        if cfg.model_norm == "batch":
            learned = whiten_clip(learned, cfg.model_clip)
        elif cfg.model_clip is not None:
            learned = learned.clamp(-cfg.model_clip, cfg.model_clip)
        return verifier_weight * verified + cfg.model_coef * learned

    return reward
