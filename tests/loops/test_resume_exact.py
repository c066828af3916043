"""Exact resume: `loopline train` killed with SIGKILL and resumed with --resume ends bitwise equal to a run
never interrupted: the same weights (safetensors bytes), metrics rows and sample ledger.

Deterministic mode on CPU, one thread. Every kill is a real SIGKILL of the `loopline train` process. The
LOOPLINE_PAUSE_AT test hook (loopline.checkpoint.faults) holds the process at a named point so that the
kill lands exactly there: between an SFT step's row and the next checkpoint, inside a checkpoint write,
right after a save, and just past an epoch boundary (12 prompts, 4 per GRPO step: step 4 opens epoch 1;
SFT takes 8 rows a step, so its step 2 crosses one too). One run is killed four times in a row, each
time resumed from what the previous kill left; two of its launches save asynchronously, and one of
those is killed while its background write is half done and the loop has trained on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.metrics.logger import read_metrics
from tests.runs import kill_at, pause_env, steady

pytestmark = pytest.mark.slow

ARGS = [
    "sft.steps=4", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=2",
    "grpo.stop_at_accuracy=null", "grpo.steps=6", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    "grpo.eval_every=3", "grpo.entropy_coef=0.01", "data.task.num_train=12", "data.task.num_eval=8",
    "eval.num_prompts=8", "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
]  # fmt: skip
RUN_TIMEOUT_S = 180  # one launch of the tiny run takes ~10-20 s on a shared 2-core machine
FINAL = "grpo-000006"
ASYNC = "checkpoint.async_save=true"


def _cmd(run: Path, resume: bool, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "loopline.cli", "train", *(["--resume"] if resume else []), *ARGS,
            f"out_dir={run}", *extra]  # fmt: skip


def run_to_end(run: Path, resume: bool = False, extra: list[str] = ()) -> str:
    """Run `loopline train` to the end; its output."""
    done = subprocess.run(
        _cmd(run, resume, list(extra)),
        env=pause_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _kill(run: Path, point: str, resume: bool, extra: list[str] = ()) -> None:
    kill_at(_cmd(run, resume, list(extra)), point, run.parent / f"markers-{run.name}", RUN_TIMEOUT_S)


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _weights(run: Path) -> bytes:
    return (run / "checkpoints" / FINAL / "model" / "model.safetensors").read_bytes()


def assert_same_run(run: Path, reference: Path) -> None:
    """Bitwise-equal final weights and optimizer shards, equal metrics rows, the same samples each trained once."""
    assert _latest(run) == FINAL
    assert _weights(run) == _weights(reference)
    for name in ("state.json", "dcp/__0_0.distcp"):
        assert (run / "checkpoints" / FINAL / name).read_bytes() == (
            reference / "checkpoints" / FINAL / name
        ).read_bytes()
    assert steady(read_metrics(run)) == steady(read_metrics(reference))
    ledger = read_ledger(run)
    assert ledger == read_ledger(reference)
    assert [(r["phase"], r["step"]) for r in ledger] == [("sft", s) for s in range(1, 5)] + [
        ("grpo", s) for s in range(1, 7)
    ]
    assert not repeats(ledger)  # every (epoch, prompt, sample) trained once per phase
    assert {s[0] for r in ledger if r["phase"] == "grpo" for s in r["samples"]} == {0, 1}  # two GRPO epochs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run never interrupted."""
    run = tmp_path_factory.mktemp("reference") / "run"
    run_to_end(run)
    # GRPO moves the weights (rewards are still 0 this early; the entropy bonus gives the gradient), and
    # how depends on the sampled tokens: equal final weights need the same samples, not just the same data
    early = (run / "checkpoints" / "grpo-000002" / "model" / "model.safetensors").read_bytes()
    assert early != _weights(run)
    return run


def test_killed_four_times_then_resumed_equals_uninterrupted(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # 1. Mid-SFT: step 3's row and ledger line written, its checkpoint not (sft-000002 is the newest).
    _kill(run, "step:sft:3", resume=False)
    assert _latest(run) == "sft-000002"
    # 2. Inside the write of grpo-000002, saving asynchronously: the writer thread is held with the shards
    # on disk and the HF weights not, nothing renamed, while the loop trains on (then waits for it).
    _kill(run, "save:mid:grpo-000002", resume=True, extra=[ASYNC])
    half = run / "checkpoints" / ".tmp-grpo-000002"
    assert (half / "dcp" / ".metadata").exists() and not (half / "model" / "model.safetensors").exists()
    assert _latest(run) == "sft-000004" and not (run / "checkpoints" / "grpo-000002").exists()
    # 3. Right after grpo-000002 became latest.
    _kill(run, "saved:grpo-000002", resume=True)
    assert _latest(run) == "grpo-000002" and not half.exists()
    # 4. Past the epoch boundary: step 4 (epoch 1's first prompts) logged, its checkpoint not written.
    _kill(run, "step:grpo:4", resume=True)
    assert _latest(run) == "grpo-000002"
    assert [r["step"] for r in read_metrics(run) if r["phase"] == "grpo"][-1] == 4
    out = run_to_end(run, resume=True, extra=[ASYNC])
    assert f"resumed from {run / 'checkpoints' / 'grpo-000002'} (grpo step 2)" in out
    # blocking and async saves mixed, four kills: the same run as the uninterrupted (blocking) one
    assert_same_run(run, reference)


def test_an_engine_on_a_copy_of_its_own_samples_the_same_run(reference: Path, tmp_path: Path) -> None:
    """rollout.share_weights (on by default: the engine generates with the actor's own parameters) changes
    memory only: the engine on a copy synced every step gives the same samples, weights and metrics, bitwise."""
    run = tmp_path / "run"
    run_to_end(run, extra=["rollout.share_weights=false"])
    assert_same_run(run, reference)
