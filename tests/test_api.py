"""The Python API (loopline.api) as a user calls it: `loopline.train(config, reward_fn=fn)` on the local backend
and on Ray, with a reward function written as a plain function of a .py file. It must run on the env workers
(never in this process), its rewards must be the run's rewards, and the result must name what the run made."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

import loopline
from loopline.cli import main

pytestmark = pytest.mark.slow

TINY = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=2", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=0",
    "data.task.num_train=200", "data.task.num_eval=8", "eval.num_prompts=8", "eval.batch_size=8",
    "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=1", "runtime.engines=1", "runtime.env_workers=2",
    "runtime.call_timeout_s=180",
]  # fmt: skip

# The user's reward function: a distinctive constant (so that the run's reward_mean shows it was used) when it
# got what the contract promises (the prompt, the completion, the row's answer), and a file per call naming the
# process it ran in (CALLS is replaced by a directory).
REWARDS = """
import os, uuid
from pathlib import Path


def reward(prompt: str, completion: str, answer: str, **row) -> float:
    Path("CALLS", f"{os.getpid()}-{uuid.uuid4().hex}").touch()
    return 0.375 if prompt.endswith("=") and answer.isdigit() and isinstance(completion, str) else -1.0
"""


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory):  # -> (the reward function, the directory of its calls)
    out = tmp_path_factory.mktemp("rewards")
    (out / "calls").mkdir()
    path = out / "my_rewards.py"
    path.write_text(REWARDS.replace("CALLS", str(out / "calls")))
    spec = importlib.util.spec_from_file_location("my_rewards", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_rewards"] = module  # as `import my_rewards` would
    spec.loader.exec_module(module)
    yield module.reward, out / "calls"
    del sys.modules["my_rewards"]


def _calls(calls: Path, seen: set[int]) -> set[int]:
    """The pids the reward function ran in since `seen` was taken."""
    return {int(p.name.split("-")[0]) for p in calls.iterdir()} - seen


def _check_train(result: loopline.RunResult, out: Path, rewards_file: str) -> None:
    assert result.command == "train" and result.run_dir == out and not result.interrupted
    assert result.config.env.name == f"python:{rewards_file}:reward"  # recorded: the CLI can resume it
    assert list(result.phases) == ["sft", "grpo"]
    assert result.metrics == result.phases["grpo"] and result.metrics["step"] == 2
    assert result.metrics["reward_mean"] == 0.375 and result.metrics["reward_std"] == 0.0
    grpo_rows = [r for r in result.history if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["reward_mean"] for r in grpo_rows] == [0.375, 0.375]
    # every held-out answer scores 0.375, below full marks (1.0): none is correct, the mean reward says 0.375
    assert result.metrics["eval_accuracy"] == 0.0 and result.phases["sft"]["eval_accuracy"] == 0.0
    assert result.metrics["eval_reward_mean"] == 0.375 and result.phases["sft"]["eval_reward_mean"] == 0.375
    assert [p.name for p in result.checkpoints] == ["sft-000002", "grpo-000002"]
    assert all((p / "dcp").is_dir() for p in result.checkpoints)
    assert result.model is None  # train leaves checkpoints; loopline.export makes the model


@pytest.mark.e2e
def test_train_with_a_reward_function_on_the_local_backend(reward, tmp_path: Path) -> None:
    fn, calls = reward
    seen = _calls(calls, set())
    config = {"out_dir": str(tmp_path / "run"), "seed": 1}  # a dict of sections; TINY on top
    result = loopline.train(config, TINY, reward_fn=fn)
    _check_train(result, tmp_path / "run", fn.__code__.co_filename)
    pids = _calls(calls, seen)
    assert pids and os.getpid() not in pids  # on the env workers (spawned processes), never here

    exported = loopline.export(result.run_dir, tmp_path / "model")
    assert (exported / "config.json").is_file()
    scores = loopline.evaluate(exported, None, ["eval.num_prompts=4"], reward_fn=fn)
    assert scores["eval_reward_mean"] == 0.375 and scores["eval_accuracy"] == 0.0
    (sample,) = loopline.generate(["12+30="], exported, overrides=["eval.sampling.max_new_tokens=4"])
    assert (
        sample.prompt == "12+30="
        and isinstance(sample.completion, str)
        and sample.finish in ("stop", "length")
    )


@pytest.mark.ray
def test_train_with_a_reward_function_on_ray(reward, ray_cluster, tmp_path: Path) -> None:
    fn, calls = reward
    seen = _calls(calls, set())
    config = loopline.RunConfig(out_dir=str(tmp_path / "run"), seed=1)  # the typed config
    result = loopline.train(config, [*TINY, *RAY], reward_fn=fn)
    _check_train(result, tmp_path / "run", fn.__code__.co_filename)
    assert result.config.runtime.backend == "ray"
    pids = _calls(calls, seen)
    assert pids and os.getpid() not in pids and len(pids) <= 2  # the 2 env worker actors


@pytest.mark.e2e
def test_a_lambda_goes_by_value_into_the_run_directory_and_the_cli_resumes_with_it(tmp_path: Path) -> None:
    """As from a notebook: a function the env workers cannot import is pickled (cloudpickle) into out_dir."""
    target = 0.625  # a global of the closure: it travels with the function

    result = loopline.train(
        {"out_dir": str(tmp_path / "run")},
        TINY,
        reward_fn=lambda prompt, completion, answer: target * answer.isdigit(),
    )
    assert result.metrics["reward_mean"] == 0.625
    name = result.config.env.name
    assert name.startswith(f"python:{tmp_path / 'run'}/reward_fn-") and name.endswith(".pkl:reward")
    assert main(["train", "--resume", f"out_dir={tmp_path / 'run'}", "grpo.steps=3"]) == 0
    resumed = loopline.train(
        None, [f"out_dir={tmp_path / 'run'}", "grpo.steps=4"], resume=True
    )  # and the API
    assert resumed.run_dir == tmp_path / "run" and resumed.config.env.name == name
    assert [r["reward_mean"] for r in resumed.history if "reward_mean" in r] == [0.625] * 4
    assert resumed.checkpoints[-1].name == "grpo-000004"
    # evaluate (which writes nothing) takes a lambda too: pickled beside its temporary config
    scores = loopline.evaluate(resumed.run_dir, reward_fn=lambda prompt, completion: 1.0)
    assert scores["eval_accuracy"] == 1.0 and scores["eval_reward_mean"] == 1.0


@pytest.mark.e2e
def test_sft_returns_its_model(tmp_path: Path) -> None:
    result = loopline.sft(None, [*TINY, f"out_dir={tmp_path / 'run'}"])
    assert result.command == "sft" and result.model == tmp_path / "run" / "model"
    assert (result.model / "config.json").is_file()
    assert list(result.phases) == ["sft"] and result.metrics["step"] == 2 and "loss" in result.metrics


PREFERENCE = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "data.task.num_train=100", "data.task.num_eval=8", "eval.num_prompts=8", "preference.num_train=16",
    "progress=false", "tensorboard=false", "threads=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
    "dpo.steps=2", "dpo.batch_size=8", "dpo.micro_batch_size=8", "dpo.eval_every=0",
    "rm.steps=2", "rm.batch_size=8", "rm.micro_batch_size=8", "rm.eval_every=0",
]  # fmt: skip


@pytest.mark.e2e
def test_dpo_and_rm_return_their_models(tmp_path: Path) -> None:
    dpo = loopline.dpo({"out_dir": str(tmp_path / "dpo")}, PREFERENCE)
    assert (
        dpo.command == "dpo"
        and dpo.model == tmp_path / "dpo" / "model"
        and (dpo.model / "config.json").is_file()
    )
    assert (
        list(dpo.phases) == ["sft", "dpo"]
        and dpo.metrics["step"] == 2
        and "eval_logp_accuracy" in dpo.metrics
    )
    rm = loopline.rm({"out_dir": str(tmp_path / "rm")}, PREFERENCE)
    assert rm.command == "rm" and rm.model == tmp_path / "rm" / "reward_model"
    assert list(rm.phases) == ["sft", "rm"] and "eval_pair_accuracy" in rm.metrics


@pytest.mark.e2e
def test_the_typed_config_is_at_hand_after_import_loopline() -> None:
    import subprocess

    code = (
        "import loopline; print(loopline.config.GRPOConfig(steps=3).steps, loopline.RunConfig().grpo.steps)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120
    )
    assert out.returncode == 0 and out.stdout.split() == ["3", str(loopline.RunConfig().grpo.steps)], (
        out.stderr
    )


@pytest.mark.e2e
def test_bad_input_raises_value_error_with_the_cli_message(tmp_path: Path, capsys) -> None:
    bad = [f"out_dir={tmp_path / 'run'}", "grpo.stepz=3"]
    with pytest.raises(ValueError, match="unknown config key 'grpo.stepz'") as raised:
        loopline.train(None, bad)
    assert main(["train", *bad]) == 2
    assert str(raised.value) in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown config key 'sft.stepz'"):
        loopline.sft({"sft": {"stepz": 1}, "out_dir": str(tmp_path / "run")})
    with pytest.raises(
        ValueError, match=r"reward_fn: a function \(prompt, completion, \*\*row_fields\) -> float"
    ):
        loopline.train({"out_dir": str(tmp_path / "run")}, reward_fn=0.5)
    with pytest.raises(ValueError, match="data.train_path: '.*nope.jsonl' does not exist"):
        loopline.train(
            None, [f"out_dir={tmp_path / 'run'}", "data.source=jsonl", "data.train_path=nope.jsonl"]
        )
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing written
