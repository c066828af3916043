"""max_tokens_per_micro_batch on 2 FSDP2 gloo ranks (real spawned processes): ranks whose rows differ in length
plan different numbers of micro-batches, agree on the larger, and make the update of one process on the whole
batch in fixed micro-batches (tests/numerics.py's rule for the weights after AdamW)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from loopline.data.batches import RolloutBatch, split_rows
from loopline.data.token_budget import plan_micro_batches, row_lengths
from loopline.training.policy import PolicyTrainer, grpo_loss
from tests.numerics import assert_adam_updates_close
from tests.training.test_fsdp_equivalence import OPTIM, _full_grads, _global_batch, _grpo_cfg, _model

BUDGET = 14  # rank 0's rows (10-12 tokens) one per micro-batch; rank 1's (3-11) three micro-batches
STEPS = 2


def _steps(trainer: PolicyTrainer, batch: RolloutBatch) -> tuple[list[float], list]:
    grads: list = []
    hook = trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(_full_grads(trainer.model)))
    losses = [trainer.policy_step(batch, 0.05).loss for _ in range(STEPS)]
    hook.remove()
    return losses, grads


def _rank_main(rank: int, world: int, batch: RolloutBatch, out: str) -> None:
    """One FSDP2 rank on its half of the rows, micro-batches by token budget; rank 0 saves the results."""
    from loopline.training.micro import micro_batches
    from loopline.training.parallel import full_model_state, shard_model, trainer_mesh

    mesh = trainer_mesh(world)
    mine = split_rows(batch, len(batch) // world)[rank]
    local = len(plan_micro_batches(*row_lengths(mine), BUDGET))
    agreed = len(micro_batches(mine, 3, BUDGET, group=mesh.get_group()))
    counts = torch.tensor([local, agreed])
    gathered = [torch.zeros_like(counts) for _ in range(world)]
    torch.distributed.all_gather(gathered, counts)
    model = shard_model(_model(), mesh)
    trainer = PolicyTrainer(
        model, OPTIM, 10, group=mesh.get_group(), loss=grpo_loss(_grpo_cfg("token_mean", 3)), micro_batch_size=3,
        max_tokens=BUDGET,
    )  # fmt: skip
    losses, grads = _steps(trainer, mine)
    state = full_model_state(model)
    if rank == 0:
        torch.save({"counts": [c.tolist() for c in gathered], "losses": losses, "grads": grads, "weights": state},
                   Path(out) / "ranks.pt")  # fmt: skip


@pytest.mark.gloo  # spawned ranks
def test_ranks_agree_on_the_count_and_update_like_one_process(tmp_path: Path) -> None:
    batch = _global_batch()
    run_world(
        _rank_main, 2, args=(batch, str(tmp_path)), timeout_s=300
    )  # slow only on a loaded machine (~10 s quiet)
    sharded = torch.load(tmp_path / "ranks.pt", weights_only=False)
    (local0, agreed0), (local1, agreed1) = sharded["counts"]
    assert local0 != local1  # the ranks' own plans differ ...
    assert agreed0 == agreed1 == max(local0, local1)  # ... and both run the larger count
    model = _model()
    trainer = PolicyTrainer(model, OPTIM, 10, loss=grpo_loss(_grpo_cfg("token_mean", 3)), micro_batch_size=3)
    losses, grads = _steps(trainer, batch)
    assert sharded["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-7)
    w0 = _model().state_dict()
    lrs = [OPTIM.lr] * STEPS
    assert_adam_updates_close(
        w0, model.state_dict(), sharded["weights"], lrs=lrs, grads_a=grads, grads_b=sharded["grads"],
        betas=OPTIM.betas, msg="token budget",
    )  # fmt: skip
