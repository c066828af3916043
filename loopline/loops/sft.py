"""Supervised warm start: prompt-masked next-token loss on (prompt, completion) pairs, or for a multi-turn env on
demonstration episodes run through the env (its observations are real, and masked as in RL), and on transcripts:
chat rows that record whole episodes (data.transcripts), tokenized as the rollout builds an episode, the loss on the
assistant's tokens only."""

from __future__ import annotations

import random
import time

from tqdm import tqdm

from loopline.checkpoint.faults import FAULTS
from loopline.checkpoint.state import CheckpointParts, RunState
from loopline.data.batches import TokenBatch, collate
from loopline.data.datasets import PromptRow
from loopline.data.sampler import Sampler
from loopline.data.transcripts import is_transcript, transcript_turns
from loopline.envs.episodes import env_demonstration
from loopline.envs.multiturn import TurnFormat, WorkerEnvs, demonstrations, to_batch, transcript_trajectory
from loopline.errors import UserError
from loopline.loops.context import RunContext, encode_prompt, evaluate, sync_engine, turn_format
from loopline.rollout.trajectory import Trajectory


def sft_pair(ctx: RunContext, row: PromptRow) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids) for one row; the target ends with EOS so the model learns to stop."""
    tok = ctx.tokenizer
    if row.messages and row.messages[-1]["role"] == "assistant":
        target_text = row.messages[-1]["content"]
    else:
        target_text = row.completion or row.answer
    if not target_text:
        raise ValueError(f"SFT row {row.index} has no completion, answer or assistant message to learn")
    target = tok(target_text, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        target = target + [tok.eos_token_id]
    return encode_prompt(tok, row, ctx.cfg.model.use_chat_template), target


def demonstration_actions(ctx: RunContext, row: PromptRow, rng: random.Random) -> list[str]:
    """A multi-turn env's demonstration of `row`, as action texts: the env's own (its spec's, e.g. the calculator's
    tool call then answer), else the row's target as the one action."""
    own = env_demonstration(ctx.cfg.env, row, rng)
    if own is not None:
        return own
    if row.messages and row.messages[-1]["role"] == "assistant":
        return [row.messages[-1]["content"]]
    return [row.completion or row.answer]


def sft_batch(ctx: RunContext, rows: list[PromptRow], step: int) -> TokenBatch:
    """The batch of one SFT step: (prompt, target + EOS) pairs; in a multi-turn env, demonstration episodes stepped on
    the env workers (1 on the model's tokens, 0 on the env's observations); and transcript rows (data.transcripts)
    as the episodes they record, tokenized as the rollout builds them."""
    env = ctx.cfg.env
    multi_turn = env.multi_turn and not env.agent_program  # an agent program learns from the rows' pairs
    tok, fmt = ctx.tokenizer, turn_format(ctx)
    transcripts = {
        i: transcript_trajectory(row, fmt, tok)
        for i, row in enumerate(rows)
        if row.messages and is_transcript(row.messages, multi_turn)
    }
    if not multi_turn and not transcripts:
        pairs = [sft_pair(ctx, row) for row in rows]
        return collate([p for p, _ in pairs], [t for _, t in pairs], tok.pad_token_id)
    others = [row for i, row in enumerate(rows) if i not in transcripts]
    if multi_turn:
        _same_first_observations(
            ctx, fmt, [rows[i] for i in transcripts], [transcripts[i] for i in transcripts]
        )
        rng = random.Random(f"demonstrations-{ctx.cfg.seed}-{step}")  # a resumed run draws the same
        actions = [demonstration_actions(ctx, row, rng) for row in others]
        made = demonstrations(WorkerEnvs(ctx.scorer), others, actions, fmt, tok) if others else []
    else:
        made = [_pair_trajectory(row, *sft_pair(ctx, row)) for row in others]
    made.reverse()
    trajs = [transcripts[i] if i in transcripts else made.pop() for i in range(len(rows))]
    return to_batch(trajs, tok.pad_token_id)[0]


def _pair_trajectory(row: PromptRow, prompt: list[int], target: list[int]) -> Trajectory:
    """A (prompt, target) pair as a one-turn episode, to share a batch with transcripts."""
    traj = Trajectory(row, prompt)
    traj.add_model_turn(target, [0.0] * len(target))
    return traj


def _same_first_observations(
    ctx: RunContext, fmt: TurnFormat, rows: list[PromptRow], trajs: list[Trajectory]
) -> None:
    """Refuse a transcript whose prompt is not the env's: trained on, it would teach the model an episode's start
    that the env never shows (a rollout's prompt is the env's first observation)."""
    if not rows:
        return
    for row, traj, shown in zip(rows, trajs, WorkerEnvs(ctx.scorer).reset(rows), strict=True):
        if traj.prompt_ids != fmt.prompt_ids(shown):
            first = transcript_turns(row.messages).first
            raise UserError(
                f"SFT row {row.index} (0-based, data.train_path): the transcript's first observation (its system "
                f"and user messages, joined) is {_clip(first)}, but env '{ctx.cfg.env.name}' starts that row's "
                f"episode with {_clip(shown)}: a transcript must start as the env's episode does"
            )


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def train_sft(ctx: RunContext, state: RunState, resume: CheckpointParts | None = None) -> RunState:
    """Run SFT from `state` to cfg.sft.steps; returns the final state (phase 'sft'). resume: the parts of the
    checkpoint `state` was read from."""
    cfg = ctx.cfg.sft
    sampler = Sampler(len(ctx.train_rows), seed=ctx.cfg.seed)
    if state.sampler:
        sampler.load_state_dict(state.sampler)
    ctx.actor.start_phase(cfg.optim, cfg.steps, resume)
    bar = tqdm(total=cfg.steps, initial=state.step, desc="sft", disable=not ctx.cfg.progress, leave=False)
    while state.step < cfg.steps and not state.done:
        t0 = time.perf_counter()
        refs = sampler.next_batch(cfg.batch_size)
        rows = [ctx.train_rows[ref.index] for ref in refs]
        batch = sft_batch(ctx, rows, state.step + 1)
        with ctx.watchdog.stage("train"):
            # past half the target, smaller steps: the rise to it is steep, and a step too far overshoots
            lr_scale = cfg.near_target_lr if cfg.fine_check(state.val_accuracy) else 1.0
            stats = ctx.actor.sft_step(batch, cfg.micro_batch_size, lr_scale)
        state.step += 1
        ctx.ledger.record("sft", state.step, [(ref.epoch, ref.index, 0) for ref in refs])
        state.sampler = sampler.state_dict()
        elapsed = time.perf_counter() - t0
        row = {
            "phase": "sft",
            "step": state.step,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            **stats.extra,  # an MoE policy's router metrics
        }
        row["tokens_per_s"] = float(batch.attention_mask.sum()) / elapsed
        row["time_train"] = elapsed
        if ctx.val_rows and cfg.check_due(state.step, state.val_accuracy):
            fine = cfg.fine_check(state.val_accuracy) or cfg.coarse_val >= len(ctx.val_rows)
            with ctx.watchdog.stage("eval"):
                sync_engine(ctx, version=0)
                rows = ctx.val_rows if fine else ctx.val_rows[: cfg.coarse_val]
                state.val_accuracy = row["val_accuracy"] = evaluate(ctx, rows)["eval_accuracy"]
            # a fixed skill level, whatever step float noise puts it at, read on the whole split
            state.done = fine and state.val_accuracy >= cfg.stop_at_accuracy
        last = state.step == cfg.steps or state.done
        if last or (cfg.eval_every and state.step % cfg.eval_every == 0):
            with ctx.watchdog.stage("eval"):
                sync_engine(ctx, version=0)
                row.update(evaluate(ctx))
        ctx.logger.log(row)
        # test hook: a kill between a step's row and its checkpoint
        FAULTS.pause_point(f"step:sft:{state.step}")
        stop = ctx.stop.requested  # SIGINT/SIGTERM came: checkpoint this step, then leave (loops.stop)
        if last or stop or (ctx.cfg.checkpoint_every and state.step % ctx.cfg.checkpoint_every == 0):
            with ctx.watchdog.stage("checkpoint"):
                ctx.checkpoints.save(state)
        bar.update(1)
        bar.set_postfix(loss=f"{stats.loss:.3f}", acc=row.get("eval_accuracy", "-"))
        if stop:
            bar.close()
            ctx.stop.check(state)
    bar.close()
    return state
