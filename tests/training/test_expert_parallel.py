"""Expert parallelism (training.expert_parallel) across real gloo processes: 2 ranks, each MoE layer's experts split
over them under FSDP2, each rank training on half the batch, give one rank's loss and gradients on the whole batch
(within float-sum noise: the same products, summed in another order), and an AdamW step moves the experts alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from tests.moe import tiny_moe

pytestmark = pytest.mark.gloo

RANKS = 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 12 tokens, some rows right-padded (labels -100): rows 2r, 2r + 1 go to rank r of 4."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (8, 12), generator=g)
    labels = ids.clone()
    labels[1, 7:] = -100
    labels[6, 4:] = -100
    return ids, labels


def _loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, total: int) -> torch.Tensor:
    """Summed next-token cross-entropy of the rows over `total` (the whole batch's tokens): ranks' shares add up."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        / total
    )


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
    }


def _rank(rank: int, world: int, out: str, preset: str, checkpointing: str) -> None:
    from loopline.training.expert_parallel import apply_ep, expert_modules
    from loopline.training.parallel import apply_activation_checkpointing, shard_model, trainer_mesh

    mesh = trainer_mesh(world)
    model = apply_activation_checkpointing(tiny_moe(preset), checkpointing)  # a recompute exchanges again
    ignored = apply_ep(model, mesh)
    assert (
        expert_modules(model)[0].gate_up_proj.to_local().shape[0] * world
        == expert_modules(model)[0].num_experts
    )
    shard_model(model, mesh, ignored=ignored)
    ids, labels = _batch()
    total = int((labels[:, 1:] != -100).sum())
    rows = slice(rank * len(ids) // world, (rank + 1) * len(ids) // world)
    loss = _loss(model, ids[rows], labels[rows], total)
    loss.backward()
    grads = _full_grads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"grads": grads, "weights": weights}, Path(out, "ep.pt"))
    torch.save(loss.detach(), Path(out, f"loss{rank}.pt"))


@pytest.mark.parametrize(
    "preset,checkpointing", [("qwen3-moe-tiny", "none"), ("mixtral-tiny", "none"), ("qwen3-moe-tiny", "full")]
)
def test_two_expert_parallel_ranks_match_one_rank(tmp_path, preset, checkpointing):
    run_world(_rank, RANKS, args=(str(tmp_path), preset, checkpointing), timeout_s=150)
    got = torch.load(tmp_path / "ep.pt")
    model = tiny_moe(preset)
    ids, labels = _batch()
    loss = _loss(model, ids, labels, int((labels[:, 1:] != -100).sum()))
    loss.backward()
    ranks_loss = sum(torch.load(tmp_path / f"loss{r}.pt") for r in range(RANKS))
    torch.testing.assert_close(ranks_loss, loss.detach(), rtol=1e-6, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert got["grads"].keys() == grads.keys()
    for name, grad in grads.items():  # every parameter's gradient, the experts' included, within 1e-6
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any("experts" in n and grads[n].abs().sum() > 0 for n in grads)
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    # after the step: weights whose gradient is above the float-sum noise moved as one rank's did (Adam's update is
    # ~lr wherever the gradient is not ~0, so compare where it clearly is not)
    for name, weight in model.state_dict().items():
        moved = grads[name].abs() > 1e-5 if name in grads else torch.ones_like(weight, dtype=torch.bool)
        torch.testing.assert_close(got["weights"][name][moved], weight[moved], rtol=1e-5, atol=1e-6, msg=name)


RAY2 = ["runtime.backend=ray", "runtime.trainer_ranks=2"]


@pytest.mark.parametrize(
    "overrides,hint",
    [
        (["runtime.trainer_ep=2"], "trainer_ep=2 needs backend=ray"),
        ([*RAY2[:1], "runtime.trainer_ranks=4", "runtime.trainer_ep=2"], "must equal trainer_ranks=4"),
        (
            [*RAY2, "runtime.trainer_ep=2", "runtime.trainer_tp=2"],
            "trainer_ep=2 with trainer_tp=2 is not built",
        ),
        (
            [*RAY2, "runtime.trainer_ep=2", "runtime.trainer_replicas=2"],
            "with trainer_replicas=2 is not built",
        ),
        (
            [*RAY2, "runtime.trainer_ep=2", "training.mixed_precision=bf16"],
            "with training.mixed_precision=bf16",
        ),
    ],
)
def test_expert_parallelism_where_it_is_not_built_is_refused_naming_the_field(overrides, hint):
    from loopline.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert hint in str(err.value)


@pytest.mark.parametrize(
    "model,hint",
    [
        ([], "runtime.trainer_ep=2: the built-in model is not a mixture of experts"),
        (["model.init=random", "model.preset=qwen3-moe-tiny", "runtime.trainer_ranks=3", "runtime.trainer_ep=3",
          "grpo.prompts_per_step=3", "sft.batch_size=3"],
         "runtime.trainer_ep=3 must divide the 128 experts per layer of model.preset=qwen3-moe-tiny"),
    ],
)  # fmt: skip
def test_expert_parallelism_of_a_model_it_cannot_split_exits_2_in_one_line(tmp_path, capsys, model, hint):
    from loopline.cli import main

    args = ["train", f"out_dir={tmp_path / 'run'}", *RAY2, "runtime.trainer_ep=2", *model]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert hint in err and "Traceback" not in err and not (tmp_path / "run").exists()


def test_apply_ep_refuses_a_dense_model_and_experts_it_cannot_divide(small_model):
    from loopline.training.expert_parallel import check_ep

    with pytest.raises(ValueError, match="Qwen2ForCausalLM is not a mixture of experts"):
        check_ep(small_model, 2)
    with pytest.raises(ValueError, match="runtime.trainer_ep=3 must divide the model's 8 experts"):
        check_ep(tiny_moe("mixtral-tiny"), 3)


def test_local_experts_grouped_and_one_by_one_agree_and_a_rank_without_tokens_still_has_gradients(
    monkeypatch,
):
    from loopline.training import expert_parallel

    experts = tiny_moe().model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, experts.hidden_dim, generator=g)
    which = torch.randint(0, 16, (40,), generator=g)  # this rank's 16 experts of 128
    gate_up, down = experts.gate_up_proj[:16], experts.down_proj[:16]
    grouped = expert_parallel._local_experts(rows, which, gate_up, down, experts.act_fn)
    monkeypatch.setattr(expert_parallel, "_GROUPED_MM", None)
    one_by_one = expert_parallel._local_experts(rows, which, gate_up, down, experts.act_fn)
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-6)
    gate, up = torch.einsum("nh,noh->no", rows, gate_up[which]).chunk(2, dim=-1)  # by hand, row by row
    torch.testing.assert_close(grouped, torch.einsum("ni,nhi->nh", experts.act_fn(gate) * up, down[which]),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    none = expert_parallel._local_experts(rows[:0], which[:0], gate_up, down, experts.act_fn)
    none.sum().backward()
    assert none.shape == (0, experts.hidden_dim) and float(experts.gate_up_proj.grad.abs().sum()) == 0
