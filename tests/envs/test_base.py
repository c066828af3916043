"""The Env protocol's single-turn case: VerifierEnv alone, and through the multi-turn driver it gives
the same tokens, mask and reward as the single-turn GRPO path (generate -> exact_match -> collate)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loopline.data.batches import collate
from loopline.data.datasets import PromptRow
from loopline.data.tasks import exact_match
from loopline.envs.base import Env, StepResult, VerifierEnv
from loopline.envs.multiturn import MultiTurnConfig, PlainFormat, run_rollout, to_batch
from loopline.rollout.engine import SamplingParams, TorchEngine


def test_verifier_env_is_one_step():
    env: Env = VerifierEnv()
    sample = PromptRow(0, "2+2=", "4")
    assert asyncio.run(env.reset(sample)) == "2+2="
    assert asyncio.run(env.step("4\nmore")) == StepResult("", 1.0, True, {"correct": 1.0})
    assert asyncio.run(env.step("5")).reward == 0.0


def test_verifier_env_takes_any_verifier():
    env = VerifierEnv(lambda text, answer: 0.5 if answer in text else 0.0)
    asyncio.run(env.reset(PromptRow(0, "q", "42")))
    assert asyncio.run(env.step("it is 42")).reward == 0.5


def test_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        asyncio.run(VerifierEnv().step("x"))


def test_single_turn_through_the_driver_matches_the_single_turn_path(tokenizer, small_model):
    engine = TorchEngine(small_model, tokenizer)
    samples = [PromptRow(i, p, a) for i, (p, a) in enumerate([("1+2=", "3"), ("10+5=", "15"), ("7+0=", "7")])]
    cfg = MultiTurnConfig(max_turns=3, max_turn_tokens=6, max_total_tokens=50, stop=["\n"])
    trajs = run_rollout(
        engine, [VerifierEnv() for _ in samples], samples, PlainFormat(tokenizer), cfg, seed=3
    )

    # the same batch sampled directly (same seed, same prompts): what loops/grpo.py would train on
    prompts = [tokenizer(s.prompt)["input_ids"] for s in samples]
    direct = engine.generate(prompts, SamplingParams(max_new_tokens=6, stop=("\n",), seed=3))
    for traj, c, s in zip(trajs, direct, samples):
        assert traj.turns == 1 and traj.finish == "done"
        assert traj.tokens == c.token_ids and traj.mask == [1] * len(c.token_ids)
        assert traj.rewards == [exact_match(c.text, s.answer)]
    batch, logprobs = to_batch(trajs, tokenizer.pad_token_id)
    expected = collate(prompts, [c.token_ids for c in direct], tokenizer.pad_token_id)
    assert torch.equal(batch.input_ids, expected.input_ids)
    assert torch.equal(batch.attention_mask, expected.attention_mask)
    assert torch.equal(batch.response_mask, expected.response_mask)
    for row, c in enumerate(direct):
        assert logprobs[row, : len(c.logprobs)].tolist() == pytest.approx(c.logprobs)
