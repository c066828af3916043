"""Multi-turn envs in the one RL loop (`loopline train`, env.max_turns > 1), on both backends.

The envs step on the env workers, which replay each episode's history (envs.episodes): a user's env records the
process of every step, so the tests see that no step ran in the controller. A SIGKILLed env worker in the middle
of a step's rollout costs a retry of its chunk, not the step. The calculator (the agentic task) trains through
`loopline agent`, which is `loopline train env.name=calculator` with the example's settings; its SFT batches
are demonstrations run through the real env, the tool results masked.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.checkpoint.state import RunState
from loopline.cli import main
from loopline.config import load_config
from loopline.loops.context import build_context, sync_engine
from loopline.loops.grpo import model_mask, train_grpo
from loopline.loops.sft import sft_batch, train_sft
from loopline.metrics.logger import read_metrics
from tests.runs import KillBeforeCall

# A user's multi-turn env: every action is answered 'ok', three turns, reward 1 on the last turn when it holds
# the answer. Each step touches a file named by the process it ran in; the first time any episode reaches its
# second turn, the env SIGKILLs its own worker (mid-chunk, mid-rollout).
THREE_TURNS = """
import os
import signal
from pathlib import Path

from loopline.envs.base import StepResult


class ThreeTurns:
    async def reset(self, sample):
        self.answer, self.turn = sample.answer, 0
        return sample.prompt

    async def step(self, action):
        self.turn += 1
        Path("STEPS", str(os.getpid())).touch()
        if self.turn == 2:
            try:  # one process wins the file, whichever workers get here at once
                fd = os.open(Path("STEPS", "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        done = self.turn == 3
        reward = float(done and self.answer[:1] in action)
        return StepResult(observation="" if done else " ok ", reward=reward, done=done, info={"steps": 1})


def make():
    return ThreeTurns()
"""

SMALL = [
    "sft.steps=0", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=8",
    "grpo.eval_every=0", "grpo.sampling.max_new_tokens=6", "env.max_turns=4", "env.max_episode_tokens=40",
    "data.task.num_train=16", "data.task.num_eval=4", "eval.num_prompts=4", "eval.sampling.max_new_tokens=6",
    "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1", "runtime.call_timeout_s=180",
]  # fmt: skip


@pytest.fixture
def three_turns(tmp_path: Path) -> tuple[str, Path]:
    steps = tmp_path / "steps"
    steps.mkdir()
    (tmp_path / "three_turns.py").write_text(THREE_TURNS.replace("STEPS", str(steps)))
    return f"env.name=python:{tmp_path / 'three_turns.py'}:make", steps


def _assert_each_step_trained_once(run: Path, steps: int, size: int) -> list[dict]:
    rows = [r for r in read_metrics(run) if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    ledger = [r for r in read_ledger(run) if r["phase"] == "grpo"]
    assert [r["step"] for r in ledger] == list(range(1, steps + 1)) and not repeats(ledger)
    assert all(len(r["samples"]) == size for r in ledger)
    return rows


@pytest.mark.slow
def test_episodes_step_on_env_workers_and_a_killed_worker_costs_a_retry(
    three_turns: tuple[str, Path], tmp_path: Path
) -> None:
    env, steps = three_turns
    cfg = load_config(overrides=[*SMALL, "runtime.env_workers=2", env, f"out_dir={tmp_path / 'run'}"])
    ctx = build_context(cfg)
    try:
        ctx.logger.clear()
        sync_engine(ctx, version=0)
        state = train_grpo(ctx, RunState(phase="grpo", step=0), None)
        workers = {w.pid for w in ctx.scorer.pool.workers()}
    finally:
        ctx.close()
    assert state.step == 2
    rows = _assert_each_step_trained_once(ctx.run_dir, steps=2, size=8)
    # the killed worker's chunk ran again on another (or its replacement): a retry, not a lost step
    assert rows[0]["score_retries"] >= 1 and rows[0]["env_workers_replaced"] == 1
    assert all(r["env_workers"] == 2 for r in rows)
    # every episode ran its three turns (the env ends it)
    assert all(r["episode_turns_mean"] == 3 and r["episode_finish_done"] == 1 for r in rows)
    # the env stepped in worker processes only: the killed one, the live ones, never this one
    killed = int((steps / "killed").read_text())
    ran = {int(p.name) for p in steps.iterdir() if p.name != "killed"}
    assert os.getpid() not in ran and killed in ran and ran - {killed} <= workers


@pytest.mark.slow
def test_the_calculator_on_ray_sft_on_tool_traces_then_grpo_through_a_killed_env_worker(
    ray_cluster, tmp_path: Path
) -> None:
    """env.name=calculator on 2 FSDP2 trainer ranks, 1 engine and 2 env worker actors: SFT's demonstrations and
    GRPO's episodes step on the actors; one is SIGKILLed between the turns of step 1's rollout, and the run goes
    on with a replacement (the chunk it would have taken is sent to another)."""
    cfg = load_config(
        overrides=[
            "env.name=calculator", "env.calculator.num_train=64", "env.calculator.num_eval=4",
            "env.calculator.num_val=4", "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=4",
            "sft.stop_at_accuracy=null", "eval.num_prompts=4", "eval.sampling.max_new_tokens=8",
            "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4",
            "grpo.eval_every=0", "grpo.sampling.max_new_tokens=8", "grpo.sampling.stop=[]",
            "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1",
            "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=2",
            "runtime.call_timeout_s=180", f"out_dir={tmp_path / 'run'}",
        ]
    )  # fmt: skip
    ctx = build_context(cfg)
    try:
        ctx.logger.clear()
        sft = train_sft(ctx, RunState(phase="sft", step=0))
        assert sft.step == 2
        ctx.scorer = KillBeforeCall(ctx.scorer, n=2)  # step 1: reset, then the kill before turn 1's step
        sync_engine(ctx, version=0)
        state = train_grpo(ctx, RunState(phase="grpo", step=0), None)
        workers_now = ctx.scorer.pool.num_workers
    finally:
        ctx.close()
    assert state.step == 2 and workers_now == 2
    rows = _assert_each_step_trained_once(ctx.run_dir, steps=2, size=8)
    assert sum(r["env_workers_replaced"] for r in rows) == 1
    assert all(r["episode_finish_env_error"] == 0 for r in rows)
    assert [r["step"] for r in read_metrics(ctx.run_dir) if r["phase"] == "sft" and "loss" in r] == [1, 2]


def test_model_mask_trains_the_model_turns_only() -> None:
    response = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])  # (B, C) from collate
    masks = [[1, 1, 0, 0, 1], [1, 0, 1]]  # model turn, observation, model turn
    assert model_mask(masks, response).tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]]


@pytest.mark.slow
def test_a_resumed_multi_turn_run_replays_the_uninterrupted_one(
    three_turns: tuple[str, Path], tmp_path: Path
) -> None:
    env, _ = three_turns
    args = ["train", *SMALL, env, "grpo.sampling.temperature=1.0"]
    assert main([*args, f"out_dir={tmp_path / 'straight'}"]) == 0
    assert main([*args, "grpo.steps=1", f"out_dir={tmp_path / 'cut'}"]) == 0
    assert main(["train", "--resume", "grpo.steps=2", f"out_dir={tmp_path / 'cut'}"]) == 0

    def step2(run: Path) -> dict:
        (row,) = [r for r in read_metrics(run) if r["phase"] == "grpo" and r.get("step") == 2 and "loss" in r]
        return {k: v for k, v in row.items() if not k.startswith("time_") and not k.endswith("_per_s")}

    assert step2(tmp_path / "straight") == step2(tmp_path / "cut")
    weights = [load_file(str(tmp_path / r / "checkpoints" / "grpo-000002" / "model" / "model.safetensors"))
               for r in ("straight", "cut")]  # fmt: skip
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_calculator_sft_batches_are_tool_traces_with_the_results_masked(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            "env.name=calculator", "env.calculator.num_train=40", "env.calculator.num_eval=4",
            "env.calculator.num_val=4", f"out_dir={tmp_path}", "progress=false", "tensorboard=false",
        ]
    )  # fmt: skip
    ctx = build_context(cfg)
    try:
        rows = ctx.train_rows[:4]
        batch = sft_batch(ctx, rows, step=1)
    finally:
        ctx.close()
    tok = ctx.tokenizer
    width = batch.response_mask.shape[1]
    for i, row in enumerate(rows):
        response = batch.input_ids[i, -width:]
        trained = tok.decode(response[batch.response_mask[i] == 1].tolist())
        assert trained == (
            f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{row.completion}"}}}}</tool_call>'
            f"<answer>{row.answer}</answer>"
        )
        masked = tok.decode(
            response[(batch.response_mask[i] == 0) & (batch.attention_mask[i, -width:] == 1)].tolist()
        )
        assert masked == f"<tool_result>{row.answer}</tool_result>"  # the real tool's result, not trained


# Enough SFT (60 steps at lr 1e-2) that the model writes the tool-call template (~75 bytes, so turns of 96
# tokens), and a format reward for a call that succeeds: some episodes call right and some do not, so the GRPO
# groups have reward variance and the steps really update.
TINY_MODEL = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_layers=2"]
TINY = [
    *TINY_MODEL, "sft.steps=60", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.optim.lr=1e-2",
    "sft.optim.warmup_steps=0", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=0", "env.calculator.call_bonus=0.5", "env.calculator.num_train=200",
    "env.calculator.num_eval=8", "env.calculator.num_val=8", "eval.num_prompts=4", "progress=false",
    "tensorboard=false",
]  # fmt: skip


@pytest.mark.slow
def test_loopline_agent_is_train_with_the_calculator_and_learns_the_tool_call(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["agent", *TINY, f"out_dir={out}"]) == 0
    rows = read_metrics(out)
    sft = [r for r in rows if r["phase"] == "sft" and "loss" in r]
    grpo = [r for r in rows if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["step"] for r in sft] == list(range(1, 61)) and [r["step"] for r in grpo] == [1, 2]
    # after SFT the model calls the tool (a second turn reads its result), and GRPO has a signal to train on
    assert all(r["episode_tool_calls"] > 0 and r["episode_turns_mean"] > 1 for r in grpo), grpo
    assert any(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in grpo), grpo
    evals = [r for r in rows if "eval_accuracy" in r]
    assert {"eval_turns_mean", "eval_tool_calls_ok", "eval_finish_done"} <= evals[-1].keys()
    # the config the run saved is the calculator's, with the example's settings under the words given
    saved = load_config(out / "config.yaml")
    assert saved.env.name == "calculator" and saved.env.turns == 3 and saved.grpo.sampling.temperature == 0.7
    assert saved.sft.steps == 60 and saved.out_dir == str(out)
    # a config file is not what `agent` takes: it says what to run instead
    assert main(["agent", str(out / "config.yaml")]) == 2
    assert "loopline train" in capsys.readouterr().err
