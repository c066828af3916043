"""Mixed precision in the GRPO loop (local backend): float32 masters trained, a bfloat16 engine fed their rounded
copies, the engine/trainer log-prob mismatch logged every step, and the behaviour correction acting on it at
staleness 0; a run killed mid-way and resumed ends bitwise where the uninterrupted one does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.export import export
from loopline.checkpoint.state import RunState
from loopline.config import load_config
from loopline.loops.context import build_context
from loopline.loops.grpo import train_grpo
from loopline.metrics.logger import read_metrics
from tests.loops.test_grpo_variants import TINY, DigitScorer
from tests.runs import kill_at, pause_env, steady


def _run(out: Path, *overrides: str) -> tuple[dict, dict, list[dict]]:
    """A tiny GRPO run: (trainer weights, the engine's weights, metrics rows)."""
    ctx = build_context(load_config(None, [*TINY, f"out_dir={out}", *overrides]))
    ctx.scorer = DigitScorer()
    try:
        train_grpo(ctx, RunState(phase="grpo"))
        engine = ctx.rollout.group.call("weights")[0]  # while the roles run: close() stops them
    finally:
        ctx.close()
    return dict(ctx.model.named_parameters()), engine, read_metrics(out)


def test_bf16_engine_beside_fp32_trainer_logs_the_mismatch_and_tis_corrects_it(tmp_path: Path) -> None:
    masters, engine, rows = _run(
        tmp_path, "rollout.dtype=bfloat16", "grpo.behaviour_correction=tis", "grpo.sampling.temperature=0.7"
    )
    for name, p in masters.items():
        assert p.dtype == torch.float32
        assert torch.equal(engine[name], p.detach().to(torch.bfloat16)), name  # synced, rounded to nearest
    # staleness 0: the only off-policy part is the bf16 engine's rounding: log-probs apart by ~1e-3..1e-2 (bf16's
    # unit roundoff is 2^-9), a k3 KL of ~delta^2/2 ~ 1e-7 (float32 engines: ~1e-12, see test_grpo_variants)
    for r in rows:
        assert r["logprob_mismatch_kl"] > 1e-8 and r["logprob_mismatch_max_abs"] > 1e-3
        assert r["behaviour_weight_min"] < 1 - 1e-3 < 1 + 1e-3 < r["behaviour_weight_max"]


def test_mixed_precision_run_trains_fp32_masters_and_feeds_a_bf16_engine(tmp_path: Path) -> None:
    masters, engine, rows = _run(tmp_path, "training.mixed_precision=bf16", "grpo.steps=1")
    assert all(p.dtype == torch.float32 for p in masters.values())
    assert all(engine[n].dtype == torch.bfloat16 for n in masters)
    assert all(torch.equal(engine[n], p.detach().to(torch.bfloat16)) for n, p in masters.items())
    assert rows[0]["grad_norm"] > 0
    assert "logprob_mismatch_kl" not in rows[0]  # engine and trainer both compute in bf16: not measured
    # the checkpoint keeps the fp32 masters; export writes them as they are, or rounded to the dtype asked for
    as_is, rounded = export(tmp_path, tmp_path / "fp32"), export(tmp_path, tmp_path / "bf16", "bfloat16")
    saved = load_file(as_is / "model.safetensors")
    low = load_file(rounded / "model.safetensors")
    for name, p in masters.items():
        assert torch.equal(saved[name], p.detach()), name
        assert low[name].dtype == torch.bfloat16 and torch.equal(low[name], p.detach().to(torch.bfloat16)), (
            name
        )


ARGS = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "grpo.stop_at_accuracy=null", "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=0", "data.task.num_train=12", "data.task.num_eval=8",
    "eval.num_prompts=8", "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1",
    "deterministic=true", "training.mixed_precision=bf16", "model.tiny.hidden_size=32", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=64",
]  # fmt: skip


def _cmd(run: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "loopline.cli", "train", *(["--resume"] if resume else []), *ARGS,
            f"out_dir={run}"]  # fmt: skip


def _finish(run: Path, resume: bool) -> None:
    done = subprocess.run(_cmd(run, resume), env=pause_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.e2e  # a `loopline` process killed and resumed
def test_a_mixed_precision_run_resumes_exactly(tmp_path: Path) -> None:
    """Killed (SIGKILL) after GRPO step 2's row, resumed from step 1's checkpoint: the same fp32 masters, AdamW
    state and rows as the run never interrupted."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _finish(whole, resume=False)
    kill_at(_cmd(cut, resume=False), "step:grpo:2", tmp_path / "markers", 600)
    _finish(cut, resume=True)
    final = "checkpoints/grpo-000003"
    for name in ("model/model.safetensors", "dcp/__0_0.distcp", "state.json"):
        assert (cut / final / name).read_bytes() == (whole / final / name).read_bytes(), name
    assert steady(read_metrics(cut)) == steady(read_metrics(whole))
