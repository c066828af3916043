"""GRPO, synchronous: rollout -> score -> advantages -> update -> weight sync -> log, one step at a time."""

from __future__ import annotations

import time
from contextlib import contextmanager

from tqdm import tqdm

from loopline.algorithms.advantages import group_advantages
from loopline.checkpoint.state import RunState, save_checkpoint
from loopline.data.batches import RolloutBatch, collate
from loopline.data.sampler import Sampler
from loopline.loops.context import RunContext, encode_prompt, evaluate, sampling_params, sync_engine


class StageTimer:
    """Wall time per named stage of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def train_grpo(ctx: RunContext, state: RunState, trainer_state: dict | None = None) -> RunState:
    """Run GRPO from `state` (phase 'grpo') to cfg.grpo.steps; returns the final state."""
    cfg = ctx.cfg.grpo
    params = sampling_params(cfg.sampling)
    sampler = Sampler(len(ctx.train_rows), seed=ctx.cfg.seed + 1)
    if state.sampler:
        sampler.load_state_dict(state.sampler)
    if cfg.kl_coef > 0 and state.step > 0:
        raise NotImplementedError("resuming GRPO with kl_coef > 0 needs the reference weights in the checkpoint")
    # The reference policy is the policy as RL starts (after SFT), frozen.
    ctx.actor.start_phase(cfg.optim, cfg.steps, trainer_state, reference=cfg.kl_coef > 0)
    sync_engine(ctx, version=state.step)
    pad_id = ctx.tokenizer.pad_token_id

    bar = tqdm(total=cfg.steps, initial=state.step, desc="grpo", disable=not ctx.cfg.progress, leave=False)
    while state.step < cfg.steps:
        timer = StageTimer()

        # 1. Rollout: group_size samples of each prompt from the engine's current policy.
        with timer("rollout"):
            rows = [ctx.train_rows[ref.index] for ref in sampler.next_batch(cfg.prompts_per_step)]
            prompts = [encode_prompt(ctx.tokenizer, row, ctx.cfg.model.use_chat_template) for row in rows]
            completions = ctx.rollout.generate(prompts, params, n=cfg.group_size)

        # 2. Score: verifier reward per completion.
        with timer("score"):
            answers = [rows[c.prompt_index].answer for c in completions]
            rewards = ctx.scorer.score([c.text for c in completions], answers)  # (B,)

        # 3. Experience: tokens, masks, advantages, reference (and, for several epochs, old) log-probs.
        with timer("experience"):
            tokens = collate([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions], pad_id)
            advantages = group_advantages(rewards, cfg.group_size, cfg.adv_scale, cfg.adv_eps)  # (B,)
            ref_logprobs = ctx.actor.logprobs(tokens, reference=True) if cfg.kl_coef > 0 else None
            # one update per rollout is on-policy: the trainer's own log-probs are the behaviour's
            old_logprobs = ctx.actor.logprobs(tokens) if cfg.epochs_per_step > 1 else None
            batch = RolloutBatch(
                tokens.input_ids, tokens.attention_mask, tokens.response_mask,
                old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, advantages=advantages, rewards=rewards,
            )  # fmt: skip

        # 4. Train: epochs_per_step optimizer steps over micro-batches with gradient accumulation.
        with timer("train"):
            for _ in range(cfg.epochs_per_step):
                stats = ctx.actor.grpo_step(batch, cfg)

        # 5. Weight sync: the engine samples the next step from the updated policy.
        with timer("sync"):
            state.step += 1
            sync_engine(ctx, version=state.step)
        state.sampler = sampler.state_dict()

        # 6. Metrics, held-out eval, checkpoint.
        lengths = tokens.response_mask.sum(dim=1)
        row = {
            "phase": "grpo",
            "step": state.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "accuracy": float((rewards > 0).float().mean()),
            "loss": stats.loss,
            **stats.extra,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "response_len_mean": float(lengths.mean()),
            "response_len_max": int(lengths.max()),
            "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "rollout_tokens_per_s": float(lengths.sum()) / max(timer.seconds["rollout"], 1e-9),
            "train_tokens_per_s": float(tokens.attention_mask.sum()) * cfg.epochs_per_step
            / max(timer.seconds["train"], 1e-9),
            **{f"time_{k}": v for k, v in timer.seconds.items()},
        }
        last = state.step == cfg.steps
        if last or (cfg.eval_every and state.step % cfg.eval_every == 0):
            row.update(evaluate(ctx))
        ctx.logger.log(row)
        if last or (ctx.cfg.checkpoint_every and state.step % ctx.cfg.checkpoint_every == 0):
            model, trainer_state = ctx.actor.state()
            save_checkpoint(ctx.run_dir, state, model, ctx.tokenizer, trainer_state)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=row.get("eval_accuracy", "-"))
    bar.close()
    return state
