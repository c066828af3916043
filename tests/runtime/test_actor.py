"""The actor role on the local backend: a one-rank WorkerGroup of the ActorWorker class Ray runs, in this
process, training the driver's model in place and stepping exactly as a PolicyTrainer on it does.
(Its ray ranks: tests/runtime/test_train_ray.py, test_fault_ray.py; checkpoints: tests/checkpoint.)"""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import OptimConfig
from loopline.data.batches import collate
from loopline.runtime.actor import heal_sources, local_actor
from loopline.runtime.actor_worker import ActorWorker
from loopline.training.policy import PolicyTrainer

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 2, 5, 3)]
    return collate(prompts, responses, pad_id=0)


def test_the_local_actor_is_one_actor_worker_training_the_model_in_place(small_model):
    twin = copy.deepcopy(small_model)
    actor = local_actor(small_model)
    worker = actor.group.local()
    assert actor.group.world_size == 1 and isinstance(worker, ActorWorker)
    assert worker.model is small_model and actor.model is small_model  # no copy: trained where it is
    actor.start_phase(OPTIM, 10, None)
    trainer = PolicyTrainer(twin, OPTIM, 10)
    batch = _batch()
    for _ in range(2):
        got, want = actor.sft_step(batch, micro_batch_size=2), trainer.sft_step(batch, micro_batch_size=2)
        assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)  # bitwise, through the group
    for name, tensor in twin.state_dict().items():
        assert torch.equal(small_model.state_dict()[name], tensor), name
    assert torch.equal(actor.logprobs(batch), _logprobs(twin, batch))


def test_policy_and_reference_leave_the_weights_as_they_are(small_model):
    actor = local_actor(small_model)
    before = {k: v.clone() for k, v in small_model.state_dict().items()}
    assert actor.policy() is small_model
    actor.start_phase(OPTIM, 10, None, reference=True)
    for name, tensor in before.items():
        assert torch.equal(small_model.state_dict()[name], tensor), name
    batch = _batch()
    assert torch.equal(
        actor.logprobs(batch, reference=True), actor.logprobs(batch)
    )  # a frozen copy, as it is
    actor.sft_step(batch, micro_batch_size=4)
    assert not torch.equal(
        actor.logprobs(batch, reference=True), actor.logprobs(batch)
    )  # the policy moved on
    reference = actor.reference.group.local().model
    assert reference is not small_model and not any(p.requires_grad for p in reference.parameters())


def _logprobs(model, batch):
    from loopline.training.policy import response_logprobs

    with torch.no_grad():
        return response_logprobs(model, batch)[0]


def test_heal_sources_take_every_position_from_a_live_rank_at_the_newest_step():
    # 4 ranks, 2 replicas: ranks 0, 1 and 2, 3 hold positions 0, 1. Rank 1 lost; its position lives on rank 3.
    assert heal_sources({0: 5, 2: 5, 3: 5}, 4, 2, before=5) == (5, {0: 0, 1: 3})
    # rank 3 committed step 6 before the loss was seen, rank 2 too, rank 0 not: the committed state wins
    assert heal_sources({0: 5, 2: 6, 3: 6}, 4, 2, before=5) == (6, {0: 2, 1: 3})
    # position 1 lost in both replicas: nothing to heal from
    with pytest.raises(ValueError, match="no live replica holds the shards of trainer rank 1 after step 5"):
        heal_sources({0: 5, 2: 5}, 4, 2, before=5)
    # position 0 lives only on a rank that did not commit the step the others did
    with pytest.raises(ValueError, match="trainer rank 0 after step 6"):
        heal_sources({0: 5, 3: 6}, 4, 2, before=5)
    # steps that are neither the group's nor one more: not this call's failure
    with pytest.raises(ValueError, match="not 5 or 6"):
        heal_sources({0: 7, 1: 7}, 2, 2, before=5)


def test_a_checkpointed_actor_trains_on_shared_prompts(small_model):
    # activation checkpointing recomputes the shared-prompt forwards: the trainer keeps sharing a group's prompt
    from loopline.config import load_config

    cfg = load_config(None, ["training.activation_checkpointing=full"])
    actor = local_actor(small_model, cfg)
    actor.start_phase(OPTIM, 10, None)
    assert actor.group.local().trainer.share_prompts
