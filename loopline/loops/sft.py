"""Supervised warm start: prompt-masked next-token loss on (prompt, completion) pairs."""

from __future__ import annotations

import time

from tqdm import tqdm

from loopline.checkpoint.faults import pause_point
from loopline.checkpoint.state import CheckpointParts, RunState
from loopline.data.batches import collate
from loopline.data.datasets import PromptRow
from loopline.data.sampler import Sampler
from loopline.loops.context import RunContext, encode_prompt, evaluate, sync_engine


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
        pairs = [sft_pair(ctx, row) for row in rows]
        batch = collate([p for p, _ in pairs], [t for _, t in pairs], ctx.tokenizer.pad_token_id)
        with ctx.watchdog.stage("train"):
            stats = ctx.actor.sft_step(batch, cfg.micro_batch_size)
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
        }
        row["tokens_per_s"] = float(batch.attention_mask.sum()) / elapsed
        row["time_train"] = elapsed
        if ctx.val_rows and cfg.check_due(state.step, state.val_accuracy):
            with ctx.watchdog.stage("eval"):
                sync_engine(ctx, version=0)
                state.val_accuracy = row["val_accuracy"] = evaluate(ctx, ctx.val_rows)["eval_accuracy"]
            # a fixed skill level, whatever step float noise puts it at
            state.done = state.val_accuracy >= cfg.stop_at_accuracy
        last = state.step == cfg.steps or state.done
        if last or (cfg.eval_every and state.step % cfg.eval_every == 0):
            with ctx.watchdog.stage("eval"):
                sync_engine(ctx, version=0)
                row.update(evaluate(ctx))
        ctx.logger.log(row)
        pause_point(f"step:sft:{state.step}")  # test hook: a kill between a step's row and its checkpoint
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
