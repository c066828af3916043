"""The multi-turn driver on the real engine: one token sequence per trajectory with an exact mask, the
engine's log-probs equal to the trainer's on the produced batch, turn and token limits, returns,
concurrent env steps, failing envs, and the chat-template format."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from loopline.algorithms.advantages import group_advantages
from loopline.config import GRPOConfig, OptimConfig
from loopline.data.batches import RolloutBatch
from loopline.data.datasets import PromptRow
from loopline.envs.base import StepResult
from loopline.envs.multiturn import (
    ChatFormat,
    MultiTurnConfig,
    PlainFormat,
    demonstrations,
    rollout_metrics,
    run_rollout,
    to_batch,
)
from loopline.envs.tools import Toolbox, ToolEnv, calculator
from loopline.rollout.engine import TorchEngine
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs


class Overlap:
    """Counts env steps in flight at once, across the envs that share it."""

    def __init__(self) -> None:
        self.inside, self.peak = 0, 0


class CountingEnv:
    """Answers every action with '[obs k]'; reward k/10 on turn k; done after `answer` turns."""

    def __init__(self, overlap: Overlap | None = None, fail_on_turn: int = 0) -> None:
        self.overlap, self.fail_on_turn = overlap, fail_on_turn
        self.turn, self.length, self.actions = 0, 0, []

    async def reset(self, sample: PromptRow) -> str:
        self.turn, self.length = 0, int(sample.answer)
        return sample.prompt

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        self.actions.append(action)
        if self.overlap is not None:  # an env that waits (a tool, a sandbox): the others may step meanwhile
            self.overlap.inside += 1
            self.overlap.peak = max(self.overlap.peak, self.overlap.inside)
            await asyncio.sleep(0)
            self.overlap.inside -= 1
        if self.turn == self.fail_on_turn:
            raise RuntimeError("env bug")
        done = self.turn >= self.length
        return StepResult(
            "" if done else f"[obs {self.turn}]", self.turn / 10, done, {"steps": 1, "kind": "count"}
        )


class RecordingEngine(TorchEngine):
    """The real engine, noting how many prompts each generate call batched."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch_sizes: list[int] = []

    def generate(self, prompts, params, n=1):
        self.batch_sizes.append(len(prompts))
        return super().generate(prompts, params, n)


SAMPLES = [
    PromptRow(i, p, str(k))
    for i, (p, k) in enumerate([("go:", 3), ("a longer prompt:", 1), ("x", 2), ("yy", 3)])
]


def _segments(traj):
    """(mask value, tokens) runs of a trajectory's response."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(traj.tokens, traj.mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    return runs


def test_one_sequence_per_trajectory_with_exact_masks_and_trainer_logprobs(tokenizer, small_model):
    engine = RecordingEngine(small_model, tokenizer)
    envs = [CountingEnv() for _ in SAMPLES]
    cfg = MultiTurnConfig(max_turns=5, max_turn_tokens=7, max_total_tokens=200)
    trajs = run_rollout(engine, envs, SAMPLES, PlainFormat(tokenizer), cfg, seed=0)

    # one batched generate per turn over the trajectories still active (lengths 3, 1, 2, 3)
    assert engine.batch_sizes == [4, 3, 2]
    for traj, env, sample in zip(trajs, envs, SAMPLES):
        k = int(sample.answer)
        assert (traj.turns, traj.finish, traj.rewards) == (k, "done", [t / 10 for t in range(1, k + 1)])
        assert traj.prompt_ids == tokenizer(sample.prompt)["input_ids"]
        runs = _segments(traj)
        model_runs = [ids for m, ids in runs if m == 1]
        obs_runs = [ids for m, ids in runs if m == 0]
        # observations are the env's text tokenized; model turns decode to the actions the env saw
        assert obs_runs == [
            tokenizer(f"[obs {t}]", add_special_tokens=False)["input_ids"] for t in range(1, k)
        ]
        assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in model_runs] == env.actions
        assert all(len(ids) <= 7 for ids in model_runs)
        assert [m for m, _ in runs] == [1, 0] * (k - 1) + [1]
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask) if m == 0)
        assert traj.info == {"steps": k, "kind": "count"}

    batch, engine_logprobs = to_batch(trajs, tokenizer.pad_token_id)
    for row, traj in enumerate(trajs):
        n = len(traj.tokens)
        assert batch.input_ids[row, batch.prompt_len : batch.prompt_len + n].tolist() == traj.tokens
        assert batch.response_mask[row].tolist() == traj.mask + [0.0] * (batch.response_mask.shape[1] - n)
        assert batch.attention_mask[row, batch.prompt_len :].sum() == n
    with torch.no_grad():
        trainer_logprobs, _ = response_logprobs(small_model, batch)
    mask = batch.response_mask.bool()
    assert mask.sum() > 40
    torch.testing.assert_close(trainer_logprobs[mask], engine_logprobs[mask], atol=2e-5, rtol=0)


def test_turn_limit_and_token_budgets_end_trajectories(tokenizer, small_model):
    engine = TorchEngine(small_model, tokenizer)
    never_done = [PromptRow(i, "p" * (i + 1), "99") for i in range(3)]

    def go(**limits):
        cfg = MultiTurnConfig(**limits)
        return run_rollout(
            engine, [CountingEnv() for _ in never_done], never_done, PlainFormat(tokenizer), cfg, seed=1
        )

    for traj in go(max_turns=2, max_turn_tokens=5, max_total_tokens=500):
        assert traj.turns == 2 and traj.finish == "max_turns" and len(traj.rewards) == 2
        assert traj.mask[-1] == 1  # the observation after the last turn is not appended
    for traj in go(max_turns=50, max_turn_tokens=4, max_total_tokens=30):
        assert traj.finish == "max_tokens" and len(traj.tokens) <= 30
        assert all(len(ids) <= 4 for m, ids in _segments(traj) if m == 1)
    # a total budget smaller than a turn's: the turn is cut at the budget
    for traj in go(max_turns=50, max_turn_tokens=40, max_total_tokens=10):
        assert traj.turns == 1 and len(traj.tokens) <= 10 and traj.finish == "max_tokens"


def test_returns_are_the_sum_or_the_final_reward(tokenizer, small_model):
    engine = TorchEngine(small_model, tokenizer)
    (traj,) = run_rollout(
        engine,
        [CountingEnv()],
        [PromptRow(0, "q", "3")],
        PlainFormat(tokenizer),
        MultiTurnConfig(max_turn_tokens=3),
    )
    assert traj.total_return("sum") == pytest.approx(0.6)
    assert traj.total_return("final") == pytest.approx(0.3)
    metrics = rollout_metrics([traj], "final")
    assert (
        metrics["return_mean"] == pytest.approx(0.3) and metrics["turns_mean"] == 3 and metrics["steps"] == 3
    )
    assert metrics["finish_done"] == 1.0 and "kind" not in metrics


def test_env_steps_run_concurrently_and_a_failing_env_ends_only_its_trajectory(tokenizer, small_model):
    engine = TorchEngine(small_model, tokenizer)
    samples = [PromptRow(i, "q", "2") for i in range(6)]
    overlap = Overlap()
    envs = [CountingEnv(overlap, fail_on_turn=2 if i == 1 else 0) for i in range(6)]
    trajs = run_rollout(engine, envs, samples, PlainFormat(tokenizer), MultiTurnConfig(max_turn_tokens=2))
    # every env's step was in flight while it waited: all 6 at once (one after another would give 1)
    assert overlap.peak == 6
    assert [t.finish for t in trajs] == ["done", "env_error", "done", "done", "done", "done"]
    assert trajs[1].rewards == [0.1, 0.0] and trajs[1].info["env_error"] == 1


def test_one_env_per_sample():
    with pytest.raises(ValueError, match="one env per trajectory"):
        run_rollout(None, [CountingEnv()], SAMPLES, None, MultiTurnConfig())  # type: ignore[arg-type]


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_chat_format_builds_what_the_template_renders(chat_tokenizer, ended_with_eos):
    fmt = ChatFormat(chat_tokenizer, system="sys")
    tok = chat_tokenizer

    def render(messages, gen):
        return tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)

    user = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert fmt.prompt_ids("hi") == render(user, True)
    model_turn = tok("call", add_special_tokens=False)["input_ids"] + (
        [tok.eos_token_id] if ended_with_eos else []
    )
    ids = fmt.prompt_ids("hi") + model_turn + fmt.observation_ids("result", model_turn)
    full = [*user, {"role": "assistant", "content": "call"}, {"role": "tool", "content": "result"}]
    assert ids == render(full, True)
    assert fmt.action_text(model_turn) == "call"


def test_chat_format_needs_a_template(tokenizer):
    with pytest.raises(ValueError, match="chat template"):
        ChatFormat(tokenizer)


def test_scripted_trajectory_masks_tool_results(tokenizer):
    env = ToolEnv(Toolbox([calculator]), lambda text, answer: float(answer in text))
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"6*7"}}</tool_call>'
    (traj,) = demonstrations(
        [env],
        [PromptRow(0, "6*7?", "42")],
        [[call, "<answer>42</answer>"]],
        PlainFormat(tokenizer),
        tokenizer,
    )
    runs = _segments(traj)
    assert [tokenizer.decode(ids) for _, ids in runs] == [
        call,
        "<tool_result>42</tool_result>",
        "<answer>42</answer>",
    ]
    assert [m for m, _ in runs] == [1, 0, 1]
    assert traj.rewards == [0.0, 1.0] and traj.finish == "done" and traj.info["tool_calls_ok"] == 1


def test_policy_step_trains_on_the_multi_turn_batch(tokenizer, small_model):
    """The driver's batch, with the engine's log-probs as the behaviour policy's, trains with policy_step."""
    engine = TorchEngine(copy.deepcopy(small_model), tokenizer)
    samples = [PromptRow(i // 4, "q", str(1 + i % 3)) for i in range(8)]  # 2 groups of 4, 1-3 turns each
    trajs = run_rollout(
        engine,
        [CountingEnv() for _ in samples],
        samples,
        PlainFormat(tokenizer),
        MultiTurnConfig(max_turn_tokens=4),
    )
    tokens, engine_logprobs = to_batch(trajs, tokenizer.pad_token_id)
    rewards = torch.tensor([t.total_return() for t in trajs])
    assert rewards.unique().numel() == 3  # returns 0.1, 0.3, 0.6 by episode length
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask, old_logprobs=engine_logprobs,
        ref_logprobs=None, advantages=group_advantages(rewards, 4), rewards=rewards,
    )  # fmt: skip
    before = {k: v.clone() for k, v in small_model.state_dict().items()}
    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    trainer = PolicyTrainer(small_model, optim, 1, loss=grpo_loss(GRPOConfig()), micro_batch_size=3)
    stats = trainer.policy_step(batch, kl_coef=0.0)
    # the behaviour log-probs came from the engine: the first update is on-policy (no clipping)
    assert stats.extra["clip_fraction"] == 0.0 and abs(stats.extra["approx_kl"]) < 1e-5
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
    assert any(not torch.equal(before[k], v) for k, v in small_model.state_dict().items())
