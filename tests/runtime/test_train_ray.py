"""`loopline train` on the ray backend: 2 FSDP2 trainer ranks, 1 engine, 2 env workers on a local Ray, the
rewards from a user's env (env.name=python:FILE:FACTORY) whose episodes must run on the env workers.

The session's one Ray (tests/conftest.py) holds every ray run here. A short run through the real CLI must
finish, write its metrics, move the weights in SFT and in GRPO, and agree with the local backend where the
two must agree: the SFT losses (same data, same initial weights; the ranks each take half of every batch)
and the greedy held-out eval after SFT (which runs on the engine, so the planned weight sync delivered the
trained weights). GRPO samples on the engine's own RNG, so there the check is that the first-step loss is
close, not equal. Every call on a worker group is bounded by runtime.call_timeout_s.

The same ray run is the uninterrupted reference of the exact-resume test: `loopline train` SIGKILLed
inside GRPO (held by the LOOPLINE_PAUSE_AT hook) and resumed with --resume must end bitwise equal to it:
both ranks' policy, optimizer and reference shards, the gathered weights, the engine's sampling generator
and every metrics row. Then that 2-rank checkpoint resumes on the local backend (one rank): the reference
shards are resharded like the policy's, and the run says that it cannot replay the engine's samples. The
killed launch is a process of its own that joins this Ray by address, so its actors die with it.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.dcp import read_full_state
from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy
from tests.numerics import assert_adam_updates_close
from tests.runs import kill_at, steady

SMALL = [
    "sft.steps=4", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=0",
    # a big first step, so that greedy eval after SFT differs from eval of the initial weights
    "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0",
    "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    # zero rewards are likely this early; the entropy bonus and KL still give GRPO a gradient
    "grpo.entropy_coef=0.01", "grpo.kl_coef=0.01", "grpo.eval_every=0",
    "eval.num_prompts=16", "eval.batch_size=16",
    "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1", "seed=3",
    "deterministic=true",  # bitwise: the exact-resume test compares a killed and resumed run with this one
]  # fmt: skip
pytestmark = pytest.mark.slow

RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=2",
    "runtime.call_timeout_s=180",  # actor start-up (a new process importing torch) under a loaded CI
    # the ray ranks and reference forward packed sequences, the local run padded: they still agree (below)
    "model.packing=true",
]  # fmt: skip
FINAL = "grpo-000003"
RUN_TIMEOUT_S = 300


# A user's env (env.name=python:FILE:FACTORY), the built-in task's rule, that leaves a file per episode naming
# the process it ran in (EPISODES is replaced by a directory).
USER_ENV = """
import os, uuid
from pathlib import Path

from loopline.envs.base import StepResult


class Exact:
    async def reset(self, sample):
        self.answer = sample.answer

    async def step(self, action):
        Path("EPISODES", f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        return StepResult("", float(action.split("\\n", 1)[0].strip() == self.answer), True)


def make():
    return Exact()
"""


@pytest.fixture(scope="module")
def user_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(the env.name override of a user's env, the directory its episodes mark)."""
    out = tmp_path_factory.mktemp("user_env")
    (out / "episodes").mkdir()
    (out / "user_env.py").write_text(USER_ENV.replace("EPISODES", str(out / "episodes")))
    return f"env.name=python:{out / 'user_env.py'}:make", out / "episodes"


@pytest.fixture(scope="module")
def runs(
    ray_cluster, user_env: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The same short job on the local and on the ray backend, its rewards from a user's env; the pids its
    episodes ran in, by backend."""
    out = tmp_path_factory.mktemp("train")
    env, episodes = user_env
    pids = {}
    for backend, extra in (("local", []), ("ray", RAY)):
        assert main(["train", f"out_dir={out / backend}", *SMALL, env, *extra]) == 0
        pids[backend] = {int(p.name.split("-")[0]) for p in episodes.iterdir()} - set().union(*pids.values())
        (out / f"{backend}.pids").write_text(" ".join(map(str, sorted(pids[backend]))))
    return {"local": out / "local", "ray": out / "ray"}


def test_the_user_env_ran_on_the_env_workers_of_each_backend(runs: dict[str, Path]) -> None:
    local, ray_ = (
        {int(p) for p in (runs[b].parent / f"{b}.pids").read_text().split()} for b in ("local", "ray")
    )
    assert local and ray_ and not local & ray_  # each run's own env workers: processes, then Ray actors
    assert os.getpid() not in local | ray_  # never the controller
    assert len(ray_) <= 2  # runtime.env_workers=2, none replaced


def _rows(run: Path, phase: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == phase}


def _weights(run: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / name / "model" / "model.safetensors")


def test_ray_run_writes_metrics_and_moves_weights(runs: dict[str, Path]) -> None:
    run = runs["ray"]
    sft, grpo = _rows(run, "sft"), _rows(run, "grpo")
    assert sorted(sft) == [0, 1, 2, 3, 4] and sorted(grpo) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        row = grpo[step]
        for key in ("reward_mean", "loss", "kl", "entropy", "grad_norm", "response_len_mean"):
            assert math.isfinite(row[key]), (step, key)
        assert row["grad_norm"] > 0  # the entropy bonus gives a gradient even with all rewards 0
        # the env pool's counts: no worker died, both env workers kept
        assert (row["score_retries"], row["env_workers_replaced"], row["env_workers"]) == (0, 0, 2)
    assert "eval_accuracy" in grpo[3]
    init = load_policy(load_config(overrides=SMALL).model, seed=3)[0].state_dict()
    after_sft, after_grpo = _weights(run, "sft-000004"), _weights(run, "grpo-000003")
    assert any(not torch.equal(after_sft[k], init[k]) for k in after_sft), "SFT did not move the weights"
    assert any(not torch.equal(after_grpo[k], after_sft[k]) for k in after_sft), (
        "GRPO did not move the weights"
    )


def test_ray_run_agrees_with_the_local_backend(runs: dict[str, Path]) -> None:
    local, ray_ = (_rows(runs[b], "sft") for b in ("local", "ray"))
    for step in (1, 2, 3, 4):
        assert ray_[step]["loss"] == pytest.approx(local[step]["loss"], rel=1e-5), step
        assert ray_[step]["grad_norm"] == pytest.approx(local[step]["grad_norm"], rel=1e-4), step
    # the SFT checkpoints agree: same updates on 2 ranks as on one, by the rule for two orders of summing
    # under AdamW (tests/numerics.py; gradient-free: the runs keep no gradients)
    w_local, w_ray = _weights(runs["local"], "sft-000004"), _weights(runs["ray"], "sft-000004")
    init = load_policy(load_config(overrides=SMALL).model, seed=3)[0].state_dict()
    lrs = [local[step]["lr"] for step in (1, 2, 3, 4)]
    assert_adam_updates_close(
        init, w_local, w_ray, lrs=lrs, betas=load_config(overrides=SMALL).sft.optim.betas
    )
    # greedy eval on the engine after SFT: the weight sync carried the trained weights
    g_local, g_ray = (_rows(runs[b], "grpo") for b in ("local", "ray"))
    assert g_local[0]["eval_response_len"] != local[0]["eval_response_len"]  # SFT changed what eval sees
    assert g_ray[0]["eval_accuracy"] == g_local[0]["eval_accuracy"]
    assert g_ray[0]["eval_response_len"] == g_local[0]["eval_response_len"]
    # GRPO samples differ (each backend's engine has its own RNG), so the first losses are not compared
    # with each other: each is checked against its parts (token means, grpo.loss_agg=token_mean):
    # policy loss + kl_coef * KL - entropy_coef * entropy, with KL 0 (policy = reference before the first
    # update) and a zero policy loss when every reward ties (all advantages 0)
    for first in (g_local[1], g_ray[1]):
        assert first["kl"] == pytest.approx(0.0, abs=1e-6)
        parts = first["policy_loss"] + 0.01 * first["kl"] - 0.01 * first["entropy"]
        assert first["loss"] == pytest.approx(parts, rel=1e-5, abs=1e-8)
        if first["reward_std"] == 0.0:
            assert first["policy_loss"] == 0.0
    assert g_ray[1]["entropy"] == pytest.approx(g_local[1]["entropy"], rel=0.05)


@pytest.mark.heavy
def test_a_killed_ray_run_resumes_bitwise_then_reshards_onto_one_rank(
    runs: dict[str, Path], user_env: tuple[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    run = tmp_path / "run"
    # the killed launch joins this Ray by address, so its actors die with it
    address = ray.get_runtime_context().gcs_address
    cmd = [
        sys.executable,
        "-m",
        "loopline.cli",
        "train",
        *SMALL,
        user_env[0],
        *RAY,
        f"runtime.cluster.address={address}",
    ]
    kill_at([*cmd, f"out_dir={run}"], "step:grpo:3", tmp_path / "markers", RUN_TIMEOUT_S)  # logged, not saved
    assert (run / "checkpoints" / "latest").read_text().strip() == "grpo-000002"
    assert main(["train", "--resume", *SMALL, user_env[0], *RAY, f"out_dir={run}"]) == 0

    a, b = run / "checkpoints" / FINAL, runs["ray"] / "checkpoints" / FINAL
    names = ["model/model.safetensors", "state.json"]
    names += [f"{part}/__{rank}_0.distcp" for part in ("dcp", "reference") for rank in (0, 1)]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    engines = [torch.load(c / "loop.pt", weights_only=False)["engine_rng"] for c in (a, b)]
    assert len(engines[0]) == 1 and torch.equal(engines[0][0], engines[1][0])
    assert steady(read_metrics(run)) == steady(read_metrics(runs["ray"]))
    resumed = read_full_state(a / "dcp")  # the ranks' DCP shards, whole
    assert resumed["scheduler"]["last_epoch"] == 3 and any(k.startswith("state.") for k in resumed["optim"])
    # the resumed step measured KL to the saved reference, not to itself
    assert _rows(run, "grpo")[3]["kl"] > 0

    # the reference the ranks saved is the policy as GRPO started: the weights after SFT
    sft = _weights(run, "sft-000004")
    saved_reference = read_full_state(a / "reference")["model"]
    for name, weights in sft.items():
        assert torch.equal(saved_reference[name], weights), name

    # 2 ranks -> 1: the local backend reshards policy and reference, and cannot replay the engine's samples
    # (--resume starts from the saved config, which is ray: the backend is changed explicitly)
    local = ["runtime.backend=local", "runtime.trainer_ranks=1"]
    with caplog.at_level(logging.WARNING, logger="loopline.loops.grpo"):
        assert main(["train", "--resume", *SMALL, user_env[0], *local, "grpo.steps=4", f"out_dir={run}"]) == 0
    assert "does not replay the uninterrupted one exactly" in caplog.text
    step4 = _rows(run, "grpo")[4]
    assert 0 < step4["kl"] < 1.0
    w3, w4 = _weights(run, FINAL), _weights(run, "grpo-000004")
    step = max(float((w4[k] - w3[k]).abs().max()) for k in w3)
    assert 0 < step < 3e-3  # one AdamW step on from the 2-rank weights (not from a fresh init)
