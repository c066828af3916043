"""PPO's critic under FSDP2 over 2 gloo ranks makes the same update as one rank on the same global batch.

The rows have uneven response lengths (one empty), so the token-mean value loss only comes out right with
global token counts; the value head starts random (not zero) so the first step also moves the body. Compared:
gradients of each step (whole), weights after two steps (tests/numerics.py's rule), the reported statistics and the values after.
One rank runs in this process; the two ranks are real spawned processes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from loopline.config import CriticConfig, OptimConfig, TinyModelConfig
from loopline.data.batches import collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.critic import CriticTrainer, ScalarModel, ValueBatch
from tests.numerics import assert_adam_updates_close

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
CFG = CriticConfig(
    optim=OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0), value_clip=0.2, micro_batch_size=3
)
RANKS, STEPS = 2, 2
# run_world's spawned ranks unpickle _rank_main by its module name (tests.training...), with this process's
# sys.path: the repository root must be on it (`.venv/bin/pytest` does not put it there, `python -m pytest` does)
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)


def _critic() -> ScalarModel:
    model = ScalarModel.from_policy(build_tiny_model(SMALL, build_byte_tokenizer(), seed=0))
    with torch.no_grad():  # a head with an opinion: the first step's gradient reaches the body
        model.head.weight.copy_(
            0.3 * torch.randn(model.head.weight.shape, generator=torch.Generator().manual_seed(1))
        )
    return model


def _batch() -> ValueBatch:
    """6 rows, prompts of 2-6 tokens, responses of 0-7 (the ranks get 15 and 8 response tokens)."""
    g = torch.Generator().manual_seed(3)
    p_lens, r_lens = [3, 6, 2, 4, 5, 2], [7, 6, 2, 7, 1, 0]
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    t = collate(prompts, responses, pad_id=0)
    shape = t.response_mask.shape
    old = 0.5 * torch.randn(shape, generator=g)
    returns = old + torch.randn(shape, generator=g)  # some |V - V_old| beyond value_clip
    return ValueBatch(t.input_ids, t.attention_mask, t.response_mask, old, returns)


def _run(trainer: CriticTrainer, batch: ValueBatch) -> dict:
    """STEPS steps; whole gradients before each optimizer step, stats, values after."""
    from torch.distributed.tensor import DTensor

    grads: list[dict[str, torch.Tensor]] = []

    def keep(*_: object) -> None:
        full = {}
        for name, p in trainer.model.named_parameters():
            g = p.grad
            full[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
        grads.append(full)

    hook = trainer.optimizer.register_step_pre_hook(keep)
    stats = [trainer.step(batch) for _ in range(STEPS)]
    hook.remove()
    return {"grads": grads, "stats": stats, "values": trainer.values(batch)}


def _rank_main(rank: int, world: int, batch: ValueBatch, out: str) -> None:
    from loopline.runtime.critic import shard_critic
    from loopline.training.parallel import full_model_state, trainer_mesh

    mesh = trainer_mesh(world)
    mine = split_rows(batch, len(batch) // world)[rank]
    model = shard_critic(_critic(), mesh)
    result = _run(CriticTrainer(model, CFG, total_steps=10, group=mesh.get_group()), mine)
    values = [torch.zeros_like(result["values"]) for _ in range(world)]
    torch.distributed.all_gather(values, result["values"])
    result.update(values=torch.cat(values), weights=full_model_state(model))
    if rank == 0:
        torch.save(result, Path(out) / "ranks.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(one rank in this process, two ranks in spawned processes)."""
    batch = _batch()
    out = tmp_path_factory.mktemp("critic_fsdp")
    run_world(_rank_main, RANKS, args=(batch, str(out)), timeout_s=120)
    sharded = torch.load(out / "ranks.pt", weights_only=False)
    model = _critic()
    single = _run(CriticTrainer(model, CFG, total_steps=10), copy.deepcopy(batch))
    single["weights"] = model.state_dict()
    return single, sharded


def test_two_fsdp_critic_ranks_update_like_one(results: tuple[dict, dict]) -> None:
    single, sharded = results
    assert len(single["grads"]) == len(sharded["grads"]) == STEPS
    body = [n for n in single["grads"][0] if n.startswith("body.")]
    assert max(float(single["grads"][0][n].abs().max()) for n in body) > 0  # the body did get a gradient
    # gradients of each step, whole, then the weights by the rule for two reduction orders under AdamW
    w0 = _critic().state_dict()
    assert_adam_updates_close(
        w0, single["weights"], sharded["weights"], lrs=[CFG.optim.lr] * STEPS, grads_a=single["grads"],
        grads_b=sharded["grads"], betas=CFG.optim.betas,
    )  # fmt: skip
    assert max(float((w - w0[n]).abs().max()) for n, w in single["weights"].items()) > 1e-4  # weights moved
    torch.testing.assert_close(sharded["values"], single["values"], rtol=0, atol=1e-5)
    for s1, s2 in zip(single["stats"], sharded["stats"]):
        assert s2.loss == pytest.approx(s1.loss, rel=1e-5, abs=1e-7)
        assert s2.grad_norm == pytest.approx(s1.grad_norm, rel=1e-5)
        assert s1.extra.keys() == s2.extra.keys()
        for key in s1.extra:
            assert s2.extra[key] == pytest.approx(s1.extra[key], rel=1e-5, abs=1e-7), key
    assert 0 < single["stats"][0].extra["value_clip_fraction"] < 1  # the clip is exercised
