"""`loopline bench pack`: the trainer's GRPO step over packed sequences (model.packing) and with each group's
prompt forwarded once (model.share_prompts) against the plain padded one (every row its own forward).

A GRPO-shaped batch (64 prompts x 8 samples by default, prompts from the built-in task) with responses of random
tokens whose lengths have a long tail (geometric with mean --mean-length, cut at --max-new: most short, a few
long, as an RL rollout's are), and the same batch at the default job's shape (1 to 8 response tokens). Each
case runs PolicyTrainer.policy_step (forward, GRPO loss, backward, optimizer step, micro-batches of
--micro-batch rows) padded, shared and packed, alternating, --repeats times on copies of one model; tokens/s
counts the batch's response tokens. Before timing, the shared and packed log-probs are checked against the
padded ones. Ends with the headline ratio, packed over padded on the long tail.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from loopline.bench.args import require_positive
from loopline.config import GRPOConfig, OptimConfig, TaskConfig, TinyModelConfig
from loopline.data.batches import RolloutBatch, collate
from loopline.data.tasks import arithmetic_splits
from loopline.models.load import build_byte_tokenizer, build_tiny_model
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs


def _batch(tokenizer, prompts: int, samples: int, lengths: list[int], seed: int) -> RolloutBatch:
    """prompts x samples rows: the task's prompts, each followed by random tokens of the given lengths."""
    rows, _ = arithmetic_splits(TaskConfig(num_train=max(prompts, 2), num_eval=2, num_val=2), seed=seed)
    texts = [tokenizer(r.prompt)["input_ids"] for r in rows[:prompts]]
    rng = random.Random(seed)
    vocab = range(3, len(tokenizer))
    responses = [[rng.choice(vocab) for _ in range(n)] for n in lengths]
    tokens = collate([p for p in texts for _ in range(samples)], responses, tokenizer.pad_token_id)
    advantages = torch.randn(len(tokens), generator=torch.Generator().manual_seed(seed))
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=None, ref_logprobs=None, advantages=advantages, rewards=torch.zeros(len(tokens)),
    )  # fmt: skip


LABELS = ("padded", "shared", "packed")  # every row its own forward; a group's prompt forwarded once; packed


def _case(name: str, model, batch: RolloutBatch, micro: int, repeats: int) -> float:
    """Time policy steps padded, shared and packed on `batch`; print the figures; return packed / padded
    tokens/s."""
    with torch.no_grad():
        padded, _ = response_logprobs(model, batch, share_prompts=False)
        shared, _ = response_logprobs(model, batch)
        packed, _ = response_logprobs(model, batch, packed=True)
    mask = batch.response_mask.bool()
    cfg = GRPOConfig(micro_batch_size=micro)
    optim = OptimConfig(lr=1e-5, warmup_steps=0)
    trainers = {
        label: PolicyTrainer(
            copy.deepcopy(model),
            optim,
            repeats + 1,
            loss=grpo_loss(cfg),
            micro_batch_size=micro,
            packed=label == "packed",
            share_prompts=label == "shared",
        )  # fmt: skip
        for label in LABELS
    }
    for trainer in trainers.values():  # warm-up: the first step allocates the optimizer state
        trainer.policy_step(batch, 0.0)
    seconds: dict[str, list[float]] = {label: [] for label in trainers}
    for _ in range(repeats):
        for label, trainer in trainers.items():
            start = time.perf_counter()
            trainer.policy_step(batch, 0.0)
            seconds[label].append(time.perf_counter() - start)
    tokens = int(batch.response_mask.sum())
    rate = {label: tokens / statistics.median(s) for label, s in seconds.items()}
    shape = tuple(batch.input_ids.shape)
    print(f"{name}_rows: {shape[0]}")
    print(f"{name}_padded_tokens: {shape[0] * shape[1]}")
    print(f"{name}_real_tokens: {int(batch.attention_mask.sum())}")
    print(f"{name}_response_tokens: {tokens}")
    print(f"{name}_logprob_max_abs_diff: {float((packed - padded)[mask].abs().max()):.2e}")
    print(f"{name}_shared_logprob_max_abs_diff: {float((shared - padded)[mask].abs().max()):.2e}")
    for label in trainers:
        print(f"{name}_{label}_step_ms: {1000 * statistics.median(seconds[label]):.1f}")
        print(f"{name}_{label}_tokens_per_s: {rate[label]:.0f}")
    print(f"{name}_shared_over_padded_tokens_per_s: {rate['shared'] / rate['padded']:.2f}")
    ratio = rate["packed"] / rate["padded"]
    print(f"{name}_packed_over_padded_tokens_per_s: {ratio:.2f}")
    return ratio


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench pack", description=__doc__)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--mean-length", type=int, default=24, help="mean response length of the long tail")
    parser.add_argument("--max-new", type=int, default=192, help="longest response")
    parser.add_argument("--micro-batch", type=int, default=64, help="rows per forward/backward")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_positive(
        parser, args, "prompts", "samples", "mean_length", "max_new", "micro_batch", "repeats", "threads"
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer, seed=args.seed)
    rows = args.prompts * args.samples
    rng = random.Random(args.seed)
    long_tail = [min(args.max_new, 1 + int(rng.expovariate(1 / args.mean_length))) for _ in range(rows)]
    default_job = [rng.randint(1, 8) for _ in range(rows)]
    print(f"batch: {args.prompts} prompts x {args.samples} samples, micro-batches of {args.micro_batch}")
    _case("default_shape", model, _batch(tokenizer, args.prompts, args.samples, default_job, args.seed),
          args.micro_batch, args.repeats)  # fmt: skip
    headline = _case(
        "long_tail",
        model,
        _batch(tokenizer, args.prompts, args.samples, long_tail, args.seed),
        args.micro_batch,
        args.repeats,
    )
    print(f"packed_over_padded_tokens_per_s: {headline:.2f}")
    return 0
