"""Issue 13's safety net: a short default run (SFT then GRPO) and a short PPO run write exactly the metrics
rows and final weights recorded in `fixtures/identical_rows.json`.

The fixture is the behaviour of commit c6e0a6c, before issue 13 (one worker class per role in
loopline/runtime/roles.py). A refactor must leave every number bitwise equal (compared with ==, not approx):
deterministic mode on CPU, one thread, a fixed seed. Delete this test and its fixture once issue 13 has landed.

What is compared, per case:
  rows            every row of metrics.jsonl, less the wall-clock fields (names starting with `time_` and
                  ending with `_per_s`), as exact floats (JSON writes a float's repr, which reads back equal)
  policy_sha256   the policy's weights in the newest checkpoint (its dcp/ shards, gathered into one state
                  dict, so the hash does not depend on how many files or ranks wrote them): sha256 over each
                  tensor's name, dtype, shape and raw bytes, in sorted-name order
  critic_sha256   (PPO) the critic's weights, hashed the same way, from the checkpoint's critic/ shards (ray)
                  or loop.pt (local)

Both runs train on a tiny jsonl task whose answer is always "7" (as in test_train_e2e): after 8 SFT steps the
policy says it about half the time, so groups have mixed rewards and GRPO/PPO make real updates (on the
built-in arithmetic task a run this short scores 0, every advantage is 0 and RL would not move the weights).
The PPO case also has a KL penalty in the reward, so the reference policy and the critic both take part.

Bitwise numbers hold for one torch version on one kind of CPU (its kernels): on another machine, record the
fixture there from c6e0a6c first (the fixture names the torch it was recorded with). Re-record (only when a
change is meant to move the numbers, and never as part of issue 13):
    LOOPLINE_RECORD_FIXTURE=1 .venv/bin/python -m pytest tests/loops/test_identical_rows.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

FIXTURE = Path(__file__).parent / "fixtures" / "identical_rows.json"
RECORD = os.environ.get("LOOPLINE_RECORD_FIXTURE", "") not in ("", "0")
RECORDED_AT = "c6e0a6c"
RUN_TIMEOUT_S = 300  # one case takes ~15-20 s on an idle core

# The default job (built-in model, default config) on a tiny budget and the sevens task (written by _sevens).
BASE = [
    "sft.steps=8", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0",
    "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.eval_every=0",
    "eval.num_prompts=8", "progress=false", "tensorboard=false", "threads=1", "deterministic=true", "seed=0",
]  # fmt: skip
CASES = {
    "grpo": [],
    "ppo": ["grpo.advantage=gae", "grpo.kl_coef=0.05", "grpo.kl_in=reward"],
}


def _sevens(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}:", "answer": "7"}) + "\n" for i in range(40)))
    return path


def _train(run: Path, data: Path, extra: list[str]) -> None:
    cmd = [
        sys.executable, "-m", "loopline.cli", "train", *BASE, *extra,
        "data.source=jsonl", f"data.train_path={data}", f"data.eval_path={data}", f"out_dir={run}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_PAUSE")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def steady_rows(run: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without wall-clock measurements (those differ between any two runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [
        {k: v for k, v in r.items() if not k.startswith("time_") and not k.endswith("_per_s")} for r in rows
    ]


def weights_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name, dtype, shape and raw bytes, in sorted-name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _dcp_model(shards: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The "model" part of a DCP checkpoint directory, written by any number of ranks, as one state dict."""
    dcp_to_torch_save(shards, scratch)
    return torch.load(scratch, weights_only=False)["model"]


def final_weights(run: Path, scratch: Path) -> dict[str, str]:
    """{"policy_sha256": ..., and with a critic "critic_sha256": ...} of the run's newest checkpoint."""
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    out = {"policy_sha256": weights_sha256(_dcp_model(ckpt / "dcp", scratch / "policy.pt"))}
    if (ckpt / "critic" / ".metadata").exists():  # the ray critic's shards
        out["critic_sha256"] = weights_sha256(_dcp_model(ckpt / "critic", scratch / "critic.pt"))
    elif (ckpt / "loop.pt").exists():
        loop = torch.load(ckpt / "loop.pt", weights_only=False)
        if "critic" in loop:  # the local critic's whole state
            out["critic_sha256"] = weights_sha256(loop["critic"]["model"])
    return out


def _record(case: str, entry: dict[str, Any]) -> None:
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    fixture["recorded_at"] = RECORDED_AT
    fixture["torch"] = torch.__version__
    fixture.setdefault("cases", {})[case] = entry
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_and_weights_equal_the_pre_refactor_fixture(case, tmp_path):
    run = tmp_path / "run"
    _train(run, _sevens(tmp_path / "sevens.jsonl"), CASES[case])
    got = {"args": BASE + CASES[case], "rows": steady_rows(run), **final_weights(run, tmp_path)}
    if RECORD:
        _record(case, got)
    fixture = json.loads(FIXTURE.read_text())
    expected = fixture["cases"][case]
    if fixture["torch"] != torch.__version__:  # not a failure by itself, but the likely cause of one
        print(f"the fixture was recorded with torch {fixture['torch']}, this is {torch.__version__}")
    # the fixture was recorded with these arguments: editing one without re-recording is a mistake
    assert got["args"] == expected["args"]
    rows, want = got["rows"], expected["rows"]
    assert [(r["phase"], r["step"]) for r in rows] == [(r["phase"], r["step"]) for r in want]
    for row, ref in zip(rows, want, strict=True):
        differ = {k: (row.get(k), ref.get(k)) for k in row.keys() | ref.keys() if row.get(k) != ref.get(k)}
        assert not differ, f"{row['phase']} step {row['step']}: (now, recorded) {differ}"
    assert got["policy_sha256"] == expected["policy_sha256"], "the policy's final weights differ"
    assert got.get("critic_sha256") == expected.get("critic_sha256"), "the critic's final weights differ"
    if case == "ppo":
        assert "critic_sha256" in expected
