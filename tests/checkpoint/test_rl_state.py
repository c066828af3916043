"""The RL state a checkpoint holds besides the policy: the frozen reference (written once, then linked),
the loop's state (KL controller, critic, engine generators), and the engines' sampling generators."""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.checkpoint.state import Checkpointer, CheckpointParts, LoopState, RunState, load_loop_state
from loopline.config import CheckpointConfig, CriticConfig, GRPOConfig, OptimConfig, RunConfig
from loopline.distributed.workers import LocalGroup
from loopline.loops.grpo import _check_resumable
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.runtime.actor import local_actor
from loopline.runtime.engine import EngineWorker, RolloutRole
from loopline.runtime.engine_sync import InProcessSync
from loopline.training.critic import CriticTrainer, ScalarModel

PROMPTS = [[5, 6, 7], [8, 9]]
SAMPLE = SamplingParams(max_new_tokens=6, temperature=1.0)


def _tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_an_engine_generator_replays_from_its_saved_state(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer, seed=7)
    engine.generate(PROMPTS, SAMPLE, n=2)  # move the generator on
    saved = engine.rng_state()
    first = _tokens(engine.generate(PROMPTS, SAMPLE, n=2))
    torch.manual_seed(0)  # the process's RNG does not matter: the engine has its own
    engine.set_rng_state(saved)
    assert _tokens(engine.generate(PROMPTS, SAMPLE, n=2)) == first
    # a fresh engine with the same seed samples the same stream as a torch RNG seeded alike
    twin, plain = (
        TorchEngine(copy.deepcopy(small_model), tokenizer, seed=3),
        TorchEngine(small_model, tokenizer),
    )
    torch.manual_seed(3)
    assert _tokens(twin.generate(PROMPTS, SAMPLE)) == _tokens(plain.generate(PROMPTS, SAMPLE))
    assert plain.rng_state() is None
    with pytest.raises(ValueError, match="process's torch RNG"):
        plain.set_rng_state(saved)


def _local_rollout(engine: TorchEngine) -> RolloutRole:
    """One engine rank in this process (the local backend's rollout), synced from a local actor."""
    engines = LocalGroup(EngineWorker, role="rollout", init_args=(RunConfig(), engine))
    return RolloutRole(engines, InProcessSync(local_actor(copy.deepcopy(engine.model)).group, engines))


def test_rollout_rng_states_restore_only_what_fits(small_model, tokenizer):
    own = _local_rollout(TorchEngine(small_model, tokenizer, seed=1))
    states = own.rng_states()
    assert len(states) == 1 and isinstance(states[0], torch.Tensor)
    assert own.set_rng_states(states, reseed=99) is True
    # saved by two engines: this one is reseeded from reseed + rank, deterministically
    assert own.set_rng_states(states * 2, reseed=99) is False
    assert torch.equal(own.rng_states()[0], _seeded(99))
    # the local default samples from the process's RNG (checkpointed in rng.pt): nothing of its own to restore
    shared = _local_rollout(TorchEngine(small_model, tokenizer))
    assert shared.rng_states() == [None]
    assert shared.set_rng_states([None], reseed=0) is True
    assert shared.set_rng_states(states, reseed=0) is False  # a ray engine's stream cannot be replayed here


def _reference(actor):
    """The frozen reference model of a local actor (its reference rank is in this process)."""
    return actor.reference.group.local().model


def _seeded(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def test_the_reference_is_written_once_then_linked_and_read_back(tmp_path, small_model, tokenizer):
    actor = local_actor(small_model)
    actor.start_phase(OptimConfig(lr=1e-2, warmup_steps=0), 10, None, reference=True)
    with torch.no_grad():
        small_model.model.norm.weight.add_(0.5)  # the policy moves on; the reference stays
    frozen = {k: v.clone() for k, v in _reference(actor).state_dict().items()}
    checkpoints = Checkpointer(tmp_path, CheckpointConfig(), actor, small_model, tokenizer)
    critic = CriticTrainer(ScalarModel.from_policy(small_model), CriticConfig(), 10)
    loop = LoopState(kl={"value": 0.25, "target": 0.01, "horizon": 100}, critic=critic.state_dict())
    checkpoints.save(RunState("grpo", 1), loop, reference=True)
    checkpoints.save(RunState("grpo", 2), loop, reference=True)
    first, second = (tmp_path / "checkpoints" / n / "reference" for n in ("grpo-000001", "grpo-000002"))
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())
    for f in first.iterdir():  # the same files, not a second write
        assert (second / f.name).stat().st_ino == f.stat().st_ino

    resumed = local_actor(copy.deepcopy(small_model))
    state, parts = Checkpointer(tmp_path, CheckpointConfig(), resumed, resumed.model, tokenizer).resume()
    assert state.step == 2 and parts.reference is not None and parts.loop is not None
    resumed.start_phase(OptimConfig(lr=1e-2, warmup_steps=0), 10, parts, reference=True)
    for name, tensor in frozen.items():  # the saved reference, not a copy of the resumed policy
        assert torch.equal(_reference(resumed).state_dict()[name], tensor), name
    restored = load_loop_state(parts)
    assert restored.kl == loop.kl and restored.engine_rng == []
    again = CriticTrainer(ScalarModel.from_policy(small_model), CriticConfig(), 10)
    assert restored.critic is not None
    again.load_state_dict(restored.critic)
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        ({"kl_coef": 0.1}, "frozen reference policy"),
        ({"advantage": "gae"}, "critic"),
        ({"kl_coef": 0.1, "kl_controller": "adaptive"}, "adaptive KL controller"),
    ],
)
def test_resuming_without_the_state_the_settings_need_is_a_clear_error(overrides, missing):
    cfg = GRPOConfig(**overrides)
    with pytest.raises(ValueError, match=f"cannot resume grpo at step 3: the checkpoint has no .*{missing}"):
        _check_resumable(cfg, RunState("grpo", 3), CheckpointParts(dcp="x"), LoopState(engine_rng=[None]))
    full = CheckpointParts(dcp="x", reference="r")
    _check_resumable(cfg, RunState("grpo", 3), full, LoopState(kl={}, critic={}, engine_rng=[None]))


def test_loop_state_reads_and_writes_the_loop_pt_dict_as_before():
    """loop.pt stays the plain dict every loopline wrote: {"kl", "engine_rng"[, "critic"]}; any of them reads."""
    kl = {"value": 0.05, "target": 0.01, "horizon": 16}
    rng = [torch.get_rng_state()]
    with_critic = {"kl": kl, "engine_rng": rng, "critic": {"dcp": "critic"}}
    assert LoopState.from_dict(with_critic).to_dict() == with_critic
    assert list(LoopState.from_dict(with_critic).to_dict()) == ["kl", "engine_rng", "critic"]
    without = {"kl": kl, "engine_rng": rng}
    assert LoopState.from_dict(without) == LoopState(kl=kl, engine_rng=rng)
    assert LoopState.from_dict(without).to_dict() == without  # no "critic" key without a critic
    assert LoopState.from_dict({}) == LoopState()  # a key the writer lacked reads as absent
