"""sft/grpo.stop_at_accuracy: a phase ends at a fixed skill level on the validation split, and a resume keeps it
ended."""

from __future__ import annotations

import json

import pytest

from loopline.cli import main
from loopline.config import SFTConfig

TINY = [
    "sft.steps=12", "sft.check_every=3", "sft.eval_every=0", "grpo.steps=0",
    "data.task.num_train=200", "data.task.num_eval=16", "data.task.num_val=16", "eval.num_prompts=16",
    "checkpoint_every=0", "progress=false", "tensorboard=false",
]  # fmt: skip


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_stops_at_the_first_check_that_reaches_the_target_and_resume_keeps_it_stopped(tmp_path):
    run = tmp_path / "run"
    # a target of 0 is at least half reached from the start, so SFT checks after step 1, and stops there
    assert main(["train", f"out_dir={run}", "sft.stop_at_accuracy=0.0", *TINY]) == 0
    sft = [r for r in _rows(run) if r["phase"] == "sft" and r["step"] > 0]
    assert [r["step"] for r in sft] == [1]
    assert "val_accuracy" in sft[-1] and "eval_accuracy" in sft[-1]  # the phase's last step is evaluated
    state = json.loads(next(run.glob("checkpoints/sft-*/state.json")).read_text())
    assert state["step"] == 1 and state["done"] is True
    # resuming with more RL steps goes on with GRPO from the stopped SFT, never SFT steps 2..12
    assert main(["train", "--resume", f"out_dir={run}", "grpo.steps=1"]) == 0
    rows = _rows(run)
    assert max(r["step"] for r in rows if r["phase"] == "sft") == 1
    assert [r["step"] for r in rows if r["phase"] == "grpo"] == [0, 1]


def test_sft_runs_every_step_when_the_target_is_not_reached(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "sft.stop_at_accuracy=1.0", *TINY]) == 0
    sft = [r for r in _rows(run) if r["phase"] == "sft" and r["step"] > 0]
    assert [r["step"] for r in sft] == list(range(1, 13))
    checked = [r["step"] for r in sft if "val_accuracy" in r]
    assert checked == [3, 6, 9, 12]
    assert all(r["val_accuracy"] < 1.0 for r in sft if "val_accuracy" in r)


def test_checks_come_every_check_every_steps_then_every_step_past_half_the_target():
    cfg = SFTConfig(stop_at_accuracy=0.4, check_every=5)
    assert [s for s in range(1, 16) if cfg.check_due(s, last_accuracy=0.0)] == [5, 10, 15]
    assert [s for s in range(1, 16) if cfg.check_due(s, last_accuracy=0.19)] == [5, 10, 15]
    assert all(cfg.check_due(s, last_accuracy=0.2) for s in range(1, 16))  # half of 0.4: every step
    assert not any(
        SFTConfig(stop_at_accuracy=None).check_due(s, 0.9) for s in range(1, 16)
    )  # no target: never


def test_only_a_check_of_the_whole_split_ends_sft(tmp_path, monkeypatch):
    # every check reports 100%: the first (step 3, below half the target) reads the split's first coarse_val
    # problems and cannot end SFT; the next step's check reads all 16 and ends it at step 4
    import loopline.loops.sft as sft

    read: list[int] = []
    real = sft.evaluate

    def perfect(ctx, rows=None):
        if rows is None:  # the held-out eval of the phase's last step
            return real(ctx)
        read.append(len(rows))
        assert rows == ctx.val_rows[: len(rows)]
        return {"eval_accuracy": 1.0}

    monkeypatch.setattr(sft, "evaluate", perfect)
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "sft.stop_at_accuracy=0.5", "sft.coarse_val=4", *TINY]) == 0
    assert read == [4, 16]
    assert max(r["step"] for r in _rows(run) if r["phase"] == "sft") == 4


def test_the_whole_split_is_read_from_half_the_target_on():
    cfg = SFTConfig(stop_at_accuracy=0.4)
    assert not cfg.fine_check(0.19) and cfg.fine_check(0.2) and cfg.fine_check(0.9)
    assert not SFTConfig(stop_at_accuracy=None).fine_check(1.0)


def test_past_half_the_target_sft_steps_at_near_target_lr(tmp_path, monkeypatch):
    # every check reports 30% of a 50% target: from the first check (step 3) on, SFT is past half the target,
    # so steps 4.. run at the schedule's lr times near_target_lr, and the target is never reached
    import loopline.loops.sft as sft

    real = sft.evaluate
    monkeypatch.setattr(
        sft, "evaluate", lambda ctx, rows=None: real(ctx) if rows is None else {"eval_accuracy": 0.3}
    )
    run = tmp_path / "run"
    args = ["sft.stop_at_accuracy=0.5", "sft.near_target_lr=0.25", "sft.optim.schedule=constant"]
    assert (
        main(["train", f"out_dir={run}", *args, "sft.optim.warmup_steps=0", "sft.optim.lr=1e-3", *TINY]) == 0
    )
    lrs = [r["lr"] for r in _rows(run) if r["phase"] == "sft" and r["step"] > 0]
    assert lrs == pytest.approx([1e-3] * 3 + [2.5e-4] * 9)


# grpo.stop_at_accuracy: RL ends the same way, at a validation check every grpo.check_every steps

RL = [
    "sft.steps=0", "grpo.steps=6", "grpo.check_every=2", "grpo.eval_every=0", "grpo.prompts_per_step=4",
    "grpo.group_size=2", "grpo.micro_batch_size=8", "grpo.sampling.max_new_tokens=8",
    "data.task.num_train=200", "data.task.num_eval=16", "data.task.num_val=16", "eval.num_prompts=16",
    "checkpoint_every=0", "progress=false", "tensorboard=false",
]  # fmt: skip


def test_grpo_stops_at_the_first_check_that_reaches_the_target_and_resume_keeps_it_stopped(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "grpo.stop_at_accuracy=0.0", *RL]) == 0
    grpo = [r for r in _rows(run) if r["phase"] == "grpo" and r["step"] > 0]
    assert [r["step"] for r in grpo] == [1, 2]  # the first check (step 2) reaches 0%
    assert "val_accuracy" in grpo[-1] and "eval_accuracy" in grpo[-1]  # the phase's last step is evaluated
    assert "val_accuracy" not in grpo[0]
    state = json.loads(next(run.glob("checkpoints/grpo-*/state.json")).read_text())
    assert state["step"] == 2 and state["done"] is True
    out = capsys.readouterr().out  # the report reads the last step trained, not grpo.steps
    assert "n/a" not in next(line for line in out.splitlines() if "after RL:" in line)
    assert "RL reached grpo.stop_at_accuracy=0% on the validation split at step 2 of at most 6" in out
    # a resume of the stopped run trains nothing more
    assert main(["train", "--resume", f"out_dir={run}"]) == 0
    assert [r["step"] for r in _rows(run) if r["phase"] == "grpo"] == [0, 1, 2]


def test_grpo_runs_every_step_when_the_target_is_not_reached_or_is_null(tmp_path):
    for target, checked in (("1.0", [2, 4, 6]), ("null", [])):
        run = tmp_path / target
        assert main(["train", f"out_dir={run}", f"grpo.stop_at_accuracy={target}", *RL]) == 0
        grpo = [r for r in _rows(run) if r["phase"] == "grpo" and r["step"] > 0]
        assert [r["step"] for r in grpo] == list(range(1, 7))
        assert [r["step"] for r in grpo if "val_accuracy" in r] == checked
        assert all(r["val_accuracy"] < 1.0 for r in grpo if "val_accuracy" in r)
