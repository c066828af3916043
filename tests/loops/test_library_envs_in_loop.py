"""`loopline train` on environments of the libraries users already have (env.name=verifiers:..., openenv:...): the
env's own rows, its rubric's or its observations' rewards in the metrics (hand-checked), its turns as the library
runs them, its episodes on the env workers (processes of their own locally, Ray actors on ray), never in the
controller."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest

from loopline.cli import main
from loopline.metrics.logger import read_metrics
from tests.conftest import need_module

need_module("verifiers", "the envs extra (pip install 'loopline[envs]')")
need_module("openenv.core.env_server.interfaces", "the envs extra (pip install 'loopline[envs]')")
pytestmark = pytest.mark.slow

ARGS = [
    "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.eval_every=0",
    "grpo.sampling.max_new_tokens=8", "eval.num_prompts=4", "eval.sampling.max_new_tokens=8",
    "progress=false", "tensorboard=false", "threads=1", "seed=0", "checkpoint_every=0",
]  # fmt: skip
SFT = [
    "sft.steps=8", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0",
]  # fmt: skip

# A verifiers SingleTurnEnv of sevens: exact (weight 1) and a constant metric `marked` (weight 0.25) that leaves a
# file per scored episode naming the process it ran in.
VERIFIERS = '''
import os
import uuid
from pathlib import Path

import verifiers as vf
from datasets import Dataset


def exact(completion, answer, **kwargs):
    return 1.0 if (completion[-1].content or "").strip().split("\\n")[0] == answer else 0.0


def marked(completion, **kwargs):
    Path("EPISODES", f"{os.getpid()}-{uuid.uuid4().hex}").touch()
    return 1.0


def load_environment():
    rows = [{"question": f"q{i}:", "answer": "7"} for i in range(40)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact, marked], weights=[1.0, 0.25]))


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return {"a": "7"}.get(key, "unknown")


def tools():
    rows = [{"question": f"What is a? ({i})", "answer": "7"} for i in range(16)]
    return vf.ToolEnv(tools=[lookup], max_turns=3, dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact]))
'''

# An OpenEnv echo: the first message earns 0.25 and is echoed back, the second 0.5 and ends it (max_reward 0.75:
# an episode of both turns is correct). Each step leaves a file naming its process.
OPENENV = """
import os
import uuid
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str


class Echo(Environment[EchoAction, EchoObservation, State]):
    max_reward = 0.75

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(step_count=0)
        return EchoObservation(echoed=f"say something ({seed})")

    def step(self, action: EchoAction, timeout_s=None, **kwargs):
        Path("EPISODES", f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        self._state.step_count += 1
        last = self._state.step_count == 2
        return EchoObservation(echoed=action.message[-8:], done=last, reward=0.5 if last else 0.25)

    @property
    def state(self):
        return self._state
"""


@pytest.fixture
def envs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the verifiers file, the OpenEnv file, the directory their episodes mark)."""
    episodes = tmp_path / "episodes"
    episodes.mkdir()
    # written into the files: Ray's actors do not inherit this process's environment
    (tmp_path / "vf_sevens.py").write_text(VERIFIERS.replace("EPISODES", str(episodes)))
    (tmp_path / "oe_echo.py").write_text(OPENENV.replace("EPISODES", str(episodes)))
    return tmp_path / "vf_sevens.py", tmp_path / "oe_echo.py", episodes


def _grpo(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}


def _worker_pids(episodes: Path) -> set[int]:
    return {int(p.name.split("-")[0]) for p in episodes.iterdir()}


def test_a_verifiers_env_trains_on_its_rows_scored_by_its_rubric(
    tmp_path: Path, envs: tuple[Path, Path, Path]
) -> None:
    run = tmp_path / "run"
    assert main(["train", *ARGS, *SFT, f"env.name=verifiers:{envs[0]}", f"out_dir={run}"]) == 0
    rows = _grpo(run)
    for step in (1, 2):
        # reward = exact + 0.25 (marked): correct (>= the pass threshold, 0.5) exactly when exact
        assert rows[step]["reward_mean"] == pytest.approx(0.25 + rows[step]["accuracy"], rel=1e-6)
    assert rows[0]["eval_reward_mean"] == pytest.approx(0.25 + rows[0]["eval_accuracy"], rel=1e-6)
    assert (
        len(list(envs[2].iterdir())) >= 2 * 16 + 4
    )  # every rollout and held-out episode scored by the rubric
    assert os.getpid() not in _worker_pids(envs[2])  # on the env workers


def test_a_verifiers_tool_env_trains_multi_turn_with_its_turns(
    tmp_path: Path, envs: tuple[Path, Path, Path]
) -> None:
    run = tmp_path / "run"
    name = f"verifiers:{envs[0]}:tools"
    assert main(["train", *ARGS, "sft.steps=0", f"env.name={name}", "env.max_turns=3", f"out_dir={run}"]) == 0
    rows = [r for r in _grpo(run).values() if "episode_turns_mean" in r]
    assert len(rows) == 2  # the two steps' rollouts
    for row in rows:
        # 3 turns of 8 tokens and their observations fit env.max_episode_tokens: verifiers ends every episode
        # (no tool call, or its max_turns), and counts the turns loopline ran
        assert row["episode_finish_done"] == 1.0
        assert row["episode_vf_num_turns"] == pytest.approx(row["episode_turns_mean"])
        assert row["reward_mean"] == pytest.approx(row["episode_vf_exact"])
        assert 1 <= row["episode_turns_mean"] <= 3


def _echo_rows_agree(run: Path) -> None:
    rows = _grpo(run)
    for step in (1, 2):
        row = rows[step]
        # every episode: 0.25, then 0.5 and done (two model turns): its return 0.75, the class's max_reward
        assert (row["reward_mean"], row["reward_std"], row["accuracy"]) == (0.75, 0.0, 1.0)
        assert (row["episode_turns_mean"], row["episode_finish_done"]) == (2.0, 1.0)
    assert rows[0]["eval_accuracy"] == 1.0


def test_an_openenv_env_trains_multi_turn_with_its_rewards(
    tmp_path: Path, envs: tuple[Path, Path, Path]
) -> None:
    run = tmp_path / "run"
    args = [
        f"env.name=openenv:{envs[1]}",
        "env.max_turns=3",
        "env.openenv.num_train=16",
        "env.openenv.num_eval=4",
    ]
    assert main(["train", *ARGS, "sft.steps=0", *args, f"out_dir={run}"]) == 0
    _echo_rows_agree(run)
    assert os.getpid() not in _worker_pids(envs[2])


def test_an_openenv_env_trains_on_the_ray_backend(
    ray_cluster, tmp_path: Path, envs: tuple[Path, Path, Path]
) -> None:
    run = tmp_path / "run"
    args = [
        f"env.name=openenv:{envs[1]}",
        "env.max_turns=3",
        "env.openenv.num_train=16",
        "env.openenv.num_eval=4",
    ]
    ray = ["runtime.backend=ray", "runtime.env_workers=2", "runtime.call_timeout_s=180"]
    assert main(["train", *ARGS, "sft.steps=0", *args, *ray, f"out_dir={run}"]) == 0
    _echo_rows_agree(run)
    assert os.getpid() not in _worker_pids(envs[2])  # stepped on the env pool's actors
