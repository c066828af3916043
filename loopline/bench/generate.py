"""`loopline bench generate`: the built-in engine against Hugging Face `generate` on the same model and batch.

A GRPO-shaped batch (64 prompts x 8 samples by default, prompts from the built-in task) sampled at temperature
1 two ways: with a long tail of lengths (the digits end a sample: with the untrained model's near-uniform
next-token distribution about 1 token in 25 is a digit, so lengths are geometric, most short, a few reaching
--max-new) and at equal length (no stop: every sample runs to --max-new; EOS is masked in the model's head
for both). The long tail again with at most --max-rows sequences at once (a memory bound): the built-in engine
batching continuously (a prompt's samples enter as finished ones free their rows) against static batches of
--max-rows / --samples prompts one after another, its own and HF's. Each engine runs the same batch
--repeats times, alternating; tokens/s counts the tokens each returns, and microseconds per decode step
divide the time by the forward passes the longest sample needs (the tiny model is bound by per-step
overhead, not by memory bandwidth). Where vLLM is installed (rollout.engine=vllm), its engine runs the
equal-length and long-tail batches too, on the same weights without the EOS bias, sampling with ignore_eos
(the same distribution). Time to first token: each engine's generate of one new token for the whole batch
(prefill and one sample). --preset or --model-dir run a real shape with random weights (model.init=random) and
its tokenizer, at --dtype. Ends with the headline ratio on the long tail.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from loopline.bench.args import require_positive
from loopline.config import TaskConfig
from loopline.data.tasks import arithmetic_splits
from loopline.models.config import ModelConfig
from loopline.models.load import load_policy
from loopline.rollout.engine import SamplingParams, TorchEngine

STOP_DIGITS = tuple("0123456789")


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    rows, _ = arithmetic_splits(TaskConfig(num_train=max(count, 2), num_eval=2, num_val=2), seed=seed)
    return [tokenizer(r.prompt)["input_ids"] for r in rows[:count]]


def _without_eos(model, tokenizer):
    """The same model with a -1e4 bias on EOS in its head, so that no sample ends by chance: the lengths are
    the benchmark's (--max-new, or the stop digits), the same for both engines, which share the model."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    head.weight = old.weight  # the tied embedding, unchanged
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = -1e4
    model.lm_head = head
    return model


def _hf_generate(model, tokenizer, prompts: list[list[int]], n: int, max_new: int, stop_ids: list[int]):
    """HF generate on the left-padded batch, n samples per prompt; the tokens each sample returns."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=max_new, num_return_sequences=n, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop_ids,
    )  # fmt: skip
    lengths = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
        lengths.append(cut)
    return lengths


def _timed(fn: Callable[[], list[int]]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    lengths = fn()
    return time.perf_counter() - t0, lengths


def _compare(name: str, runs: dict[str, Callable[[], list[int]]], repeats: int) -> float:
    """Alternate the engines ("builtin" and "hf", and any others), print each one's tokens/s and us per decode
    step; the ratio of medians builtin / hf (and builtin / each other one)."""
    results: dict[str, list[tuple[float, list[int]]]] = {who: [] for who in runs}
    for _ in range(repeats):
        for who, fn in runs.items():
            results[who].append(_timed(fn))
    rates = {}
    for who, timed in results.items():
        rate = statistics.median(sum(lengths) / t for t, lengths in timed)
        step_us = statistics.median(t / max(lengths) * 1e6 for t, lengths in timed)
        mean_len = statistics.mean(statistics.mean(lengths) for _, lengths in timed)
        max_len = max(max(lengths) for _, lengths in timed)
        print(f"{name}_{who}_tokens_per_s: {rate:.1f}")
        print(f"{name}_{who}_us_per_decode_step: {step_us:.0f}")
        print(f"{name}_{who}_mean_length: {mean_len:.1f}")
        print(f"{name}_{who}_max_length: {max_len}")
        rates[who] = rate
    for other in (who for who in runs if who not in ("builtin", "hf")):
        print(f"{name}_builtin_over_{other}_tokens_per_s: {rates['builtin'] / rates[other]:.2f}")
    ratio = rates["builtin"] / rates["hf"]
    print(f"{name}_builtin_over_hf_tokens_per_s: {ratio:.2f}")
    return ratio


def _model_config(args: argparse.Namespace) -> ModelConfig:
    """The built-in tiny model, or a real shape with random weights (--preset, --model-dir), at --dtype."""
    if args.preset:
        return ModelConfig(init="random", preset=args.preset, dtype=args.dtype)
    if args.model_dir:
        return ModelConfig(init="random", path=args.model_dir, dtype=args.dtype)
    return ModelConfig(dtype=args.dtype)


def _first_token(runs: dict[str, Callable[[], list[int]]], repeats: int) -> None:
    """Time to first token: the median seconds of each engine's one-token generate of the whole batch."""
    for who, fn in runs.items():
        seconds = statistics.median(_timed(fn)[0] for _ in range(repeats))
        print(f"first_token_{who}_ms: {seconds * 1e3:.0f}")


def _vllm_runs(
    model_cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, Callable[[], list[int]]]:
    """The vLLM engine's timed calls on the same weights (equal length, long tail), warmed up; {} without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return {}
    from loopline.rollout.vllm_engine import VllmEngine

    plain = load_policy(model_cfg, seed=args.seed)[0].eval()  # the same weights
    theirs_vllm = VllmEngine(plain, tokenizer, seed=args.seed)
    torch.set_num_threads(args.threads)

    def vllm_run(stop: tuple[str, ...]) -> Callable[[], list[int]]:
        params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, stop=stop, ignore_eos=True)
        return lambda: [len(c.token_ids) for c in theirs_vllm.generate(prompts, params, n=args.samples)]

    vllm_run(STOP_DIGITS)()  # warm-up
    return {"equal_length": vllm_run(()), "long_tail": vllm_run(STOP_DIGITS)}


def _args(argv: list[str]) -> argparse.Namespace:
    """The bench's options, checked."""
    parser = argparse.ArgumentParser(prog="loopline bench generate", description=__doc__)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--max-new", type=int, default=128, help="most new tokens per sample")
    parser.add_argument(
        "--max-rows",
        type=int,
        default=128,
        help="rows computed at once in the capped case (continuous batching)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="", help="a real shape with random weights (model.preset)")
    parser.add_argument(
        "--model-dir", default="", help="a directory with config.json (and tokenizer), random weights"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype"
    )
    args = parser.parse_args(argv)
    require_positive(parser, args, "prompts", "samples", "max_new", "max_rows", "repeats", "threads")
    if args.max_rows < args.samples:
        parser.error("--max-rows must hold at least one prompt's --samples")
    return args


def main(argv: list[str]) -> int:
    args = _args(argv)
    torch.set_num_threads(args.threads)

    model_cfg = _model_config(args)
    plain, tokenizer = load_policy(model_cfg, seed=args.seed)
    model = _without_eos(plain.eval(), tokenizer)
    prompts = _prompts(tokenizer, args.prompts, args.seed)
    stop_ids = [tokenizer.convert_tokens_to_ids(d) for d in STOP_DIGITS]
    eos = [tokenizer.eos_token_id]  # never sampled (_without_eos); both engines stop on it
    engine = TorchEngine(model, tokenizer, seed=args.seed)
    torch.manual_seed(args.seed)  # HF generate samples from the global generator
    print(f"model: {args.preset or args.model_dir or 'built-in'}, {args.dtype}")
    print(f"model_parameters: {sum(p.numel() for p in model.parameters())}")
    print(f"batch: {args.prompts} prompts x {args.samples} samples, max_new_tokens {args.max_new}")

    def ours(stop: tuple[str, ...]) -> Callable[[], list[int]]:
        params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, stop=stop)
        return lambda: [len(c.token_ids) for c in engine.generate(prompts, params, n=args.samples)]

    def theirs(ids: list[int]) -> Callable[[], list[int]]:
        return lambda: _hf_generate(model, tokenizer, prompts, args.samples, args.max_new, ids)

    # the capped case: at most --max-rows sequences at once (a memory bound). The built-in engine batches
    # continuously; a static batcher runs groups of prompts one after another, each as long as its longest
    capped = TorchEngine(model, tokenizer, seed=args.seed, max_rows=args.max_rows)
    per_chunk = args.max_rows // args.samples

    def continuous() -> list[int]:
        params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, stop=STOP_DIGITS)
        return [len(c.token_ids) for c in capped.generate(prompts, params, n=args.samples)]

    def chunked(generate_chunk: Callable[[list[list[int]]], list[int]]) -> Callable[[], list[int]]:
        return lambda: [
            n for i in range(0, len(prompts), per_chunk) for n in generate_chunk(prompts[i : i + per_chunk])
        ]

    def ours_chunk(chunk: list[list[int]]) -> list[int]:
        params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, stop=STOP_DIGITS)
        return [len(c.token_ids) for c in engine.generate(chunk, params, n=args.samples)]

    def theirs_chunk(chunk: list[list[int]]) -> list[int]:
        return _hf_generate(model, tokenizer, chunk, args.samples, args.max_new, stop_ids + eos)

    vllm = _vllm_runs(model_cfg, tokenizer, prompts, args)
    print(f"vllm: {'in-process, enforce_eager' if vllm else 'not installed'}")

    ours(STOP_DIGITS)()  # warm-up of both paths (first calls allocate)
    theirs(stop_ids + eos)()
    one = SamplingParams(max_new_tokens=1, temperature=1.0, stop=())
    _first_token(
        {
            "builtin": lambda: [len(c.token_ids) for c in engine.generate(prompts, one, n=args.samples)],
            "hf": lambda: _hf_generate(model, tokenizer, prompts, args.samples, 1, eos),
        },
        args.repeats,
    )
    equal = {"builtin": ours(()), "hf": theirs(eos)}
    _compare("equal_length", equal | ({"vllm": vllm["equal_length"]} if vllm else {}), args.repeats)
    print(f"capped: at most {args.max_rows} rows at once ({per_chunk} prompts per static batch)")
    _compare(
        "long_tail_capped",
        {"builtin": continuous, "builtin_static": chunked(ours_chunk), "hf": chunked(theirs_chunk)},
        args.repeats,
    )
    tail = {"builtin": ours(STOP_DIGITS), "hf": theirs(stop_ids + eos)}
    headline = _compare("long_tail", tail | ({"vllm": vllm["long_tail"]} if vllm else {}), args.repeats)
    print(f"builtin_over_hf_tokens_per_s: {headline:.2f}")
    return 0
