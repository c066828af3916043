"""The GRPO family selected from config: each variant runs a few steps, moves the weights, logs its metrics.

A random tiny model never solves the task, so the verifier's reward would be 0 everywhere and no variant
would move; these runs score with a dense stub instead (the fraction of digits in the completion).
"""

from __future__ import annotations

import pytest
import torch

from loopline.checkpoint.state import RunState
from loopline.config import ConfigError, load_config
from loopline.loops.collect import collect
from loopline.loops.context import build_context
from loopline.loops.grpo import minibatch_rows, train_grpo
from loopline.metrics.logger import read_metrics
from loopline.runtime.scorer import ScorerRole, Scores

TINY = [
    "sft.steps=0", "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    "grpo.eval_every=0", "grpo.optim.warmup_steps=0", "grpo.optim.lr=1e-3", "grpo.sampling.max_new_tokens=6",
    "data.task.num_train=100", "data.task.num_eval=8", "eval.num_prompts=8", "checkpoint_every=0",
    "progress=false", "tensorboard=false", "threads=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip


class DigitScorer(ScorerRole):  # take_stats, resize: as the in-process scorer
    """Dense stub reward: the fraction of the completion's characters that are digits."""

    def score(self, texts: list[str], answers: list[str]) -> Scores:
        rewards = torch.tensor([sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts])
        return Scores(rewards, rewards == 1.0)  # correct: full marks, as envs.base.counts_correct


def _run(tmp_path, *overrides: str):
    cfg = load_config(None, [*TINY, f"out_dir={tmp_path}", *overrides])
    ctx = build_context(cfg)
    ctx.scorer = DigitScorer()
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    try:
        train_grpo(ctx, RunState(phase="grpo"))
        engine = ctx.rollout.group.call("weights")[0]  # the one engine's whole weights (close() stops it)
    finally:
        ctx.close()
    moved = [k for k, v in ctx.model.state_dict().items() if not torch.equal(v, before[k])]
    assert all(torch.equal(engine[k], v) for k, v in ctx.model.state_dict().items())  # synced
    return moved, read_metrics(tmp_path)


@pytest.mark.parametrize(
    "variant",
    [
        ["grpo.advantage=grpo"],
        ["grpo.advantage=dr_grpo", "grpo.loss_agg=fixed_length"],
        ["grpo.advantage=rloo"],
        ["grpo.advantage=reinforce_pp"],
        ["grpo.advantage=reinforce_pp_baseline"],
        ["grpo.policy_loss=gspo", "grpo.clip_low=3e-4", "grpo.clip_high=4e-4", "grpo.loss_agg=seq_mean"],
        ["grpo.dual_clip=3.0", "grpo.clip_high=0.28", "grpo.epochs_per_step=2", "grpo.minibatches=2"],
        ["grpo.kl_coef=0.05", "grpo.kl_in=reward", "grpo.kl_estimator=k1", "grpo.advantage=reinforce_pp"],
        ["grpo.kl_coef=0.05", "grpo.kl_controller=adaptive", "grpo.kl_target=0.001", "grpo.kl_horizon=16"],
        # digits end a completion: a random model emits one often enough that not every completion is cut
        ["grpo.overlong_buffer=3", "grpo.mask_truncated=true", f"grpo.sampling.stop={list('0123456789')}"],
        ["grpo.advantage=gae", "grpo.minibatches=2", "grpo.epochs_per_step=2", "critic.micro_batch_size=4"],
    ],
    ids=lambda v: ",".join(o.split(".", 1)[1] for o in v),
)
def test_variant_runs_and_moves_the_weights(tmp_path, variant):
    moved, rows = _run(tmp_path, *variant)
    assert moved, "no parameter changed"
    assert [r["step"] for r in rows] == [1, 2]
    if "grpo.mask_truncated=true" in variant:  # something was left to train on
        assert min(r["truncated_fraction"] for r in rows) < 1.0
    for r in rows:
        assert all(torch.isfinite(torch.tensor(float(v))) for k, v in r.items() if k != "phase")
    if "grpo.advantage=gae" in variant:
        assert {"value_loss", "value_clip_fraction", "value_mean"} <= rows[0].keys()
        assert rows[-1]["value_mean"] != 0.0  # the critic's head left zero
    if "grpo.kl_controller=adaptive" in variant:
        # step 1 trains the reference itself (KL 0, below target): the coefficient shrinks by the full
        # 20% * n_steps / horizon = 20%; each row logs the coefficient its step used
        assert rows[0]["kl_coef"] == pytest.approx(0.05) and rows[0]["measured_kl"] == 0.0
        assert rows[1]["kl_coef"] == pytest.approx(0.04)


def test_mask_truncated_trains_nothing_when_every_completion_is_cut(tmp_path):
    # max_new_tokens=1 and stop strings that never occur: every completion is truncated, so no loss at all
    moved, _ = _run(
        tmp_path, "grpo.sampling.max_new_tokens=1", "grpo.mask_truncated=true", "grpo.sampling.stop=[]"
    )
    assert moved == []


class AlternatingScorer(ScorerRole):  # take_stats, resize: as the in-process scorer
    """Scores the first prompt group of every generate call all-equal; the rest vary."""

    def score(self, texts: list[str], answers: list[str]) -> Scores:
        scores = torch.arange(len(texts), dtype=torch.float32) % 2
        scores[:4] = 1.0  # group 0 (group_size 4): all equal, no gradient
        return Scores(scores, scores == 1.0)


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path):
    cfg = load_config(None, [*TINY, f"out_dir={tmp_path}", "grpo.dynamic_sampling=true"])
    ctx = build_context(cfg)
    ctx.scorer = AlternatingScorer()
    try:
        from loopline.data.sampler import Sampler
        from loopline.loops.collect import StageTimer
        from loopline.loops.context import sampling_params

        scored = collect(ctx, Sampler(100, seed=0), sampling_params(cfg.grpo.sampling), StageTimer())
    finally:
        ctx.close()
    # round 1 keeps 3 of 4 groups, round 2 fills the 4th: 2 rounds, every kept group informative
    assert scored.rounds == 2
    assert len(scored.completions) == 16 and scored.scores.shape == (16,)
    grouped = scored.scores.view(4, 4)
    assert bool(((grouped.amax(1) - grouped.amin(1)) > 0).all())
    assert scored.informative_fraction == pytest.approx(6 / 8)


def test_minibatch_rows_cover_the_batch_once():
    torch.manual_seed(0)
    rows = minibatch_rows(12, 3)
    assert [len(r) for r in rows] == [4, 4, 4]
    assert sorted(torch.cat(rows).tolist()) == list(range(12))
    state = torch.get_rng_state()
    assert torch.equal(torch.cat(minibatch_rows(5, 1)), torch.arange(5))
    assert torch.equal(torch.get_rng_state(), state)  # one minibatch draws nothing: old runs unchanged


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (["grpo.policy_loss=gspo", "grpo.advantage=reinforce_pp"], "grpo"),
        (["grpo.kl_in=reward"], "grpo"),
        (["grpo.overlong_buffer=99"], "grpo"),
        (["grpo.advantage=nope"], "grpo.advantage"),
        (["grpo.dual_clip=0.5"], "grpo.dual_clip"),
        (["grpo.minibatches=3"], "grpo.minibatches"),
        (["reward.model_clip=0"], "reward.model_clip"),
        (["reward.model_norm=rank"], "reward.model_norm"),
    ],
)
def test_bad_variant_settings_fail_at_load_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, override)


@pytest.mark.parametrize("source", ["model", "sum"])
def test_a_reward_model_scores_the_rollouts(tmp_path, source):
    from loopline.models import load_policy
    from loopline.training.critic import ScalarModel

    # a reward model on the run's own initial body, with a random head: dense, non-zero rewards
    cfg = load_config(None, [*TINY, f"out_dir={tmp_path}"])
    rm = ScalarModel.from_policy(load_policy(cfg.model, seed=cfg.seed)[0])
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    rm.save(tmp_path / "rm")
    cfg = load_config(
        None,
        [*TINY, f"out_dir={tmp_path}", f"reward.source={source}", f"reward.model_path={tmp_path / 'rm'}"],
    )
    ctx = build_context(cfg)  # the verifier stays: the random policy never solves the task
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    try:
        train_grpo(ctx, RunState(phase="grpo"))
    finally:
        ctx.close()
    assert any(not torch.equal(v, before[k]) for k, v in ctx.model.state_dict().items())
    rows = read_metrics(tmp_path)
    assert all(r["accuracy"] == 0.0 for r in rows)  # accuracy is the verifier's
    assert all(r["reward_std"] > 0 for r in rows)  # the rewards are the model's


def test_reward_model_scores_whitened_and_clipped(tmp_path):
    from loopline.loops.collect import reward_function
    from loopline.models import load_policy
    from loopline.rollout.engine import SamplingParams
    from loopline.training.critic import ScalarModel

    cfg = load_config(None, [*TINY, f"out_dir={tmp_path}"])
    rm = ScalarModel.from_policy(load_policy(cfg.model, seed=cfg.seed)[0])
    torch.nn.init.normal_(rm.head.weight, std=1.0)
    rm.save(tmp_path / "rm")
    rm_args = ["reward.source=sum", f"reward.model_path={tmp_path / 'rm'}", "reward.model_coef=0.5"]
    ctx = build_context(load_config(None, [*TINY, f"out_dir={tmp_path}", *rm_args]))
    try:
        prompts = [ctx.tokenizer("12+34=")["input_ids"], ctx.tokenizer("5+6=")["input_ids"]]
        completions = ctx.rollout.generate(prompts, SamplingParams(max_new_tokens=6, seed=0), n=8)
        ids = [prompts[c.prompt_index] for c in completions]
        verified = torch.zeros(16)
        verified[3] = 1.0
        raw = reward_function(ctx)(verified, ids, completions) - verified  # 0.5 * raw scores
        ctx.cfg.reward.model_norm = "batch"
        white = reward_function(ctx)(verified, ids, completions) - verified
        ctx.cfg.reward.model_clip = 1.0
        clipped = reward_function(ctx)(verified, ids, completions) - verified
    finally:
        ctx.close()
    expected = 0.5 * (raw - raw.mean()) / ((raw - raw.mean()).pow(2).mean().sqrt() + 1e-6)  # coef cancels
    assert raw.std() > 0 and torch.allclose(white, expected, atol=1e-5)
    assert white.abs().max() > 0.5 and torch.allclose(clipped, expected.clamp(-0.5, 0.5), atol=1e-5)


def test_reward_source_model_needs_a_path():
    with pytest.raises(ConfigError, match=r"reward.*needs model_path"):
        load_config(None, ["reward.source=sum"])


def test_model_packing_reaches_every_role_and_reports_the_padded_first_step(tmp_path, monkeypatch):
    # policy, reference (kl_coef) and critic (gae) on packed forwards; the first step's rollout is the same
    # (the engine samples before any update), so its statistics equal the padded run's within float noise
    import loopline.training.critic
    import loopline.training.policy
    from loopline.training.packing import packed_forward

    packed_models: set[str] = set()

    def counting(model, packing, routes=None):
        packed_models.add(type(model).__name__)
        return packed_forward(model, packing, routes)

    for module in (loopline.training.policy, loopline.training.critic):
        monkeypatch.setattr(module, "packed_forward", counting)
    extra = [
        "grpo.advantage=gae",
        "grpo.kl_coef=0.05",
        "critic.micro_batch_size=4",
        "grpo.micro_batch_size=5",
    ]
    _, padded = _run(tmp_path / "padded", *extra)
    assert not packed_models
    _, packed = _run(tmp_path / "packed", *extra, "model.packing=true")
    assert packed_models == {"Qwen2ForCausalLM", "Qwen2Model"}  # the policy and reference; the critic's body
    for key in ("loss", "policy_loss", "kl", "entropy", "value_loss", "value_mean", "grad_norm"):
        assert packed[0][key] == pytest.approx(padded[0][key], abs=1e-5, rel=1e-4), key


def test_runtime_engine_max_rows_reaches_the_engine_that_samples_the_steps(tmp_path, monkeypatch):
    from loopline.rollout.engine import TorchEngine

    rows_per_forward: list[int] = []
    generate = TorchEngine.generate

    def recording(self, prompts, params, n=1):
        hook = self.model.register_forward_pre_hook(
            lambda _, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            return generate(self, prompts, params, n)
        finally:
            hook.remove()

    monkeypatch.setattr(TorchEngine, "generate", recording)
    # 4 prompts x 4 samples a step through 8 rows: two prompts at a time, the others entering as rows free
    _, rows = _run(tmp_path, "runtime.engine_max_rows=8")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows_per_forward and max(rows_per_forward) <= 8


@pytest.mark.parametrize("mode", ["tis", "mask_token", "mask_seq"])
def test_behaviour_correction_in_a_synchronous_run_weighs_every_token_one(tmp_path, mode):
    # the engine samples from the weights the trainer holds, so the trainer's recomputed log-probs at the
    # sampling temperature equal the engine's: every weight is 1 within float noise, nothing is cut, and the
    # first step is the uncorrected run's
    extra = ["grpo.sampling.temperature=0.7"]
    _, plain = _run(tmp_path / "plain", *extra)
    moved, rows = _run(
        tmp_path / mode, *extra, f"grpo.behaviour_correction={mode}", "grpo.behaviour_cap=1.01"
    )
    assert moved
    for r in rows:
        assert 1 - 1e-4 < r["behaviour_weight_min"] <= r["behaviour_weight_mean"] <= r["behaviour_weight_max"]
        assert r["behaviour_weight_max"] < 1 + 1e-4 and r["behaviour_cut_fraction"] == 0.0
        # engine and trainer both float32: their log-probs of the sampled tokens differ by float noise only
        assert r["logprob_mismatch_kl"] < 1e-8 and r["logprob_mismatch_max_abs"] < 1e-4
    for key in ("loss", "policy_loss", "entropy", "grad_norm"):
        assert rows[0][key] == pytest.approx(plain[0][key], abs=1e-6, rel=1e-5), key
    assert "behaviour_weight_min" not in plain[0] and "logprob_mismatch_kl" not in plain[0]


def test_behaviour_correction_weighs_samples_from_a_stale_engine(tmp_path, monkeypatch):
    # the engine keeps the initial weights (a copy of its own, no sync after the first): from step 2 on the
    # trainer's policy has moved, so the weights spread around 1, a tight cap truncates some of them, and the loss
    # differs from the uncorrected run's on the same samples; step 1 is still on-policy
    import loopline.loops.grpo as grpo

    synced = grpo.sync_engine
    monkeypatch.setattr(
        grpo, "sync_engine", lambda ctx, version: synced(ctx, version) if version == 0 else None
    )

    def stale_run(out, *overrides: str) -> list[dict]:
        overrides = (f"out_dir={out}", "grpo.steps=3", "rollout.share_weights=false", *overrides)
        ctx = build_context(load_config(None, [*TINY, *overrides]))
        ctx.scorer = DigitScorer()
        try:
            train_grpo(ctx, RunState(phase="grpo"))
        finally:
            ctx.close()
        return read_metrics(out)

    plain = stale_run(tmp_path / "plain")
    rows = stale_run(tmp_path / "tis", "grpo.behaviour_correction=tis", "grpo.behaviour_cap=1.001")
    assert rows[0]["behaviour_cut_fraction"] == 0.0 and rows[0]["behaviour_weight_max"] < 1 + 1e-4
    assert rows[0]["loss"] == pytest.approx(plain[0]["loss"], abs=1e-6)
    for r, p in zip(rows[1:], plain[1:]):
        assert r["behaviour_weight_min"] < 1 - 1e-3 and r["behaviour_weight_max"] > 1.001
        assert 0.0 < r["behaviour_cut_fraction"] < 1.0
        assert r["reward_mean"] == p["reward_mean"]  # the same stale samples
        assert abs(r["loss"] - p["loss"]) > 1e-5  # weighted


def test_behaviour_correction_refuses_filtered_sampling():
    with pytest.raises(ConfigError, match="top_p/top_k"):
        load_config(None, ["grpo.behaviour_correction=tis", "grpo.sampling.top_k=5"])
    with pytest.raises(ConfigError, match=r"grpo\.behaviour_cap"):
        load_config(None, ["grpo.behaviour_correction=tis", "grpo.behaviour_cap=1"])
