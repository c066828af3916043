"""Weights & Biases logging (metrics.wandb) in W&B's offline mode (no network here): a tiny `loopline train` writes
an offline W&B run holding the run's config and every metrics row's numbers; `--resume` continues the same W&B run
(the same id); without the wandb package, metrics.wandb=true is one line and exit 2 before any work.

The offline run is read back from its .wandb file: W&B's append-only log of protobuf records (a 7-byte header,
then 32 KiB blocks of records, each with a 7-byte header: CRC32, length, type full/first/middle/last)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopline.cli import main
from loopline.metrics.logger import read_metrics
from tests.conftest import need_module

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # the CLI's entry point, whole runs

TINY = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=2", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=0",
    "data.task.num_train=200", "data.task.num_eval=8", "eval.num_prompts=8", "eval.batch_size=8",
    "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip
WANDB = [
    "metrics.wandb=true",
    "metrics.wandb_project=lp-test",
    "metrics.wandb_run_name=tiny",
    "metrics.wandb_tags=[a,b]",
]


def _records(path: Path) -> Iterator[object]:
    """The protobuf records of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        kind = data[pos + 6] if left >= 7 else 0
        if kind == 0:  # the rest of a block is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def _offline_run(run: Path) -> dict:
    """An offline run's id, project, name, tags, config and history rows ({key: value})."""
    out: dict = {"history": [], "config": {}}
    for r in _records(next(run.glob("*.wandb"))):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name, tags=list(r.run.tags))
            out["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
    return out


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    need_module("wandb", "wandb is not installed (pip install 'loopline[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "wandb_dir" / "wandb"


def test_a_run_logs_its_config_and_curves_and_a_resume_continues_the_same_wandb_run(
    offline: Path, tmp_path: Path
):
    out = tmp_path / "run"
    assert main(["train", *TINY, *WANDB, f"out_dir={out}"]) == 0
    run_id = json.loads((out / "wandb_run.json").read_text())["id"]
    (first,) = sorted(offline.glob("offline-run-*"))
    logged = _offline_run(first)
    assert (logged["id"], logged["project"], logged["name"], logged["tags"]) == (
        run_id,
        "lp-test",
        "tiny",
        ["a", "b"],
    )
    assert logged["config"]["grpo"]["steps"] == 2 and logged["config"]["out_dir"] == str(out)
    assert logged["config"]["metrics"]["wandb_tags"] == ["a", "b"]
    # every metrics row's numbers, under <phase>/<key> at <phase>/step
    rows = [r for r in read_metrics(out) if "reward_mean" in r]
    assert len(rows) == 2
    history = {(h["grpo/step"], h["grpo/reward_mean"]) for h in logged["history"] if "grpo/reward_mean" in h}
    assert history == {(r["step"], r["reward_mean"]) for r in rows}
    sft_loss = [h["sft/loss"] for h in logged["history"] if "sft/loss" in h]
    assert sft_loss == [r["loss"] for r in read_metrics(out) if r["phase"] == "sft" and "loss" in r]

    assert main(["train", "--resume", f"out_dir={out}", "grpo.steps=3"]) == 0
    first_run, resumed = sorted(offline.glob("offline-run-*"))
    assert first_run == first and resumed.name.endswith(f"-{run_id}")  # the same W&B run
    steps = [h["grpo/step"] for h in _offline_run(resumed)["history"] if "grpo/reward_mean" in h]
    assert steps == [3]  # the resume logs on from the checkpoint (grpo step 2)


def test_without_wandb_the_field_and_install_command_exit_2_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, as where it is not installed
    out = tmp_path / "run"
    assert main(["train", *TINY, "metrics.wandb=true", f"out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "loopline: metrics.wandb=true needs the wandb package: pip install 'loopline[wandb]' (or pip install wandb) "
        "(no module named 'wandb')"
    )
    assert not out.exists()
