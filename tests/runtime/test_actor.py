"""The actor role on the local backend: a one-rank WorkerGroup of the ActorWorker class Ray runs, in this
process, training the driver's model in place and stepping exactly as a PolicyTrainer on it does.
(Its ray ranks: tests/runtime/test_train_ray.py, test_fault_ray.py; checkpoints: tests/checkpoint.)"""

from __future__ import annotations

import copy

import torch

from loopline.config import OptimConfig
from loopline.data.batches import collate
from loopline.runtime.actor import ActorWorker, local_actor
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
