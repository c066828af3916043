"""No command loses a run (issue 11): --resume keeps the run's config, finds the newest whole checkpoint without
trusting `latest`, passes over damaged checkpoints, never starts afresh over a run; a new run refuses an out_dir
that holds one; SIGINT/SIGTERM stop at a step's end with a checkpoint that resumes bitwise.

The in-process tests copy one tiny finished run (SFT 3 steps, GRPO 3 steps, a checkpoint every step) and call
the real CLI entry on it. The signal tests run `loopline train` as a subprocess in deterministic mode, and
resume with exactly the README's form: `loopline train --resume out_dir=R`.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.checkpoint.ledger import read_ledger
from loopline.checkpoint.run_dir import HISTORY_FILE, config_changes, resume_config
from loopline.checkpoint.state import checkpoint_fault
from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from tests.runs import pause_env, steady

pytestmark = pytest.mark.slow

TINY = [
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.eval_every=0",
    "data.task.num_train=200", "data.task.num_eval=20", "eval.num_prompts=8",
    "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip


def _ckpt(run: Path, name: str) -> Path:
    return run / "checkpoints" / name


def _steps(run: Path, phase: str) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["phase"] == phase]


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / HISTORY_FILE).read_text().splitlines()]


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run, by relative path: what an intact run still has after a refused command."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished tiny run: checkpoints grpo-000001..3 (keep_last 3), metrics sft 0-3 and grpo 0-3."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", *TINY, f"out_dir={run}"]) == 0
    return run


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    """A copy of the finished run to resume, damage or overwrite."""
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


# ---------------------------------------------------------------------------------------------------------
# 1. --resume continues the run as it was configured
# ---------------------------------------------------------------------------------------------------------


def test_readme_resume_form_keeps_the_saved_config(run, capsys):
    # the run died during GRPO step 3: grpo-000002 is its newest checkpoint
    shutil.rmtree(_ckpt(run, "grpo-000003"))
    saved = load_config(run / "config.yaml")
    assert main(["train", "--resume", f"out_dir={run}"]) == 0  # the README's form, nothing else given
    assert f"resumed from {_ckpt(run, 'grpo-000002')} (grpo step 2)" in capsys.readouterr().out
    assert _steps(run, "sft") == [0, 1, 2, 3] and _steps(run, "grpo") == [0, 1, 2, 3]
    # the tiny run's config, not the 250-step default job (only out_dir moved: the run was copied)
    assert config_changes(saved, load_config(run / "config.yaml")) == {"out_dir": (saved.out_dir, str(run))}
    assert [h["event"] for h in _history(run)] == ["start", "resume"]
    assert _history(run)[-1]["checkpoint"] == "grpo-000002"


def test_resume_may_extend_the_run(run, capsys):
    assert main(["train", "--resume", f"out_dir={run}", "grpo.steps=4", "checkpoint.keep_last=5"]) == 0
    assert f"resumed from {_ckpt(run, 'grpo-000003')} (grpo step 3)" in capsys.readouterr().out
    assert _steps(run, "grpo") == [0, 1, 2, 3, 4]
    cfg = load_config(run / "config.yaml")
    assert (cfg.grpo.steps, cfg.grpo.prompts_per_step, cfg.sft.steps) == (4, 4, 3)
    changes = _history(run)[-1]["changes"]
    assert changes["grpo.steps"] == [3, 4] and changes["checkpoint.keep_last"] == [3, 5]
    assert _history(run)[-1]["forced"] == []


def test_resume_refuses_a_changed_config(run, tmp_path, capsys):
    before = _snapshot(run)
    assert main(["train", "--resume", f"out_dir={run}", "grpo.optim.lr=0.5", "seed=7", "grpo.steps=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    saved_lr = load_config(run / "config.yaml").grpo.optim.lr
    assert f"grpo.optim.lr: saved {saved_lr!r}, given 0.5" in err and "seed: saved 0, given 7" in err
    assert "grpo.steps" not in err.split("A resume may")[0]  # allowed, so not named as a difference
    assert "--allow-config-change" in err
    # a config file given with --resume is compared the same way
    changed = tmp_path / "changed.yaml"
    changed.write_text("data:\n  task:\n    num_train: 300\n")
    assert main(["train", str(changed), "--resume", f"out_dir={run}"]) == 2
    assert "data.task.num_train: saved 200, given 300" in capsys.readouterr().err
    assert _snapshot(run) == before  # nothing written: config, metrics, checkpoints, history

    forced = ["grpo.entropy_coef=0.01", "grpo.steps=4", "--allow-config-change"]
    assert main(["train", "--resume", f"out_dir={run}", *forced]) == 0
    assert load_config(run / "config.yaml").grpo.entropy_coef == 0.01
    last = _history(run)[-1]
    assert last["event"] == "resume" and last["changes"]["grpo.entropy_coef"] == [0.0, 0.01]
    assert last["forced"] == ["grpo.entropy_coef"]  # grpo.steps may change anyway


# ---------------------------------------------------------------------------------------------------------
# 2. the newest whole checkpoint, whatever `latest` says; never a fresh start over a run
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pointer", ["missing", "garbage", "names a deleted checkpoint"])
def test_resume_does_not_trust_latest(run, pointer, capsys):
    latest = run / "checkpoints" / "latest"
    if pointer == "missing":
        latest.unlink()
    elif pointer == "garbage":
        latest.write_bytes(b"\x00\xffnot a checkpoint\n")
    else:
        latest.write_text("grpo-000009")
    metrics = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", f"out_dir={run}"]) == 0
    assert f"resumed from {_ckpt(run, 'grpo-000003')} (grpo step 3)" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_bytes() == metrics  # the finished run, not a fresh one


def test_resume_refuses_a_run_with_metrics_and_no_checkpoint(run, capsys):
    shutil.rmtree(run / "checkpoints")
    before = _snapshot(run)
    assert main(["train", "--resume", f"out_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "has metrics but no checkpoint" in err and "--overwrite" in err
    assert _snapshot(run) == before  # metrics.jsonl not truncated


def test_restart_unsaved_starts_a_run_with_no_checkpoint_again(run, capsys):
    # what a job controller's retry (loopline k8s's entrypoint) does after a pod lost before the first save
    shutil.rmtree(run / "checkpoints")
    assert main(["train", "--resume", "--restart-unsaved", f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "stopped before its first checkpoint: --restart-unsaved starts it again from step 0" in out
    assert f"no checkpoint in {run}: starting fresh" in out
    # the old rows are gone and each step is trained once
    assert _steps(run, "sft") == _steps(run, "grpo") == [0, 1, 2, 3]
    assert [(r["phase"], r["step"]) for r in read_ledger(run)] == [
        (p, s) for p in ("sft", "grpo") for s in (1, 2, 3)
    ]
    assert main(["train", "--restart-unsaved", f"out_dir={run}"]) == 2  # only with --resume
    assert "--restart-unsaved goes with --resume" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# 3. a damaged checkpoint is named and passed over
# ---------------------------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["dcp/__0_0.distcp", "state.json", "loop.pt", "rng.pt"])
def test_a_truncated_file_falls_back_to_the_previous_checkpoint(run, damaged, capsys):
    _truncate(_ckpt(run, "grpo-000003") / damaged)
    assert checkpoint_fault(_ckpt(run, "grpo-000003")).startswith(damaged)
    assert main(["train", "--resume", f"out_dir={run}"]) == 0
    out, err = capsys.readouterr()
    assert f"warning: checkpoint {_ckpt(run, 'grpo-000003')} is damaged: {damaged}" in err
    assert f"resumed from {_ckpt(run, 'grpo-000002')} (grpo step 2)" in out
    assert "grpo-000003 (grpo step 3)" not in out  # no "resumed from" before a load succeeded
    assert _steps(run, "grpo") == [0, 1, 2, 3]  # step 3 trained again, logged once
    assert checkpoint_fault(_ckpt(run, "grpo-000003")) is None  # and its checkpoint written whole


def test_no_whole_checkpoint_is_a_clear_error(run, capsys):
    for name in ("grpo-000001", "grpo-000002", "grpo-000003"):
        _truncate(_ckpt(run, name) / "rng.pt")
    before = _snapshot(run)
    assert main(["train", "--resume", f"out_dir={run}"]) == 2
    out, err = capsys.readouterr()
    assert "resumed from" not in out
    assert err.startswith(f"loopline: no checkpoint of {run} can be resumed from") and "Traceback" not in err
    assert all(f"{_ckpt(run, name)} (rng.pt: " in err for name in ("grpo-000001", "grpo-000003"))
    assert _snapshot(run) == before


# ---------------------------------------------------------------------------------------------------------
# 6. a new run does not write over an old one
# ---------------------------------------------------------------------------------------------------------


def test_new_run_refuses_an_out_dir_with_a_run(run, capsys):
    before = _snapshot(run)
    assert main(["train", *TINY, f"out_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert f"out_dir {run} holds a run" in err and "--resume" in err and "--overwrite" in err
    assert main(["sft", *TINY, f"out_dir={run}"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["train", "--resume", "--overwrite", f"out_dir={run}"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_overwrite_deletes_the_old_run(run, capsys):
    (run / "notes.txt").write_text("mine")
    assert main(["train", *TINY, "sft.steps=2", "grpo.steps=1", f"out_dir={run}", "--overwrite"]) == 0
    assert f"--overwrite: deleted the run in {run}" in capsys.readouterr().out
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert names == ["grpo-000001", "sft-000001", "sft-000002"]  # none of the old run's grpo-000002/3
    assert _steps(run, "sft") == [0, 1, 2] and _steps(run, "grpo") == [0, 1]
    assert [h["event"] for h in _history(run)] == ["start"]
    assert (run / "notes.txt").read_text() == "mine"  # only the run's own files go


# ---------------------------------------------------------------------------------------------------------
# 10. SIGTERM / SIGINT: a real `loopline train` process
# ---------------------------------------------------------------------------------------------------------

SIGNAL_ARGS = [
    *[a for a in TINY if not a.startswith(("grpo.steps=", "checkpoint_every="))],
    "grpo.stop_at_accuracy=null", "grpo.steps=6", "checkpoint_every=0", "deterministic=true",
]  # fmt: skip  # checkpoint_every=0: saves at each phase's end only, so a mid-GRPO checkpoint is the signal's
RUN_TIMEOUT_S = 300
FINAL = "grpo-000006"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loopline.cli", *args]


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), env=pause_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _wait_for(proc: subprocess.Popen, done, what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not done():
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended (rc {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"no {what} within {RUN_TIMEOUT_S}s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = _run_cli("train", *SIGNAL_ARGS, f"out_dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_sigterm_mid_grpo_checkpoints_then_resumes_bitwise(uninterrupted, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cli("train", *SIGNAL_ARGS, f"out_dir={run}"),
        env=pause_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(
            proc, lambda: metrics.exists() and '"phase": "grpo", "step": 2' in metrics.read_text(), "step 2"
        )
        proc.send_signal(signal.SIGTERM)  # during GRPO step 3 (or step 2's end): that step finishes and saves
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SIGTERM: finishing this step" in err
    stopped = (run / "checkpoints" / "latest").read_text().strip()
    step = int(stopped.split("-")[1])
    assert (
        stopped.startswith("grpo-") and 2 <= step < 6
    )  # the signal's own checkpoint: none due before step 6
    assert f"stopped by SIGTERM after grpo step {step}: checkpoint {run / 'checkpoints' / stopped}" in out
    assert f"continue with: loopline train --resume out_dir={run}" in out
    assert _steps(run, "grpo")[-1] == step

    resumed = _run_cli("train", "--resume", f"out_dir={run}")  # what the message and the README say
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / stopped} (grpo step {step})" in resumed.stdout
    for name in ("model/model.safetensors", "dcp/__0_0.distcp", "state.json"):
        assert (_ckpt(run, FINAL) / name).read_bytes() == (_ckpt(uninterrupted, FINAL) / name).read_bytes(), (
            name
        )
    assert steady(read_metrics(run)) == steady(read_metrics(uninterrupted))
    assert read_ledger(run) == read_ledger(uninterrupted)


def test_second_sigint_exits_at_once_and_the_unsaved_run_is_not_resumed(uninterrupted, tmp_path):
    # An old finished run in out_dir, overwritten by a new run that is stopped before its first save: a resume
    # must neither continue the old run's checkpoints (the old bug) nor start afresh over the new run's metrics.
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    markers = tmp_path / "markers"
    proc = subprocess.Popen(
        _cli("train", *SIGNAL_ARGS, f"out_dir={run}", "--overwrite"),
        env=pause_env("step:sft:1", markers),  # held after SFT step 1's row, before any checkpoint
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(proc, (markers / "step_sft_1.paused").exists, "the pause at step:sft:1")
        proc.send_signal(signal.SIGINT)  # the first asks for a checkpoint at the step's end (the run is held)
        # two signals delivered before Python runs its handler count as one: wait until the first is handled
        while "SIGINT: finishing this step" not in (line := proc.stderr.readline()):
            assert line, "stderr closed before the first SIGINT was handled"
        proc.send_signal(signal.SIGINT)  # the second exits at once
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "second SIGINT: exiting now" in err and "Traceback" not in err
    assert not any(p.is_dir() for p in (run / "checkpoints").glob("*"))  # the old run's went with --overwrite
    metrics = (run / "metrics.jsonl").read_bytes()
    assert _steps(run, "sft") == [0, 1]

    again = _run_cli("train", "--resume", f"out_dir={run}")
    assert again.returncode == 2
    assert "has metrics but no checkpoint" in again.stderr and "resumed from" not in again.stdout
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_sigterm_stops_loopline_sft_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = [*[a for a in SIGNAL_ARGS if not a.startswith("sft.steps=")], "sft.steps=8"]
    proc = subprocess.Popen(
        _cli("sft", *args, f"out_dir={run}"),
        env=pause_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(
            proc, lambda: metrics.exists() and '"phase": "sft", "step": 1' in metrics.read_text(), "step 1"
        )
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    step = _steps(run, "sft")[-1]
    assert 1 <= step < 8
    assert f"stopped by SIGTERM after sft step {step}: checkpoint {_ckpt(run, f'sft-{step:06d}')}" in out
    assert checkpoint_fault(_ckpt(run, f"sft-{step:06d}")) is None
    assert not (run / "model").exists()  # the finished model only when SFT ran to its end


def test_sft_resumes_and_extends_like_one_longer_run(run, tmp_path, capsys):
    """`loopline sft --resume out_dir=R sft.steps=N` continues R's SFT from its newest checkpoint (at a constant
    learning rate, extending it is the longer run exactly); before, `loopline sft` had no --resume and a stopped run
    had to start over. It does not take another command's run."""
    args = [
        *TINY,
        "sft.steps=4",
        "sft.optim.schedule=constant",
        "sft.optim.warmup_steps=0",
        "deterministic=true",
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["sft", *args, f"out_dir={whole}"]) == 0
    assert main(["sft", *args, "sft.steps=2", f"out_dir={parts}"]) == 0
    assert main(["sft", "--resume", f"out_dir={parts}", "sft.steps=4"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (parts / "model" / "model.safetensors").read_bytes() == (
        whole / "model" / "model.safetensors"
    ).read_bytes()
    trained = [
        [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("lr")) for r in read_metrics(run)]
        for run in (parts, whole)
    ]
    assert trained[0] == trained[1]  # (the 2-step run also evaluated at its end, step 2)
    assert steady(read_metrics(parts))[-1] == steady(read_metrics(whole))[-1]  # the last step's held-out eval
    assert [h["event"] for h in _history(parts)] == ["start", "resume"]
    capsys.readouterr()
    assert main(["sft", "--resume", f"out_dir={run}"]) == 2  # a finished `loopline train` run: not sft's
    assert "is of phase 'grpo'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# 5. --resume of an out_dir that holds no run; a resume from another working directory
# ---------------------------------------------------------------------------------------------------------


def test_resume_of_an_out_dir_holding_no_run_is_refused(run, tmp_path, capsys):
    # was: "no checkpoint in ...: starting fresh", a whole new run in the misspelt directory
    typo = tmp_path / "rnu"
    assert main(["train", "--resume", f"out_dir={typo}"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: out_dir {typo} does not exist; runs beside it: {run}" in err and "\n" not in err.strip()
    )
    assert not typo.exists()
    typo.mkdir()
    assert main(["sft", "--resume", f"out_dir={typo}"]) == 2
    assert f"out_dir {typo} holds no run" in capsys.readouterr().err
    assert list(typo.iterdir()) == []
    # a job controller's first attempt (loopline k8s: `--resume --restart-unsaved` every time) starts the run
    fresh = tmp_path / "new"
    cfg, changes = resume_config(None, [f"out_dir={fresh}"], allow_change=False, fresh_ok=True)
    assert cfg.out_dir == str(fresh) and changes == {}


def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch, capsys):
    """The run's saved config holds its paths absolute (they were relative as given: a resume from elsewhere
    failed, for model.path with a traceback); an older run's relative paths are resolved against the directory
    it was started from, where recorded, else refused in one line."""
    here, elsewhere, run = tmp_path / "here", tmp_path / "elsewhere", tmp_path / "run"
    here.mkdir(), elsewhere.mkdir()
    (here / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": f"{i + 1}"}) + "\n"
                                             for i in range(8)))  # fmt: skip
    sft = [t for t in TINY if t.startswith(("sft.", "checkpoint", "progress", "tensorboard", "threads"))]
    files = ["data.source=jsonl", "data.train_path=rows.jsonl", "data.eval_path=rows.jsonl"]
    monkeypatch.chdir(here)
    assert main(["sft", *sft, *files, "sft.steps=1", f"out_dir={run}"]) == 0
    assert load_config(run / "config.yaml").data.train_path == str(here / "rows.jsonl")
    monkeypatch.chdir(elsewhere)
    assert main(["sft", "--resume", "sft.steps=2", f"out_dir={run}"]) == 0
    # a run saved before paths were stored absolute: its start line says where it began
    saved = load_config(run / "config.yaml")
    saved.data.train_path = saved.data.eval_path = "rows.jsonl"
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace(str(here / "rows.jsonl"), "rows.jsonl")
    )
    assert main(["sft", "--resume", "sft.steps=3", f"out_dir={run}"]) == 0
    # ... and one that did not record it either
    history = _history(run)
    (run / HISTORY_FILE).write_text("".join(json.dumps({k: v for k, v in h.items() if k != "cwd"}) + "\n"
                                            for h in history))  # fmt: skip
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace(str(here / "rows.jsonl"), "rows.jsonl")
    )
    capsys.readouterr()
    assert main(["sft", "--resume", "sft.steps=4", f"out_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_path='rows.jsonl'" in err and "resume from that directory" in err
    monkeypatch.chdir(here)  # from where it began: found
    assert main(["sft", "--resume", "sft.steps=4", f"out_dir={run}"]) == 0


def test_a_resume_given_auto_keeps_what_auto_chose_at_the_start(tmp_path):
    """The saved config holds auto's choice (training.mixed_precision=none or bf16); a resume with the run's own
    config file, which says `auto` (a Kubernetes job's retry), is no change, and an explicit other value is one."""
    from loopline.config import save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [f"out_dir={run}", "training.mixed_precision=none"]), run / "config.yaml")
    given = tmp_path / "job.yaml"
    given.write_text(f"out_dir: {run}\ntraining:\n  mixed_precision: auto\n")
    cfg, changes = resume_config(str(given), [], allow_change=False)
    assert cfg.training.mixed_precision == "none" and changes == {}
    with pytest.raises(Exception, match="training.mixed_precision: saved 'none', given 'bf16'"):
        resume_config(str(given), ["training.mixed_precision=bf16"], allow_change=False)
