"""`loopline bench pp`: the trainer's GRPO policy step split into pipeline stages (pp = the ranks) against FSDP2
alone on the same ranks: time per step, peak memory per rank, and the bubble fraction of the schedule.

Both runs are real gloo worlds of --ranks spawned processes (one after the other, so they do not share the
cores) that start from the same weights and take the same steps on the same GRPO-shaped batches (--prompts x
--samples rows, prompts of the built-in task's length, responses of random tokens and lengths). FSDP2 shards
every parameter over all ranks, each rank running its slice of the rows; the pipeline gives each rank whole
layers and every rank all the rows, --micro-batch rows per micro-batch (training.pipeline's PipelineTrainer).
Every batch is padded to one width (the pipeline's schedules fix their shapes) and both forward whole rows
(model.share_prompts off, as the pipeline's stages do), so both compute the same thing.
Peak memory is each rank's peak resident set growth from just before it builds its model to the end of its
steps (Linux's VmHWM, reset through /proc/self/clear_refs). The bubble fraction is the schedule's idle share,
(p - 1) / (v * m + p - 1) for p stages, m micro-batches and v stages per rank, not a measured one. The weights
after the steps are compared between the two runs. Ends with pp / FSDP2 step time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loopline.bench._procstat import reset_peak, status_bytes
from loopline.bench.args import require_positive
from loopline.bench.sync import run_world
from loopline.config import GRPOConfig, OptimConfig, SamplingConfig, TinyModelConfig
from loopline.data.batches import RolloutBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.pipeline import SCHEDULES, check_pp, pad_batch

MODES = ("fsdp", "pp")


def bubble_fraction(pp: int, micro_batches: int, virtual: int = 1) -> float:
    """The share of a GPipe / 1F1B (virtual = 1) or interleaved 1F1B step a stage spends idle."""
    return (pp - 1) / (virtual * micro_batches + pp - 1)


def _batches(args: argparse.Namespace, steps: int) -> list[RolloutBatch]:
    """`steps` GRPO-shaped batches, each padded to the widest possible (12 prompt + --max-new tokens)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(steps):
        prompts, responses = [], []
        for _ in range(args.prompts):
            prompt = [rng.randrange(3, 259) for _ in range(rng.randint(5, 12))]
            for _ in range(args.samples):
                prompts.append(prompt)
                responses.append([rng.randrange(3, 259) for _ in range(rng.randint(1, args.max_new))])
        tokens = collate(prompts, responses, pad_id=0)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        batch = RolloutBatch(
            tokens.input_ids, tokens.attention_mask, tokens.response_mask, old_logprobs=None,
            ref_logprobs=None, advantages=torch.randn(len(tokens), generator=g), rewards=torch.zeros(len(tokens)),
        )  # fmt: skip
        out.append(pad_batch(batch, len(batch), 12 + args.max_new))
    return out


def _model_cfg(args: argparse.Namespace) -> TinyModelConfig:
    return TinyModelConfig(
        hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads,
        intermediate_size=3 * args.hidden,
    )  # fmt: skip


def _rank_main(rank: int, world: int, mode: str, args: argparse.Namespace, out: str) -> None:
    from loopline.training.parallel import dp_tp_mesh, full_model_state, parallelize
    from loopline.training.pipeline import (
        PipelineTrainer,
        full_pipeline_state,
        parallelize_stages,
        pp_mesh,
        split_model,
    )
    from loopline.training.policy import PolicyTrainer, grpo_loss

    torch.manual_seed(args.seed)
    cfg = GRPOConfig(micro_batch_size=args.micro_batch, sampling=SamplingConfig(max_new_tokens=args.max_new))
    optim = OptimConfig(lr=1e-4, warmup_steps=0)
    batches = _batches(args, args.steps + 1)  # the first step is a warm-up (optimizer state, schedules)
    base = reset_peak()
    model = build_tiny_model(_model_cfg(args), build_byte_tokenizer(), seed=args.seed)
    if mode == "fsdp":
        mesh = dp_tp_mesh(world, 1)
        trainer = PolicyTrainer(
            parallelize(model, mesh), optim, len(batches), mesh["dp"].get_group(), grpo_loss(cfg),
            args.micro_batch, share_prompts=False,
        )  # fmt: skip
        batches = [split_rows(b, len(b) // world)[rank] for b in batches]
    else:
        mesh = pp_mesh(world, world)
        virtual = 2 if args.schedule == "interleaved" else 1
        stages = parallelize_stages(split_model(model, mesh.get_coordinate()[0], world, virtual), mesh)
        trainer = PipelineTrainer(
            stages, mesh, optim, len(batches), args.schedule, grpo_loss(cfg), args.micro_batch, width_bucket=1
        )
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        trainer.policy_step(batch, 0.0)
        seconds.append(time.perf_counter() - start)
    peak_mib = (status_bytes("VmHWM") - base) / 2**20
    state = full_model_state(trainer.model) if mode == "fsdp" else full_pipeline_state(stages, mesh)
    result = {
        "seconds": seconds[1:],
        "peak_mib": peak_mib,
        "state": state if rank == 0 else {},
    }  # rank 0's is read
    torch.save(result, Path(out) / f"{mode}{rank}.pt")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench pp", description=__doc__)
    parser.add_argument(
        "--ranks", type=int, default=2, help="ranks of each world (pp = ranks for the pipeline)"
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--max-new", type=int, default=32, help="longest response (lengths uniform from 1)")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_positive(
        parser,
        args,
        "ranks",
        "prompts",
        "samples",
        "max_new",
        "micro_batch",
        "hidden",
        "layers",
        "heads",
        "steps",
    )
    virtual = 2 if args.schedule == "interleaved" else 1
    rows = args.prompts * args.samples
    try:
        check_pp(args.layers, args.ranks, virtual)
        _model_cfg(args)
    except ValueError as e:
        parser.error(str(e))
    if rows % (args.ranks * args.micro_batch):
        parser.error(
            f"--prompts x --samples ({rows} rows) must split into --ranks ({args.ranks}) slices of whole "
            f"--micro-batch ({args.micro_batch}) micro-batches, so both runs take the same micro-batches"
        )

    results = {}
    with tempfile.TemporaryDirectory(prefix="loopline-bench-pp-") as tmp:
        for mode in MODES:
            run_world(_rank_main, args.ranks, args=(mode, args, tmp), timeout_s=600)
            results[mode] = [torch.load(Path(tmp) / f"{mode}{r}.pt") for r in range(args.ranks)]
    micro = rows // args.micro_batch
    params = sum(t.numel() for t in results["fsdp"][0]["state"].values())
    print(f"model: {params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}")
    print(f"batch: {args.prompts} prompts x {args.samples} samples, micro-batches of {args.micro_batch}")
    print(f"ranks: {args.ranks} (fsdp: dp={args.ranks}; pp: pp={args.ranks}, schedule {args.schedule})")
    step_ms = {}
    for mode in MODES:
        per_rank = [statistics.median(r["seconds"]) for r in results[mode]]
        step_ms[mode] = 1000 * max(per_rank)  # a step ends when its slowest rank does
        print(f"{mode}_step_ms: {step_ms[mode]:.1f}")
        peaks = " ".join(f"{r['peak_mib']:.0f}" for r in results[mode])
        print(f"{mode}_peak_mib_per_rank: {peaks}")
    print(f"pp_micro_batches: {micro}")
    print(f"pp_bubble_fraction: {bubble_fraction(args.ranks, micro, virtual):.3f}")
    fsdp, pp = results["fsdp"][0]["state"], results["pp"][0]["state"]
    diff = max(float((fsdp[n] - pp[n]).abs().max()) for n in fsdp)
    print(f"weights_max_abs_diff: {diff:.2e}")
    print(f"pp_over_fsdp_step_time: {step_ms['pp'] / step_ms['fsdp']:.2f}")
    return 0
