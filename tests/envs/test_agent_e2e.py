"""The agentic example: the calculator task's data and demonstrations, then `loopline agent` (loops.agent.main)
end to end on a tiny budget: weights change, metrics are written, the checkpoint loads."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.config import ModelConfig, TinyModelConfig
from loopline.data.datasets import PromptRow
from loopline.envs.multiturn import PlainFormat, scripted
from loopline.envs.tasks import ToolTaskConfig, answer_match, calculator_splits, demonstration, make_env
from loopline.loops.agent import AgentConfig, load_agent_config, main
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy


def test_problems_are_fixed_length_disjoint_and_reproducible():
    cfg = ToolTaskConfig(num_train=300, num_eval=20)
    train, held_out = calculator_splits(cfg, seed=0)
    assert (len(train), len(held_out)) == (300, 20)
    assert calculator_splits(cfg, seed=0) == (train, held_out)
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    for row in train + held_out:
        a, rest = row.completion.split("*")
        b, c = rest.split("+")
        assert int(row.answer) == int(a) * int(b) + int(c)
        assert (
            len(row.completion) == 7 and len(row.answer) == 4 and row.prompt == f"What is {row.completion}?\n"
        )
    with pytest.raises(ValueError, match="distinct problems"):
        ToolTaskConfig(min_operand=10, max_operand=12, num_train=100)


def test_answer_match():
    assert answer_match("<answer> 5573 </answer>", "5573") == 1.0
    assert answer_match("5573", "5573") == 0.0
    assert answer_match("<answer>5572</answer><answer>5573</answer>", "5573") == 0.0


@pytest.mark.parametrize("use_tool", [True, False])
def test_demonstrations_earn_full_reward_through_the_real_env(tokenizer, use_tool):
    row = PromptRow(0, "What is 87*64+5?\n", "5573", completion="87*64+5")
    traj = asyncio.run(
        scripted(make_env(), row, demonstration(row, use_tool), PlainFormat(tokenizer), tokenizer)
    )
    assert traj.total_return() == 1.0 and traj.finish == "done"
    assert traj.info.get("tool_calls_ok", 0) == (1 if use_tool else 0)
    assert ("<tool_result>5573</tool_result>" in tokenizer.decode(traj.tokens)) == use_tool


def test_config_errors_name_the_key(capsys):
    assert main(["grpo.sampling.temperature=0.5", "progress=false"]) == 2
    assert "grpo.sampling is not used" in capsys.readouterr().err
    assert main(["rollout.max_turns=0"]) == 2
    assert "rollout.max_turns" in capsys.readouterr().err
    assert load_agent_config(None, ["grpo.steps=3"]).grpo.steps == 3


TINY_MODEL = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=2"]
# Enough SFT (60 steps at lr 1e-2) that the model writes the tool-call template (~75 bytes, so turns of 96
# tokens), and a format reward for a call that succeeds: some episodes call right and some do not, so the GRPO
# groups have reward variance and the steps really update (measured: reward_mean 0.44, validity 0.88).
TINY = [
    *TINY_MODEL, "sft.steps=60", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.optim.lr=1e-2",
    "sft.optim.warmup_steps=0", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=0", "rollout.max_turn_tokens=96", "rollout.max_total_tokens=192",
    "task.call_bonus=0.5", "task.num_train=200", "task.num_eval=8", "eval_prompts=4", "progress=false",
    "threads=1",
]  # fmt: skip
GRPO_KEYS = {
    "reward_mean", "accuracy", "tool_use_rate", "tool_call_validity", "turns_mean", "return_mean", "finish_done",
    "update_skipped", "logprob_gap_max", "time_rollout", "time_train",
}  # fmt: skip
UPDATE_KEYS = {"loss", "policy_loss", "entropy", "clip_fraction", "grad_norm", "lr"}  # when a step trained
EVAL_KEYS = {"eval_accuracy", "eval_tool_use_rate", "eval_tool_call_validity", "eval_turns_mean"}


@pytest.mark.slow
def test_agent_command_trains_and_logs(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, f"out_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "before_sft" in printed and "after_rl" in printed and "tool_use_rate" in printed

    rows = read_metrics(out)
    sft = [r for r in rows if r["phase"] == "sft" and "loss" in r]
    grpo = [r for r in rows if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["step"] for r in sft] == list(range(1, 61)) and [r["step"] for r in grpo] == [1, 2]
    for r in grpo:
        assert r.keys() >= GRPO_KEYS
        # a batch with no reward signal (all advantages 0) skips its update and says so
        assert (r.keys() >= UPDATE_KEYS) == (r["update_skipped"] == 0.0)
        assert 0.0 <= r["tool_call_validity"] <= 1.0 and 0.0 <= r["tool_use_rate"] <= 1.0
        # engine and trainer agree on the sampled tokens, at the rollout temperature (0.7 by default)
        assert r["logprob_gap_max"] < 1e-3
    # the steps had a reward signal and trained on it (not skipped)
    assert any(r["update_skipped"] == 0.0 and r["grad_norm"] > 0 for r in grpo), grpo
    assert any(r["reward_mean"] > 0.0 for r in grpo) and all(r["tool_call_validity"] > 0 for r in grpo)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [(r["phase"], r["step"]) for r in evals] == [("sft", 0), ("grpo", 0), ("grpo", 2)]
    assert all(r.keys() >= EVAL_KEYS for r in evals)

    # the saved policy differs from the initial one in every parameter tensor that had gradient
    tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)
    initial, _ = load_policy(ModelConfig(tiny=tiny), seed=AgentConfig().seed)
    saved = load_file(str(out / "checkpoints" / "grpo-000002" / "model" / "model.safetensors"))
    changed = [
        name for name, p in initial.state_dict().items() if name in saved and not torch.equal(p, saved[name])
    ]
    assert len(changed) >= len(saved) - 1, sorted(set(saved) - set(changed))

    # and GRPO moved them on from where SFT left them: the same job with no GRPO step ends at the SFT weights
    sft_only = tmp_path / "sft_only"
    assert main([*TINY, "grpo.steps=0", f"out_dir={sft_only}"]) == 0
    after_sft = load_file(str(sft_only / "checkpoints" / "grpo-000000" / "model" / "model.safetensors"))
    moved = [name for name in saved if not torch.equal(after_sft[name], saved[name])]
    assert len(moved) >= len(saved) // 2, sorted(set(saved) - set(moved))

    # the one checkpoint writer's layout: every trainer rank's shards, no trainer.pt of the agent's own
    assert (out / "checkpoints" / "grpo-000002" / "dcp" / ".metadata").is_file()
    assert not (out / "checkpoints" / "grpo-000002" / "trainer.pt").exists()


def test_agent_config_checks_the_roles_config(capsys):
    # the roles' own checks (runtime.*) run at load, naming the field
    assert main([*TINY, "runtime.backend=ray", "runtime.trainer_ranks=3"]) == 2
    assert "runtime.trainer_ranks" in capsys.readouterr().err


@pytest.mark.slow
def test_agent_runs_on_ray(ray_cluster, tmp_path):
    """`loopline agent runtime.backend=ray`: 2 FSDP2 trainer ranks, 1 engine, KL to the reference role's ranks;
    the env steps stay in this process."""
    out = tmp_path / "ray"
    ray = [
        "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
        "runtime.call_timeout_s=180", "grpo.kl_coef=0.05",
    ]  # fmt: skip
    assert main([*TINY, *ray, f"out_dir={out}"]) == 0
    rows = read_metrics(out)
    grpo = [r for r in rows if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["step"] for r in grpo] == [1, 2] and all(r.keys() >= GRPO_KEYS for r in grpo)
    # the engine (its own process) and the trainer ranks agree on the sampled tokens' log-probs
    assert all(r["logprob_gap_max"] < 1e-3 for r in grpo)
    assert any(r["update_skipped"] == 0.0 and r["grad_norm"] > 0 and "kl" in r for r in grpo), grpo
    final = out / "checkpoints" / "grpo-000002"
    assert (final / "dcp" / ".metadata").is_file() and not (final / "trainer.pt").exists()
    saved = load_file(str(final / "model" / "model.safetensors"))
    tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2)
    initial, _ = load_policy(ModelConfig(tiny=tiny), seed=AgentConfig().seed)
    assert any(not torch.equal(p, saved[n]) for n, p in initial.state_dict().items() if n in saved)
