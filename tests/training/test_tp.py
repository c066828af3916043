"""Tensor parallelism (TP) x FSDP2 on a (dp, tp) mesh makes the same update as one rank on the same batch.

The global batch is the FSDP2 equivalence test's (uneven response lengths, one row empty); the TP ranks
of one dp rank get the same rows. Compared with one plain rank in this process: whole gradients, the
weights after two policy_step updates and after one sft_step (float32), and the reported statistics.
The same world checks that each rank's local shards are the regions the weight-sync planner assigns
to it (and a plan with the trainer's TP rule, run on those shards, fills engines at TP=1 and TP=2
bitwise), that whole weights load into the 2-D shards, and that a DCP checkpoint of the 2-D shards
loads back into them and into one plain process.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from loopline.bench.sync import run_world
from loopline.checkpoint.dcp import load_shards, shard_state
from loopline.config import GRPOConfig, OptimConfig, SamplingConfig, TinyModelConfig
from loopline.data.batches import RolloutBatch, collate
from loopline.distributed.resharding import (
    EngineLayout,
    TrainerLayout,
    plan_transfers,
    trainer_shard_box,
)
from loopline.distributed.weight_sync import copy_in_process, empty_engine_shards, local_shards, param_specs
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.parallel import check_tp, tp_param_dims, tp_plan
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs
from tests.numerics import assert_adam_updates_close

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)
CASES = ("token_mean", None)  # policy_step under token_mean (two steps); None = one sft_step
# the sharded ranks' SFT step runs on packed forwards (model.packing): the same update as one padded rank
PACKED_CASE = None


def _model() -> torch.nn.Module:
    return build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)


def _global_batch(grouped: bool) -> RolloutBatch:
    """8 rows: prompts of 2-6 tokens, responses of 0-7; behaviour and reference log-probs perturbed. grouped: rows
    in twos share a prompt (a GRPO group, forwarded once), as an RL batch's do; an SFT batch's prompts differ."""
    g = torch.Generator().manual_seed(3)
    p_lens, r_lens = [3, 6, 2, 4, 5, 2, 3, 6], [7, 6, 4, 7, 1, 0, 2, 5]
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    if grouped:
        prompts = [prompts[i - i % 2] for i in range(8)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    tokens = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        current, _ = response_logprobs(_model(), tokens)
    old = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5)  # some ratios clip
    ref = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5)
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=old, ref_logprobs=ref, advantages=torch.randn(8, generator=g), rewards=torch.zeros(8),
    )  # fmt: skip


def _batches() -> dict[str, RolloutBatch]:
    return {"rl": _global_batch(grouped=True), "sft": _global_batch(grouped=False)}


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole gradients by name (a collective on DTensor gradients: every rank calls it in the same order)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _run(trainer: PolicyTrainer, batches: dict[str, RolloutBatch], case: str | None, grads: list) -> dict:
    """Two policy_steps under loss_agg `case` (one sft_step if None), micro-batches of 3 rows; stats per step."""
    hook = trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(_full_grads(trainer.model)))
    if case is None:
        stats = [trainer.sft_step(batches["sft"], 3)]
    else:
        cfg = GRPOConfig(
            loss_agg=case, micro_batch_size=3, kl_coef=0.05, entropy_coef=0.01,
            sampling=SamplingConfig(max_new_tokens=7),
        )  # fmt: skip
        trainer.loss, trainer.micro_batch_size = grpo_loss(cfg), 3  # the RL phase's objective, set once
        stats = [trainer.policy_step(batches["rl"], cfg.kl_coef) for _ in range(2)]
    hook.remove()
    return {key: [getattr(s, key) for s in stats] for key in ("loss", "grad_norm", "extra")}


def _rank_main(rank: int, world: int, tp: int, batches: dict[str, RolloutBatch], out: str) -> None:
    """One rank of a (world // tp, tp) mesh: its dp rank's rows; rank 0 saves whole results."""
    from loopline.data.batches import split_rows
    from loopline.training.parallel import dp_tp_mesh, full_model_state, load_full_model_state, parallelize

    mesh = dp_tp_mesh(world, tp)
    dp_rank, dp = mesh.get_local_rank("dp"), mesh["dp"].size()
    mine = {kind: split_rows(b, len(b) // dp)[dp_rank] for kind, b in batches.items()}
    results: dict = {"seconds": {}}

    # each rank holds exactly the planner's box of every parameter (FSDP2 dim-0 chunks inside TP chunks)
    model, whole = parallelize(_model(), mesh), _model().state_dict()
    dims, layout = tp_param_dims(_model()), TrainerLayout(fsdp=dp, tp=tp)
    assert tp_param_dims(model) == dims  # the sharded model gives the planner the same rule
    for name, shard in local_shards(model).items():
        box = trainer_shard_box(tuple(whole[name].shape), dims[name], layout, rank)
        expected = whole[name][tuple(slice(lo, hi) for lo, hi in box)]
        assert torch.equal(shard, expected), f"rank {rank}: {name} is not its planned box {box}"

    # whole weights in, whole weights out
    shifted = {k: v + 0.5 for k, v in whole.items()}
    load_full_model_state(model, shifted)
    results["reloaded"] = full_model_state(model)

    for case in CASES:
        start = time.perf_counter()
        model = parallelize(_model(), mesh)
        group = mesh["dp"].get_group()
        trainer = PolicyTrainer(model, OPTIM, total_steps=10, group=group, packed=case == PACKED_CASE)
        grads: list = []
        stats = _run(trainer, mine, case, grads)
        results[str(case)] = {"stats": stats, "grads": grads, "weights": full_model_state(model)}
        results["seconds"][str(case)] = time.perf_counter() - start

    torch.save(local_shards(model), Path(out) / f"shards{rank}.pt")  # what this rank sends in a weight sync
    # DCP: the 2-D shards written by every rank, read back into fresh 2-D shards
    path = Path(out) / "dcp"
    dcp.save(shard_state(model, None), checkpoint_id=str(path))
    fresh = parallelize(_model(), mesh)
    load_shards(path, fresh, None, group=dist.group.WORLD)
    results["dcp_reloaded"] = full_model_state(fresh)
    if rank == 0:
        torch.save(results, Path(out) / "ranks.pt")


def _single(batches: dict[str, RolloutBatch]) -> dict:
    """The reference: one plain rank on the whole batch, per case."""
    single = {}
    for case in CASES:
        model = _model()
        grads: list = []
        trainer = PolicyTrainer(model, OPTIM, total_steps=10)
        stats = _run(trainer, copy.deepcopy(batches), case, grads)
        single[str(case)] = {"stats": stats, "grads": grads, "weights": model.state_dict()}
    return single


@pytest.fixture(scope="module")
def single() -> dict:
    return _single(_batches())


def _tp_world(tmp: Path, world: int, tp: int) -> dict:
    start = time.perf_counter()
    run_world(_rank_main, world, args=(tp, _batches(), str(tmp)), timeout_s=240)
    results = torch.load(tmp / "ranks.pt", weights_only=False)
    print(f"dp={world // tp} x tp={tp}: world {time.perf_counter() - start:.1f}s, steps {results['seconds']}")
    return results


def _assert_same_update(single: dict, sharded: dict, tmp: Path) -> None:
    for case in CASES:
        one, two = single[str(case)], sharded[str(case)]
        # gradients of every step, whole, then the weights by the rule for two reduction orders under AdamW
        w0 = _model().state_dict()
        counts = assert_adam_updates_close(
            w0, one["weights"], two["weights"], lrs=[OPTIM.lr] * len(one["grads"]), grads_a=one["grads"],
            grads_b=two["grads"], betas=OPTIM.betas, msg=str(case),
        )  # fmt: skip
        diff = max(float((two["weights"][n] - w).abs().max()) for n, w in one["weights"].items())
        print(f"{case}: max |w_tp - w_one| = {diff:.2e}, {counts}")
        assert max(float((w - w0[n]).abs().max()) for n, w in one["weights"].items()) > 1e-4  # it moved
        s1, s2 = one["stats"], two["stats"]
        assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-5, abs=1e-7)
        assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-5)
        for e1, e2 in zip(s1["extra"], s2["extra"]):
            assert e2 == pytest.approx(e1, rel=1e-5, abs=1e-7)
    # whole weights loaded into the 2-D shards come back whole
    for name, w in _model().state_dict().items():
        torch.testing.assert_close(sharded["reloaded"][name], w + 0.5, rtol=0, atol=0, msg=name)
    # DCP: back into 2-D shards, and into one plain process (what `loopline export` does)
    trained = sharded["None"]["weights"]
    plain = _model()
    load_shards(tmp / "dcp", plain)
    for name, w in trained.items():
        torch.testing.assert_close(sharded["dcp_reloaded"][name], w, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(plain.state_dict()[name], w, rtol=0, atol=0, msg=name)


def _assert_planned_sync_is_exact(sharded: dict, tmp: Path, world: int, tp: int) -> None:
    """The planner with the trainer's TP rule, run on the ranks' real shards: engines get the weights bitwise."""
    trained = sharded["None"]["weights"]
    shards = {r: torch.load(tmp / f"shards{r}.pt") for r in range(world)}
    specs = param_specs(_model())  # named parameters: the tied head is the embedding
    for engine_tp in (1, 2):
        plan = plan_transfers(
            specs, TrainerLayout(world // tp, tp), EngineLayout(1, engine_tp), tp_param_dims(_model())
        )
        targets = {int(r): empty_engine_shards(plan, int(r)) for r in plan.dst_ranks.reshape(-1)}
        copy_in_process(plan, shards, targets)
        for j, rank in enumerate(plan.dst_ranks[0]):
            for p, spec in enumerate(specs):
                box = plan.dst_box(p, j)
                expected = trained[spec.name][tuple(slice(lo, hi) for lo, hi in box)]
                assert torch.equal(targets[int(rank)][spec.name], expected), (engine_tp, j, spec.name)


def test_tp2_updates_like_one_rank(single: dict, tmp_path: Path) -> None:
    """dp=1 x tp=2 on 2 ranks."""
    sharded = _tp_world(tmp_path, world=2, tp=2)
    _assert_same_update(single, sharded, tmp_path)
    _assert_planned_sync_is_exact(sharded, tmp_path, world=2, tp=2)


@pytest.mark.slow  # 4 processes on 2 cores: 42 s quiet, 130 s under load (the steps ~11 s)
def test_dp2_tp2_updates_like_one_rank(single: dict, tmp_path: Path) -> None:
    """dp=2 x tp=2 on 4 ranks: FSDP2 sums over dp only, loss denominators count each row once."""
    sharded = _tp_world(tmp_path, world=4, tp=2)
    _assert_same_update(single, sharded, tmp_path)
    _assert_planned_sync_is_exact(sharded, tmp_path, world=4, tp=2)


def test_tp_plan_of_the_builtin_model() -> None:
    """Qwen2's own plan: q/k/v, gate/up colwise (dim 0, biases too), o/down rowwise (dim 1); the rest whole."""
    model = _model()
    plan = tp_plan(model)
    assert plan["model.layers.1.self_attn.k_proj"] == "colwise"
    assert plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert len(plan) == 7 * SMALL.num_layers
    dims = tp_param_dims(model)
    assert dims["model.layers.0.self_attn.q_proj.bias"] == 0
    assert dims["model.layers.0.self_attn.o_proj.weight"] == 1
    assert dims["model.layers.0.mlp.up_proj.weight"] == 0
    assert dims["model.embed_tokens.weight"] is None
    assert dims["model.norm.weight"] is None
    check_tp(model, 2)


def test_bad_tp_is_a_clear_error() -> None:
    """A tp that does not divide the heads, or a model without a TP plan, is named in the error."""
    with pytest.raises(
        ValueError, match="trainer_tp=4 does not divide num_key_value_heads=2 of Qwen2ForCausalLM"
    ):
        check_tp(_model(), 4)
    odd = TinyModelConfig(hidden_size=24, num_layers=1, num_heads=3, num_kv_heads=3, intermediate_size=48)
    with pytest.raises(ValueError, match="trainer_tp=2 does not divide num_attention_heads=3"):
        check_tp(build_tiny_model(odd, build_byte_tokenizer(), seed=0), 2)
    wide = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=65)
    with pytest.raises(ValueError, match="does not divide the 65 features that model.layers.0.mlp.gate_proj"):
        check_tp(build_tiny_model(wide, build_byte_tokenizer(), seed=0), 2)
    planless = _model()
    planless._tp_plan = {}
    with pytest.raises(ValueError, match="Qwen2ForCausalLM declares no tensor-parallel plan"):
        check_tp(planless, 2)
