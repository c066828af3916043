"""The rollout role on the local backend: a one-rank WorkerGroup of the EngineWorker class Ray runs; the weight
sync built with the roles copies the actor's weights into the engine's own copy, whatever actor it came from, by
running the planned transfer in process (LoRA adapters merged), or, with rollout.share_weights where it samples
the same tokens, the engine runs on the actor's parameters themselves.
(Its ray ranks and elastic engines: tests/runtime/test_elastic_engines.py; the generators: tests/checkpoint.)"""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import load_config
from loopline.data.rows import PromptRow
from loopline.distributed.resharding import TrainerLayout, check_plan
from loopline.distributed.weight_sync import engines_plan, param_specs
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.runtime.actor_worker import ActorWorker
from loopline.runtime.engine import EngineWorker
from loopline.runtime.roles import build_roles
from loopline.training.lora import merged_state_dict

PROMPTS = [[5, 6, 7], [8, 9]]


def test_local_roles_are_one_rank_groups_of_the_ray_worker_classes(small_model, tokenizer):
    cfg = load_config(overrides=["grpo.kl_coef=0.1", "grpo.advantage=gae", "rollout.share_weights=false"])
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
    cfg = load_config(overrides=["rollout.share_weights=false"])
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


def test_the_local_engine_cannot_resize_but_its_env_workers_can(small_model, tokenizer):
    roles = build_roles(load_config(overrides=[]), small_model, tokenizer)
    try:
        with pytest.raises(ValueError, match="runtime.backend=ray"):
            roles.rollout.resize(2)
        roles.scorer.resize(2)  # env worker processes: any number, on either backend
        rows = [PromptRow(i, f"{i}+0=", str(i)) for i in range(4)]
        assert roles.scorer.score(["0", "1", "x", "3"], rows).rewards.tolist() == [1.0, 1.0, 0.0, 1.0]
        assert roles.scorer.take_stats() == {
            "score_retries": 0.0,
            "env_workers_replaced": 0.0,
            "env_workers": 2.0,
        }
    finally:
        roles.shutdown()


# ---------------------------------------------------------------------------------------------------------
# The local sync runs the planned transfer in process
# ---------------------------------------------------------------------------------------------------------


def _stale(engine: TorchEngine, trainer: dict[str, torch.Tensor]) -> list[str]:
    """The engine's parameters whose bytes differ from the trainer's (merged) weights of the same name."""
    return [
        n
        for n, p in engine.model.named_parameters()
        if not torch.equal(p.detach().view(torch.uint8), trainer[n].view(torch.uint8))
    ]


def _move_every_weight(model: torch.nn.Module) -> None:
    """Move every trainer tensor (LoRA adapters and frozen base weights too), so each one needs the sync."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_local_sync_runs_the_plan_into_every_engine_parameter_bitwise(small_model, tokenizer, lora):
    cfg = load_config(overrides=["model.lora.r=4"] if lora else ["rollout.share_weights=false"])
    roles = build_roles(cfg, small_model, tokenizer)
    worker = roles.rollout.group.local()
    engine = worker.engine
    _move_every_weight(small_model)
    merged = merged_state_dict(small_model)  # the plain names the engine has, adapters folded in
    names = [n for n, _ in engine.model.named_parameters()]
    assert _stale(engine, merged) == names  # every parameter must be synced: one the plan missed would show
    roles.rollout.update_weights(version=7)
    assert engine.version == 7 and _stale(engine, merged) == []
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in merged.items())  # tied aliases too
    plan = worker.plan  # the planner's plan, one unsharded trainer rank into the engine, checked exact
    assert plan.trainer == TrainerLayout(fsdp=1) and [s.name for s in plan.params] == names
    assert check_plan(plan).exact
    shared = {t.data_ptr() for t in small_model.state_dict().values()}
    assert not any(
        p.data_ptr() in shared for p in engine.model.parameters()
    )  # copies, not the trainer's tensors


def test_a_plan_that_skips_a_parameter_leaves_it_stale(small_model, tokenizer, monkeypatch):
    """The check above is not vacuous: a plan without one parameter leaves exactly that one behind."""
    import loopline.runtime.engine as engine_module

    dropped = "model.layers.1.mlp.down_proj.weight"

    def without_one(plan, model, layout, targets):
        specs = [s for s in param_specs(model) if s.name != dropped]
        return engines_plan(specs, layout, tuple(targets))

    monkeypatch.setattr(engine_module, "sync_plan", without_one)
    roles = build_roles(load_config(overrides=["rollout.share_weights=false"]), small_model, tokenizer)
    engine = roles.rollout.group.local().engine
    _move_every_weight(small_model)
    roles.rollout.update_weights(version=1)
    assert _stale(engine, merged_state_dict(small_model)) == [dropped]


# ---------------------------------------------------------------------------------------------------------
# rollout.share_weights: the local engine on the actor's own parameters
# ---------------------------------------------------------------------------------------------------------


def test_a_shared_engine_runs_on_the_actors_parameters_in_a_module_of_its_own(small_model, tokenizer):
    roles = build_roles(load_config(overrides=[]), small_model, tokenizer)  # shared by default
    try:
        worker = roles.rollout.group.local()
        engine = worker.engine
        pairs = list(zip(engine.model.parameters(), small_model.parameters()))
        assert pairs and all(e is a for e, a in pairs)  # no second copy of the weights
        assert engine.model is not small_model  # its own module: train/eval mode, hooks, cache
        _move_every_weight(small_model)
        roles.rollout.update_weights(version=5)  # the sync still runs: it commits the version, copies nothing
        assert engine.version == 5 and _stale(engine, small_model.state_dict()) == []
        assert check_plan(worker.plan).exact
        params = SamplingParams(max_new_tokens=4, temperature=1.0)
        twin = TorchEngine(copy.deepcopy(small_model), tokenizer)  # the same weights, copied
        torch.manual_seed(1)
        got = [c.token_ids for c in roles.rollout.generate(PROMPTS, params, n=2)]
        torch.manual_seed(1)
        assert got == [c.token_ids for c in twin.generate(PROMPTS, params, n=2)]
        assert all(p.requires_grad for p in small_model.parameters())  # generating left the actor trainable
    finally:
        roles.shutdown()


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.share_weights=false"],
        ["model.lora.r=4"],  # the engine needs the adapters merged into its weights
        ["rollout.dtype=bfloat16"],  # the sync casts
    ],
    ids=["off", "lora", "bf16_engine"],
)
def test_the_engine_keeps_its_own_copy_where_sharing_would_sample_otherwise(
    small_model, tokenizer, overrides
):
    cfg = load_config(overrides=overrides)
    assert not cfg.engine_shares_weights
    roles = build_roles(cfg, small_model, tokenizer)
    try:
        actor = {p.data_ptr() for p in small_model.parameters()}
        assert not any(p.data_ptr() in actor for p in roles.rollout.group.local().engine.model.parameters())
    finally:
        roles.shutdown()


def test_copy_in_process_skips_a_tensor_that_is_its_own_source():
    from loopline.distributed.weight_sync import copy_in_process

    model = torch.nn.Linear(3, 2)
    specs = param_specs(model)
    plan = engines_plan(specs, TrainerLayout(fsdp=1), (0,))
    mine = dict(model.state_dict())
    other = {k: torch.zeros_like(v) for k, v in mine.items()}
    assert copy_in_process(plan, {0: mine}, {1: mine}) == 0  # shared: nothing to move
    assert copy_in_process(plan, {0: mine}, {1: other}) == sum(v.nbytes for v in mine.values())
    assert all(torch.equal(other[k], v) for k, v in mine.items())


@pytest.mark.parametrize(
    "overrides, packs",
    [([], True), (["rollout.share_weights=false"], False), (["rollout.pack_weights=always",
     "rollout.share_weights=false"], True), (["rollout.pack_weights=never"], False), (["model.lora.r=4"], False)],
)  # fmt: skip
def test_an_engine_packs_its_weights_where_the_config_says(small_model, tokenizer, overrides, packs):
    """rollout.pack_weights=auto packs in a local engine on the actor's own weights only (their copy fits where
    the actor's gradients were); always and never say what they mean."""
    from loopline.runtime.engine import make_engine

    cfg = load_config(None, overrides)
    assert make_engine(cfg, copy.deepcopy(small_model), tokenizer, seed=0).pack_weights is packs
