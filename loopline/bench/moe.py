"""`loopline bench moe`: a mixture of experts in training. Three parts, each against its baseline in the same run:

- step: GRPO steps (PolicyTrainer.policy_step) of an MoE preset on 2 gloo ranks with its experts split over them
  (expert parallelism, runtime.trainer_ep=2) against FSDP2 gathering every expert on every rank (trainer_ep=1),
  alternating, on the same batch: step time, peak resident memory per rank, and the all_to_all's share of the
  expert-parallel step (the time inside torch.distributed.all_to_all_single, forward and backward);
- routes: an engine samples with its routes recorded, the trainer takes a step, and the engine samples again from
  its now stale weights: the share of (token, layer) routes the trainer's router chooses differently
  (route_mismatch) with the weights equal and one version apart, and the share that differs from the engine's in
  the forward the trainer actually runs with routing replay on (0 when replay works);
- sync: the planned weight sync from the 2 FSDP2 ranks to one engine, of the MoE model and of a dense model with
  its active parameters (the same layers with one MLP as wide as the experts a token goes through), checked bitwise.

Prints `name: value` lines, ending with ep_step_speedup (FSDP2 step time over the expert-parallel one).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loopline.bench._procstat import reset_peak, status_bytes
from loopline.bench.args import require_positive
from loopline.bench.sync import run_world

PRESETS = ("qwen3-moe-tiny", "mixtral-tiny")


def _model(preset: str, seed: int, dense: bool = False) -> Any:
    """The preset's architecture with seeded random weights (token ids below 259 used); dense: a Qwen3 model of
    the same layers whose one MLP is as wide as the experts a token goes through (its active parameters)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from loopline.models.config import ModelConfig
    from loopline.models.load import shape_config

    config = shape_config(ModelConfig(init="random", preset=preset))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2  # the byte tokenizer's
    if dense:
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        config = Qwen3Config(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=width * config.num_experts_per_tok, num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None), tie_word_embeddings=config.tie_word_embeddings,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    torch.random.set_rng_state(state)
    return model


def _batch(rows: int, group: int, prompt: int, response: int, seed: int) -> Any:
    """rows sequences in groups of `group` sharing a prompt, random tokens, random advantages."""
    from loopline.data.batches import RolloutBatch, collate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (prompt,), generator=g).tolist() for _ in range(rows // group)]
    lengths = torch.randint(1, response + 1, (rows,), generator=g).tolist()
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]
    tokens = collate([p for p in prompts for _ in range(group)], responses, pad_id=0)
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask, old_logprobs=None, ref_logprobs=None,
        advantages=torch.randn(rows, generator=g), rewards=torch.zeros(rows),
    )  # fmt: skip


class _AllToAllTimer:
    """Time spent inside torch.distributed.all_to_all_single in this process while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._call = dist.all_to_all_single

    def __enter__(self) -> _AllToAllTimer:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return self._call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        dist.all_to_all_single = timed  # type: ignore[assignment]  # this benchmark process only
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._call  # type: ignore[assignment]


def _step_rank(rank: int, world: int, conf: dict[str, Any], out: str) -> None:
    """Ranks 0-1: GRPO steps with trainer_ep=1 and 2, alternating; then the weight syncs (rank 2: the engine)."""
    from loopline.config import GRPOConfig, OptimConfig
    from loopline.training.expert_parallel import apply_ep
    from loopline.training.parallel import shard_model, trainer_mesh
    from loopline.training.policy import PolicyTrainer, grpo_loss

    mesh = trainer_mesh(2)
    result: dict[str, Any] = {}
    if rank < 2:
        batch = _batch(conf["rows"], conf["group"], conf["prompt"], conf["response"], conf["seed"])
        mine = batch.select(slice(rank * len(batch) // 2, (rank + 1) * len(batch) // 2))
        trainers = {}
        for mode in ("fsdp", "ep"):
            model = _model(conf["preset"], conf["seed"])
            shard_model(model, mesh, ignored=apply_ep(model, mesh) if mode == "ep" else None)
            cfg = GRPOConfig(micro_batch_size=conf["micro"])
            trainers[mode] = PolicyTrainer(
                model, OptimConfig(lr=1e-5, warmup_steps=0), conf["repeats"] + 1, mesh.get_group(),
                grpo_loss(cfg), conf["micro"],
            )  # fmt: skip
        for mode, trainer in trainers.items():  # warm-up: the first step allocates the optimizer state
            result[f"{mode}_first_loss"] = trainer.policy_step(mine, 0.0).loss
        times: dict[str, list[float]] = {mode: [] for mode in trainers}
        peaks: dict[str, int] = dict.fromkeys(trainers, 0)
        exchange = 0.0
        for _ in range(conf["repeats"]):
            for mode, trainer in trainers.items():
                dist.barrier(mesh.get_group())
                base = reset_peak()
                with _AllToAllTimer() as timer:
                    start = time.perf_counter()
                    trainer.policy_step(mine, 0.0)
                    times[mode].append(time.perf_counter() - start)
                peaks[mode] = max(peaks[mode], status_bytes("VmHWM") - base)
                exchange += timer.seconds if mode == "ep" else 0.0
        result.update(times=times, peak_delta=peaks, exchange=exchange)
        del trainers
    result["sync"] = {kind: _sync(rank, mesh, conf, kind == "dense") for kind in ("moe", "dense")}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _sync(rank: int, mesh: Any, conf: dict[str, Any], dense: bool) -> dict[str, Any]:
    """The planned sync of the (MoE or dense) model from FSDP2 ranks 0-1 to the whole engine on rank 2: median
    seconds over conf["repeats"], the parameter count, and whether the engine then holds the trainer's weights."""
    from loopline.distributed.resharding import EngineLayout, TrainerLayout, plan_transfers
    from loopline.distributed.weight_sync import engine_tensors, local_shards, param_specs, sync_weights
    from loopline.training.parallel import shard_model

    model = _model(conf["preset"], conf["seed"] if rank < 2 else conf["seed"] + 1, dense=dense)
    specs = param_specs(model)
    plan = plan_transfers(specs, TrainerLayout(2), EngineLayout(1, 1))
    expected = {
        n: p.detach().clone() for n, p in _model(conf["preset"], conf["seed"], dense=dense).named_parameters()
    }
    src = local_shards(shard_model(model, mesh)) if rank < 2 else None
    dst = engine_tensors(model) if rank == 2 else None
    seconds = []
    for _ in range(conf["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        sync_weights(plan, src, dst, bucket_bytes=16 * 2**20)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    equal = dst is None or all(torch.equal(dst[n], expected[n]) for n in dst)
    params = sum(s.nbytes // s.dtype.itemsize for s in specs)
    return {"seconds": statistics.median(seconds), "equal": equal, "params": params}


def _routes(conf: dict[str, Any]) -> dict[str, float]:
    """route_mismatch of the trainer against its engine: weights equal, then one version apart with replay off,
    and the engine's routes against the ones the replayed forward used (0 when replay works)."""
    from loopline.config import GRPOConfig, OptimConfig
    from loopline.data.batches import RolloutBatch, collate
    from loopline.models.moe import router_hooks
    from loopline.models.tokenizer import build_byte_tokenizer
    from loopline.rollout.engine import SamplingParams, TorchEngine
    from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs
    from loopline.training.replay import RouteReplay, sample_routes

    model = _model(conf["preset"], conf["seed"])
    engine = TorchEngine(copy.deepcopy(model), build_byte_tokenizer(), seed=conf["seed"], record_routes=True)
    g = torch.Generator().manual_seed(conf["seed"])
    prompts = [
        torch.randint(3, 259, (conf["prompt"],), generator=g).tolist()
        for _ in range(conf["rows"] // conf["group"])
    ]
    params = SamplingParams(max_new_tokens=conf["response"], temperature=1.0, ignore_eos=True)

    def sampled() -> RolloutBatch:
        completions = engine.generate(prompts, params, n=conf["group"])
        rows = [prompts[c.prompt_index] for c in completions]
        tokens = collate(rows, [c.token_ids for c in completions], pad_id=0)
        routes = sample_routes([c.routes for c in completions], [len(p) for p in rows], tokens.prompt_len,
                               tokens.input_ids.shape[1])  # fmt: skip
        advantages = torch.randn(len(rows), generator=g)
        return RolloutBatch(tokens.input_ids, tokens.attention_mask, tokens.response_mask, old_logprobs=None,
                            ref_logprobs=None, advantages=advantages, rewards=torch.zeros(len(rows)),
                            routes=routes)  # fmt: skip

    def mismatch(batch: RolloutBatch, replay: bool) -> tuple[float, float]:
        """(route_mismatch of the trainer's own router, share of the routes used that are not the engine's)."""
        counter = RouteReplay(model, replay)
        used: list[torch.Tensor] = []
        with router_hooks(model, lambda position, logits, experts: used.append(experts)):
            response_logprobs(model, batch, share_prompts=False)
        own = counter.metrics()["route_mismatch"]
        layers = len(used)
        routes = batch.routes.flatten(0, 1).long()  # type: ignore[union-attr]  # the engine recorded them
        known = routes[:, 0, 0] >= 0
        differ = sum(
            int(((routes[:, i].sort(-1).values != used[i].sort(-1).values).any(-1) & known).sum())
            for i in range(layers)
        )
        return own, differ / (int(known.sum()) * layers)

    model.train()
    first = sampled()
    same, _ = mismatch(first, replay=False)
    trainer = PolicyTrainer(model, OptimConfig(lr=conf["lr"], warmup_steps=0), 4, loss=grpo_loss(GRPOConfig()),
                            micro_batch_size=conf["rows"])  # fmt: skip
    trainer.policy_step(first, 0.0)
    stale = sampled()  # the engine still holds the weights before that step
    off, off_used = mismatch(stale, replay=False)
    _, on_used = mismatch(stale, replay=True)
    return {"same_weights": same, "stale_off": off, "stale_off_used": off_used, "stale_on_used": on_used}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench moe", description=__doc__)
    parser.add_argument("--preset", default="qwen3-moe-tiny", choices=PRESETS, help="the MoE model")
    parser.add_argument("--rows", type=int, default=64, help="sequences per step (both ranks)")
    parser.add_argument("--group", type=int, default=8, help="sequences per prompt")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--response", type=int, default=32, help="most response tokens")
    parser.add_argument("--micro", type=int, default=16, help="rows per forward/backward on a rank")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (and syncs) of each, alternating")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate of the routes part's one step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before the gloo world is killed"
    )
    args = parser.parse_args(argv)
    require_positive(parser, args, "rows", "group", "prompt", "response", "micro", "repeats", "timeout")
    if args.rows % (2 * args.group) or (args.rows // 2) % args.micro:
        parser.error(f"--rows {args.rows} must split into 2 ranks of whole groups (--group {args.group}) and "
                     f"micro-batches (--micro {args.micro})")  # fmt: skip
    conf = vars(args)
    print(f"model: {args.preset}, {args.rows} rows ({args.group} per prompt), prompt {args.prompt} + up to "
          f"{args.response} tokens, micro-batches of {args.micro} per rank, 2 trainer ranks")  # fmt: skip
    routes = _routes(conf)
    for key, value in routes.items():
        print(f"route_mismatch_{key}: {value:.4f}")
    with tempfile.TemporaryDirectory(prefix="loopline-bench-moe-") as out:
        run_world(_step_rank, 3, args=(conf, out), timeout_s=args.timeout)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(3)]
    step = {m: max(statistics.median(r["times"][m]) for r in ranks[:2]) for m in ("fsdp", "ep")}
    for mode in ("fsdp", "ep"):
        print(f"{mode}_step_s: {step[mode]:.3f}")
        print(f"{mode}_first_loss: {ranks[0][f'{mode}_first_loss']:.6f}")
        peak = max(r["peak_delta"][mode] for r in ranks[:2]) / 2**20
        print(f"{mode}_step_peak_rss_rise_mib_max_rank: {peak:.1f}")
    exchange = max(r["exchange"] for r in ranks[:2]) / (args.repeats * step["ep"])
    print(f"ep_all_to_all_share: {exchange:.3f}")
    for kind in ("moe", "dense"):
        sync = ranks[2]["sync"][kind]
        print(f"sync_{kind}_params: {sync['params']}")
        print(f"sync_{kind}_s: {max(r['sync'][kind]['seconds'] for r in ranks):.4f}")
        print(f"sync_{kind}_bitwise: {str(sync['equal']).lower()}")
    moe_s, dense_s = (max(r["sync"][k]["seconds"] for r in ranks) for k in ("moe", "dense"))
    print(f"sync_moe_over_dense_s: {moe_s / dense_s:.2f}")
    print(f"ep_step_speedup: {step['fsdp'] / step['ep']:.2f}")
    return 0
