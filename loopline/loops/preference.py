"""Offline preference training: DPO on the policy, and a Bradley-Terry reward model on its body.

Both read pairs (loopline.data.preference), step over shuffled batches of them and report held-out
pairwise metrics. DPO's reference is the policy as DPO starts (after the SFT warm start): its summed
log-probs of every pair are computed once up front (dpo.reference=precomputed), or by a frozen copy for
each batch (online). DPO reports the implicit-reward preference accuracy (TRL's rewards/accuracies: 0 at
the start, where policy = reference) and the policy's own preference, log p(chosen) > log p(rejected).
dpo.nll_coef adds the chosen completion's NLL (RPO): on near-duplicate pairs, such as the built-in ones
that differ in a digit, plain DPO lowers the likelihood of both completions and with it task accuracy.
With preference.rejected=policy the built-in pairs are rebuilt from the policy's own samples (after the
SFT warm start), labelled by the verifier, for both the training and the held-out pairs.

Both train on the actor role (runtime.actor), so that the same code runs on either backend: DPO steps the
policy itself and checkpoints it like SFT (every checkpoint_every steps and at the end, phase 'dpo'), with the
pairs it trains on and their reference log-probs (or, dpo.reference=online, the frozen reference), so that
`loopline dpo --resume` continues exactly; the reward model is a model of its own on the actor's ranks, fetched
whole at the end.

The reward model checkpoints like DPO (phase 'rm'): the policy as the warm start left it, the reward model's own
shards (weights, optimizer, LR schedule) in the checkpoint's reward/ directory and the pairs in loop.pt, so that
`loopline rm --resume` (and a restart after a lost trainer rank) continues exactly.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from tqdm import tqdm

from loopline.checkpoint.faults import FAULTS
from loopline.checkpoint.state import CheckpointParts, LoopState, RunState, load_loop_state
from loopline.data.batches import collate
from loopline.data.datasets import PromptRow
from loopline.data.preference import PairBatch, PreferencePair, policy_pairs
from loopline.data.sampler import Sampler
from loopline.errors import UserError
from loopline.loops.context import (
    RunContext,
    encode_prompt,
    encode_prompts,
    evaluate,
    sampling_params,
    sync_engine,
)
from loopline.training.critic import ScalarModel, pairwise_accuracy

# pairs per forward outside training (reference log-probs, held-out metrics)
_EVAL_CHUNK = 256


def encode_pairs(ctx: RunContext, pairs: list[PreferencePair]) -> PairBatch:
    """Token batches of prompt + chosen and prompt + rejected; completions end with EOS, as SFT targets do."""
    tok = ctx.tokenizer
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    prompts = [
        encode_prompt(tok, PromptRow(p.index, p.prompt, messages=p.messages), ctx.cfg.model.use_chat_template)
        for p in pairs
    ]

    def target(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + eos

    chosen = collate(prompts, [target(p.chosen) for p in pairs], tok.pad_token_id)
    rejected = collate(prompts, [target(p.rejected) for p in pairs], tok.pad_token_id)
    return PairBatch(chosen, rejected, torch.tensor([p.margin for p in pairs], dtype=torch.float32))


def sample_policy_pairs(ctx: RunContext, rows: list[PromptRow], seed: int) -> list[PreferencePair]:
    """Pairs of `rows` against the current policy's wrong samples (data.preference.policy_pairs): the
    engine samples preference.policy_samples completions per prompt with grpo.sampling (as RL will),
    the verifier labels them."""
    k = ctx.cfg.preference.policy_samples
    params = sampling_params(ctx.cfg.grpo.sampling, seed=seed)
    sync_engine(ctx, version=0)
    samples: list[list[str]] = []
    correct: list[list[bool]] = []
    for start in range(0, len(rows), _EVAL_CHUNK):
        part = rows[start : start + _EVAL_CHUNK]
        prompts = encode_prompts(ctx.tokenizer, part, ctx.cfg.model.use_chat_template)
        completions = ctx.rollout.generate(prompts, params, n=k)  # k per prompt, contiguous
        verdicts = ctx.scorer.score(
            [c.text for c in completions], [part[c.prompt_index] for c in completions]
        ).correct  # (B,) the env's accuracy rule
        for i in range(len(part)):
            samples.append([c.text for c in completions[i * k : (i + 1) * k]])
            correct.append(verdicts[i * k : (i + 1) * k].tolist())
    return policy_pairs(rows, samples, correct, seed)


def _pairs(
    ctx: RunContext, train_pairs: list[PreferencePair], eval_pairs: list[PreferencePair]
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """The pairs to train and score: as given, or (rejected=policy) rebuilt from the policy's samples of the
    same prompts; held-out pairs capped at preference.num_eval prompts."""
    cfg = ctx.cfg.preference
    eval_pairs = eval_pairs[: cfg.num_eval]
    if cfg.rejected == "synthetic":
        return train_pairs, eval_pairs
    train_rows, eval_rows = ctx.train_rows[: len(train_pairs)], ctx.eval_rows[: len(eval_pairs)]
    # built-in pairs' chosen side is the true sum, not the SFT teacher's target (which may drop carries)
    if cfg.source == "builtin":
        train_rows = [replace(r, completion=p.chosen) for r, p in zip(train_rows, train_pairs)]
        eval_rows = [replace(r, completion=p.chosen) for r, p in zip(eval_rows, eval_pairs)]
    train = sample_policy_pairs(ctx, train_rows, ctx.cfg.seed)
    held_out = sample_policy_pairs(ctx, eval_rows, ctx.cfg.seed + 1)
    return train, held_out


def pair_logprobs(ctx: RunContext, pairs: list[PreferencePair], reference: bool = False) -> torch.Tensor:
    """Summed log-probs of (chosen, rejected) completions under the policy (or the frozen reference), (N, 2),
    without gradients."""
    out = []
    for start in range(0, len(pairs), _EVAL_CHUNK):
        batch = encode_pairs(ctx, pairs[start : start + _EVAL_CHUNK])
        chosen = ctx.actor.sequence_logprobs(batch.chosen, reference=reference)  # (b,)
        rejected = ctx.actor.sequence_logprobs(batch.rejected, reference=reference)  # (b,)
        out.append(torch.stack([chosen, rejected], 1))
    return torch.cat(out) if out else torch.zeros(0, 2)


def dpo_eval(ctx: RunContext, pairs: list[PreferencePair], ref: torch.Tensor) -> dict[str, float]:
    """Held-out DPO metrics; `ref` holds the reference's (chosen, rejected) log-probs of `pairs`."""
    if not pairs:
        return {}
    logp = pair_logprobs(ctx, pairs)  # (N, 2)
    beta = ctx.cfg.dpo.beta
    rewards = beta * (logp - ref)  # (N, 2) implicit rewards
    return {
        "eval_pref_accuracy": float((rewards[:, 0] > rewards[:, 1]).float().mean()),
        "eval_reward_margin": float((rewards[:, 0] - rewards[:, 1]).mean()),
        "eval_logp_accuracy": float((logp[:, 0] > logp[:, 1]).float().mean()),
    }


def train_dpo(
    ctx: RunContext,
    train_pairs: list[PreferencePair],
    eval_pairs: list[PreferencePair],
    state: RunState | None = None,
    resume: CheckpointParts | None = None,
) -> int:
    """DPO from the current policy (or from `state`, read from the checkpoint at `resume`) to cfg.dpo.steps; logs
    phase 'dpo' rows; returns the steps run."""
    cfg = ctx.cfg.dpo
    state = state or RunState(phase="dpo")
    # The reference is the policy as DPO starts, frozen: its log-probs up front, or the reference role's per batch.
    online = cfg.reference == "online"
    if resume is None:
        train_pairs, eval_pairs = _pairs(ctx, train_pairs, eval_pairs)
        ctx.actor.start_phase(cfg.optim, cfg.steps, None, reference=online)
        eval_ref = pair_logprobs(ctx, eval_pairs)  # (N_eval, 2)
        train_ref = None if online else pair_logprobs(ctx, train_pairs)  # (N_train, 2)
    else:  # what the phase trained on and against as it started (policy pairs were sampled from that policy)
        saved = load_loop_state(resume).dpo
        if saved is None or (saved["train_ref"] is None) != online:
            raise UserError(
                f"cannot resume dpo at step {state.step}: its checkpoint holds no pairs for dpo.reference="
                f"{cfg.reference} (written by an older loopline, or with the other dpo.reference)"
            )
        train_pairs, eval_pairs = saved["train_pairs"], saved["eval_pairs"]
        eval_ref, train_ref = saved["eval_ref"], saved["train_ref"]
        ctx.actor.start_phase(cfg.optim, cfg.steps, resume, reference=online)
    loop_state = LoopState(
        dpo={
            "train_pairs": train_pairs,
            "eval_pairs": eval_pairs,
            "eval_ref": eval_ref,
            "train_ref": train_ref,
        }
    )
    sampler = Sampler(len(train_pairs), seed=ctx.cfg.seed + 2)
    if state.sampler:
        sampler.load_state_dict(state.sampler)
    sync_engine(ctx, version=state.step)
    if state.step == 0:
        ctx.logger.log({"phase": "dpo", "step": 0, **evaluate(ctx), **dpo_eval(ctx, eval_pairs, eval_ref)})

    bar = tqdm(total=cfg.steps, initial=state.step, desc="dpo", disable=not ctx.cfg.progress, leave=False)
    for step in range(state.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        rows = [ref.index for ref in sampler.next_batch(cfg.batch_size)]
        batch = encode_pairs(ctx, [train_pairs[i] for i in rows])
        if train_ref is not None:
            batch.ref_chosen, batch.ref_rejected = train_ref[rows, 0], train_ref[rows, 1]
        else:
            batch.ref_chosen = ctx.actor.sequence_logprobs(batch.chosen, reference=True)  # (B,)
            batch.ref_rejected = ctx.actor.sequence_logprobs(batch.rejected, reference=True)  # (B,)
        with ctx.watchdog.stage("train"):
            stats = ctx.actor.dpo_step(batch, cfg)
        state.step, state.sampler = step, sampler.state_dict()
        row = {"phase": "dpo", "step": step, "loss": stats.loss, **stats.extra, "grad_norm": stats.grad_norm}
        row.update(lr=stats.lr, time_train=time.perf_counter() - t0)
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            sync_engine(ctx, version=step)
            row.update(evaluate(ctx), **dpo_eval(ctx, eval_pairs, eval_ref))
        ctx.logger.log(row)
        FAULTS.pause_point(f"step:dpo:{step}")  # test hook: a kill between a step's row and its checkpoint
        stop = ctx.stop.requested  # SIGINT/SIGTERM came: checkpoint this step, then leave (loops.stop)
        if step == cfg.steps or stop or (ctx.cfg.checkpoint_every and step % ctx.cfg.checkpoint_every == 0):
            with ctx.watchdog.stage("checkpoint"):
                ctx.checkpoints.save(state, loop_state, reference=online)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", acc=row.get("eval_pref_accuracy", "-"))
        if stop:
            bar.close()
            ctx.stop.check(state)
    bar.close()
    return cfg.steps


def rm_eval(ctx: RunContext, pairs: list[PreferencePair]) -> dict[str, float]:
    """Held-out pairwise accuracy and mean reward margin of the reward model."""
    if not pairs:
        return {}
    chosen, rejected = [], []
    for start in range(0, len(pairs), _EVAL_CHUNK):
        batch = encode_pairs(ctx, pairs[start : start + _EVAL_CHUNK])
        chosen.append(ctx.actor.reward_scores(batch.chosen))
        rejected.append(ctx.actor.reward_scores(batch.rejected))
    c, r = torch.cat(chosen), torch.cat(rejected)
    return {"eval_pair_accuracy": pairwise_accuracy(c, r), "eval_reward_margin": float((c - r).mean())}


def train_rm(
    ctx: RunContext,
    train_pairs: list[PreferencePair],
    eval_pairs: list[PreferencePair],
    state: RunState | None = None,
    resume: CheckpointParts | None = None,
) -> ScalarModel:
    """Fit a reward model (the policy's body, copied, + a scalar head) for cfg.rm.steps, from the start or (from
    `state`, read from the checkpoint at `resume`) where a checkpoint of the phase left it; returns it. Checkpoints
    as DPO does (phase 'rm'): the policy as it is, the reward model's shards, the pairs."""
    cfg = ctx.cfg.rm
    state = state or RunState(phase="rm")
    if resume is None:
        train_pairs, eval_pairs = _pairs(ctx, train_pairs, eval_pairs)
        ctx.actor.start_reward(cfg, cfg.steps)
    else:  # what the phase trained and scored on as it started (policy pairs were sampled from that policy)
        saved = load_loop_state(resume).rm
        if saved is None or resume.reward is None:
            raise UserError(
                f"cannot resume rm at step {state.step}: its checkpoint {resume.checkpoint} holds no reward model "
                "or pairs (written by an older loopline)"
            )
        train_pairs, eval_pairs = saved["train_pairs"], saved["eval_pairs"]
        ctx.actor.start_reward(cfg, cfg.steps, resume.reward)
    loop_state = LoopState(rm={"train_pairs": train_pairs, "eval_pairs": eval_pairs})
    sampler = Sampler(len(train_pairs), seed=ctx.cfg.seed + 3)
    if state.sampler:
        sampler.load_state_dict(state.sampler)
    if state.step == 0:
        ctx.logger.log({"phase": "rm", "step": 0, **rm_eval(ctx, eval_pairs)})

    bar = tqdm(total=cfg.steps, initial=state.step, desc="rm", disable=not ctx.cfg.progress, leave=False)
    for step in range(state.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = encode_pairs(ctx, [train_pairs[ref.index] for ref in sampler.next_batch(cfg.batch_size)])
        with ctx.watchdog.stage("train"):
            stats = ctx.actor.reward_step(batch)
        state.step, state.sampler = step, sampler.state_dict()
        row = {"phase": "rm", "step": step, "loss": stats.loss, **stats.extra, "grad_norm": stats.grad_norm}
        row.update(lr=stats.lr, time_train=time.perf_counter() - t0)
        if step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0):
            row.update(rm_eval(ctx, eval_pairs))
        ctx.logger.log(row)
        FAULTS.pause_point(f"step:rm:{step}")  # test hook: a kill between a step's row and its checkpoint
        stop = ctx.stop.requested  # SIGINT/SIGTERM came: checkpoint this step, then leave (loops.stop)
        if step == cfg.steps or stop or (ctx.cfg.checkpoint_every and step % ctx.cfg.checkpoint_every == 0):
            with ctx.watchdog.stage("checkpoint"):
                ctx.checkpoints.save(state, loop_state)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", acc=row.get("eval_pair_accuracy", "-"))
        if stop:
            bar.close()
            ctx.stop.check(state)
    bar.close()
    return ctx.actor.reward_model()
