"""The rollout role on the local backend: a one-rank WorkerGroup of the EngineWorker class Ray runs; the weight
sync built with the roles copies the actor's weights into the engine's own copy, whatever actor it came from.
(Its ray ranks and elastic engines: tests/runtime/test_elastic_engines.py; the generators: tests/checkpoint.)"""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import load_config
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.runtime.actor import ActorWorker
from loopline.runtime.engine import EngineWorker
from loopline.runtime.roles import build_roles

PROMPTS = [[5, 6, 7], [8, 9]]


def test_local_roles_are_one_rank_groups_of_the_ray_worker_classes(small_model, tokenizer):
    cfg = load_config(overrides=["grpo.kl_coef=0.1", "grpo.advantage=gae"])
    roles = build_roles(cfg, small_model, tokenizer)
    try:
        engine = roles.rollout.group.local()
        assert isinstance(roles.actor.group.local(), ActorWorker) and isinstance(engine, EngineWorker)
        assert roles.actor.reference is not None and roles.actor.reference.group.world_size == 1
        assert roles.critic is not None and roles.critic.group.world_size == 1
        assert (
            engine.engine.rng_state() is None
        )  # samples from this process's RNG, as the loop checkpoints it
        assert all(e is not a for e, a in zip(engine.engine.model.parameters(), small_model.parameters()))
    finally:
        roles.shutdown()


def test_update_weights_copies_the_actors_weights_into_the_engines_own_copy(small_model, tokenizer):
    cfg = load_config(overrides=[])
    roles = build_roles(cfg, small_model, tokenizer)
    engine = roles.rollout.group.local().engine
    with torch.no_grad():
        small_model.model.norm.weight.add_(0.5)  # the actor's policy moves; the engine has not synced
    assert not torch.equal(engine.model.model.norm.weight, small_model.model.norm.weight)
    roles.rollout.update_weights(version=3)
    assert engine.version == 3
    for name, tensor in small_model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    with torch.no_grad():
        small_model.model.norm.weight.add_(0.5)  # a copy, not shared tensors
    assert not torch.equal(engine.model.model.norm.weight, small_model.model.norm.weight)
    twin = TorchEngine(copy.deepcopy(engine.model), tokenizer)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    torch.manual_seed(1)
    got = [c.token_ids for c in roles.rollout.generate(PROMPTS, params, n=2)]
    torch.manual_seed(1)
    assert got == [c.token_ids for c in twin.generate(PROMPTS, params, n=2)]  # the same draws, in process


def test_the_local_engines_and_scorer_cannot_resize(small_model, tokenizer):
    roles = build_roles(load_config(overrides=[]), small_model, tokenizer)
    with pytest.raises(ValueError, match="runtime.backend=ray"):
        roles.rollout.resize(2)
    with pytest.raises(ValueError, match="runtime.backend=ray"):
        roles.scorer.resize(2)
    assert roles.scorer.take_stats() == {}
