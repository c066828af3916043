"""Exact resume of the RL state beyond the policy: the frozen reference, the adaptive KL controller and PPO's
critic. A `loopline train` process is SIGKILLed inside GRPO (held there by the LOOPLINE_PAUSE_AT hook) and
resumed with --resume; it must end bitwise equal to the same run never interrupted: policy weights and
optimizer shards, reference shards, critic weights and optimizer, KL coefficient, and every metrics row.

Deterministic mode on CPU, one thread. The killed launch is a real process; the uninterrupted run and the
resume run in this process (cheaper: torch and transformers are imported once).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loopline.cli import main
from loopline.metrics.logger import read_metrics
from tests.runs import kill_at, steady

pytestmark = pytest.mark.slow

BASE = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=16",
    "grpo.eval_every=0", "grpo.entropy_coef=0.01", "grpo.optim.lr=1e-3", "grpo.optim.warmup_steps=0",
    "data.task.num_train=12", "data.task.num_eval=4", "eval.num_prompts=4", "checkpoint_every=2",
    "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
]  # fmt: skip
# (a) GRPO with KL to the frozen reference in the loss, its coefficient steered by the adaptive controller
ADAPTIVE_KL = [
    "grpo.kl_coef=0.05", "grpo.kl_controller=adaptive", "grpo.kl_target=0.001", "grpo.kl_horizon=16",
]  # fmt: skip
# (b) PPO: a critic and GAE, two epochs of two shuffled minibatches per step, KL as a reward penalty
PPO = [
    "grpo.advantage=gae", "grpo.epochs_per_step=2", "grpo.minibatches=2", "grpo.kl_coef=0.05",
    "grpo.kl_in=reward", "critic.optim.lr=1e-3", "critic.optim.warmup_steps=0",
]  # fmt: skip
FINAL = "grpo-000004"
RUN_TIMEOUT_S = 180


@pytest.fixture(autouse=True)
def _restore_determinism() -> Iterator[None]:
    """The runs in this process switch deterministic algorithms on; leave the flag as it was."""
    saved = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(saved)


def _assert_same_state(a: Path, b: Path) -> None:
    """Every byte of the final checkpoint's weights and shards, and the loop state's tensors, equal."""
    ca, cb = a / "checkpoints" / FINAL, b / "checkpoints" / FINAL
    for name in ("model/model.safetensors", "dcp/__0_0.distcp", "reference/__0_0.distcp", "state.json"):
        assert (ca / name).read_bytes() == (cb / name).read_bytes(), name
    la, lb = (torch.load(c / "loop.pt", weights_only=False) for c in (ca, cb))
    assert la["kl"] == lb["kl"]
    if "critic" in la:
        for part in ("model", "scheduler"):
            assert la["critic"][part].keys() == lb["critic"][part].keys()
        for k, v in la["critic"]["model"].items():
            assert torch.equal(v, lb["critic"]["model"][k]), k
        sa, sb = la["critic"]["optimizer"]["state"], lb["critic"]["optimizer"]["state"]
        assert sa.keys() == sb.keys() and len(sa) > 0
        for i in sa:
            for k in sa[i]:
                assert torch.equal(sa[i][k], sb[i][k]), (i, k)
    assert steady(read_metrics(a)) == steady(read_metrics(b))


def _resumed_equals_uninterrupted(tmp_path: Path, args: list[str], kill_point: str) -> dict[int, dict]:
    reference = tmp_path / "reference"
    assert main(["train", *args, f"out_dir={reference}"]) == 0
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "loopline.cli", "train", *args, f"out_dir={run}"]
    kill_at(cmd, kill_point, run.parent / f"markers-{run.name}", RUN_TIMEOUT_S)
    assert (run / "checkpoints" / "latest").read_text().strip() == "grpo-000002"
    assert main(["train", "--resume", *args, f"out_dir={run}"]) == 0
    _assert_same_state(run, reference)
    # later checkpoints link the reference's files instead of writing them again
    first, last = (run / "checkpoints" / n / "reference" / "__0_0.distcp" for n in ("grpo-000002", FINAL))
    assert last.stat().st_nlink > 1 and first.stat().st_ino == last.stat().st_ino
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}


def test_grpo_with_adaptive_kl_resumes_exactly(tmp_path: Path) -> None:
    # killed with step 3 logged but not checkpointed: the resume redoes step 3 from grpo-000002
    rows = _resumed_equals_uninterrupted(tmp_path, [*BASE, *ADAPTIVE_KL], "step:grpo:3")
    # what the resume had to restore mattered: the KL to the reference is not 0 at step 3 (a reference
    # rebuilt from the resumed policy would give 0), and the coefficient had moved from its start
    assert rows[3]["kl"] > 0
    assert rows[3]["kl_coef"] != 0.05


def test_ppo_with_a_critic_resumes_exactly(tmp_path: Path) -> None:
    # killed right after grpo-000002 became latest; saves are asynchronous
    rows = _resumed_equals_uninterrupted(
        tmp_path, [*BASE, *PPO, "checkpoint.async_save=true"], "saved:grpo-000002"
    )
    assert rows[3]["value_grad_norm"] > 0 and rows[3]["measured_kl"] > 0
