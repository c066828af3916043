"""`loopline dpo` and `loopline rm` through the real entry point on a tiny budget."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy
from loopline.training.critic import ScalarModel
from tests.runs import kill_at, steady

TINY = [
    "sft.steps=4", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "data.task.num_train=100", "data.task.num_eval=12", "eval.num_prompts=12", "preference.num_train=32",
    "progress=false", "tensorboard=false", "threads=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip
DPO = [
    "dpo.steps=3",
    "dpo.batch_size=8",
    "dpo.micro_batch_size=4",
    "dpo.eval_every=0",
    "dpo.optim.warmup_steps=0",
]


def _dpo(tmp_path, name: str, *extra: str):
    out = tmp_path / name
    assert main(["dpo", *TINY, *DPO, f"out_dir={out}", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory) -> tuple[Path, str]:
    """One default DPO run (reference precomputed) and what it printed, for the tests that read it."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = _dpo(tmp_path_factory.mktemp("dpo"), "pre")
    return out, printed.getvalue()


def test_dpo_trains_the_policy_and_logs_preference_metrics(dpo_run):
    out, printed = dpo_run
    assert "held-out implicit-reward preference accuracy: before DPO 0.0%" in printed  # policy = reference
    rows = [r for r in read_metrics(out) if r["phase"] == "dpo"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {"eval_pref_accuracy", "eval_logp_accuracy", "eval_reward_margin", "eval_accuracy"} <= rows[
        0
    ].keys()
    assert {"loss", "pref_accuracy", "reward_margin", "chosen_reward", "rejected_reward"} <= rows[1].keys()
    assert rows[1]["pref_loss"] == pytest.approx(0.6931, abs=1e-3)  # the first step: policy = reference
    assert rows[1]["loss"] == pytest.approx(
        rows[1]["pref_loss"] + rows[1]["chosen_nll"], rel=1e-5
    )  # nll_coef 1
    # the saved policy loads with transformers and differs from the end of SFT
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    sft = load_file(out / "checkpoints" / "sft-000004" / "model" / "model.safetensors")
    assert any(not torch.equal(v, sft[k]) for k, v in trained.state_dict().items() if k in sft)


def test_dpo_reference_online_matches_precomputed(dpo_run, tmp_path):
    pre = read_metrics(dpo_run[0])
    online = read_metrics(_dpo(tmp_path, "online", "dpo.reference=online"))
    assert [(r["phase"], r["step"]) for r in online] == [(r["phase"], r["step"]) for r in pre]
    assert len([r for r in pre if r["phase"] == "dpo"]) == 4  # eval row 0 and 3 steps
    for a, b in zip(pre, online, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if k not in ("phase", "tokens_per_s") and not k.startswith("time_"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_dpo_from_jsonl_pairs(tmp_path):
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [
        "preference.source=jsonl",
        f"preference.train_path={path}",
        f"preference.eval_path={path}",
        "dpo.loss=ipo",
    ]
    logged = read_metrics(_dpo(tmp_path, "jsonl", *extra))
    assert logged[-1]["phase"] == "dpo" and logged[-1]["step"] == 3 and "eval_pref_accuracy" in logged[-1]


def test_rm_trains_a_reward_model_that_reloads(tmp_path, capsys):
    out = tmp_path / "rm"
    rm = [
        "rm.steps=4",
        "rm.batch_size=8",
        "rm.micro_batch_size=4",
        "rm.eval_every=2",
        "rm.optim.warmup_steps=0",
    ]
    assert main(["rm", *TINY, *rm, f"out_dir={out}"]) == 0
    assert (
        "held-out pairwise accuracy: before 50.0%" in capsys.readouterr().out
    )  # a zero head ties every pair
    rows = [r for r in read_metrics(out) if r["phase"] == "rm"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval_pair_accuracy" in r] == [0, 2, 4]
    model = ScalarModel.load(out / "reward_model")
    assert model.head.weight.abs().sum() > 0  # the head trained
    sft = load_file(out / "checkpoints" / "sft-000004" / "model" / "model.safetensors")
    assert {f"model.{k}" for k in model.body.state_dict()} == set(sft) - {"lm_head.weight"}

    # the body starts as the SFT'd policy's body, value for value: with no RM step it is saved unchanged
    untrained = tmp_path / "rm0"
    assert main(["rm", *TINY, "rm.steps=0", "rm.eval_every=0", f"out_dir={untrained}"]) == 0
    start = ScalarModel.load(untrained / "reward_model")
    sft = load_file(untrained / "checkpoints" / "sft-000004" / "model" / "model.safetensors")
    cfg = load_config(out / "config.yaml")
    initial = load_policy(cfg.model, seed=cfg.seed)[0].base_model.state_dict()
    for name, value in start.body.state_dict().items():
        assert torch.equal(value, sft[f"model.{name}"]), name
    # (and SFT had moved it: not the freshly initialised body)
    assert any(not torch.equal(v, initial[k]) for k, v in start.body.state_dict().items())
    assert (
        float(start.head.weight.detach().abs().sum()) == 0.0
    )  # a zero head: every pair tied before training


def test_rm_on_the_policys_own_wrong_samples(tmp_path):
    out = tmp_path / "rm"
    rm = ["rm.steps=2", "rm.batch_size=8", "rm.eval_every=0", "preference.rejected=policy"]
    assert main(["rm", *TINY, *rm, "preference.policy_samples=3", f"out_dir={out}"]) == 0
    rows = [r for r in read_metrics(out) if r["phase"] == "rm"]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval_pair_accuracy" in rows[-1]
    # the pairs themselves: the SFT'd policy's samples, at most 3 distinct wrong ones per prompt
    from loopline.loops.context import build_context
    from loopline.loops.preference import sample_policy_pairs

    cfg = load_config(out / "config.yaml", [f"out_dir={tmp_path / 'pairs'}", "sft.steps=0"])
    ctx = build_context(cfg)
    try:
        pairs = sample_policy_pairs(ctx, ctx.train_rows[:8], seed=0)
    finally:
        ctx.close()
    assert 8 <= len(pairs) <= 24 and [p.index for p in pairs] == list(range(len(pairs)))
    answers = {r.prompt: r for r in ctx.train_rows[:8]}
    for p in pairs:
        assert p.chosen == answers[p.prompt].completion
        assert p.rejected.split("\n")[0].strip() != answers[p.prompt].answer  # the verifier's "wrong"


def test_preference_commands_check_their_config(tmp_path, capsys):
    assert main(["rm", *TINY, "data.source=jsonl", "data.train_path=x.jsonl", f"out_dir={tmp_path}"]) == 2
    assert "preference.source 'builtin' needs data.source 'builtin'" in capsys.readouterr().err
    assert main(["dpo", *TINY, "dpo.loss=nope", f"out_dir={tmp_path}"]) == 2
    assert "dpo.loss" in capsys.readouterr().err
    assert main(["rm", *TINY, "preference.source=jsonl", "preference.train_path=p.jsonl",
                 "preference.rejected=policy", f"out_dir={tmp_path}"]) == 2  # fmt: skip
    assert "rejected 'policy' needs source 'builtin'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "reference, kills", [("precomputed", ["step:sft:2", "step:dpo:2"]), ("online", ["step:dpo:2"])]
)
def test_dpo_killed_in_its_warm_start_and_in_dpo_resumes_to_the_uninterrupted_end(tmp_path, reference, kills):
    """`loopline dpo` SIGKILLed in its SFT warm start, resumed, SIGKILLed again in DPO, resumed to the end (online:
    killed in DPO only): the same weights (bytes), optimizer shards and metrics rows as a run never interrupted. The pairs are the policy's own
    samples (preference.rejected=policy): a resumed DPO must train on the pairs it started with, which it reads
    from the checkpoint with their reference log-probs (online: the frozen reference's shards)."""
    args = [
        *TINY, *DPO, "dpo.steps=4", "dpo.eval_every=2", "preference.rejected=policy", "preference.num_train=16",
        f"dpo.reference={reference}", "checkpoint_every=1", "deterministic=true",
    ]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["dpo", *args, f"out_dir={whole}"]) == 0
    cmd = [sys.executable, "-m", "loopline.cli", "dpo", *args, f"out_dir={killed}"]
    for i, point in enumerate(kills):  # each kill lands after its step's row, before that step's checkpoint
        kill_at([*cmd[:4], *(["--resume"] if i else []), *cmd[4:]], point, tmp_path / "markers", 180)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "dpo-000001"
    assert main(["dpo", "--resume", f"out_dir={killed}"]) == 0  # the README's form: out_dir alone
    for name in ("model/model.safetensors", "dcp/__0_0.distcp"):
        assert (killed / "checkpoints" / "dpo-000004" / name).read_bytes() == (
            whole / "checkpoints" / "dpo-000004" / name
        ).read_bytes(), name
    assert steady(read_metrics(killed)) == steady(read_metrics(whole))
    assert (killed / "model" / "model.safetensors").read_bytes() == (
        whole / "model" / "model.safetensors"
    ).read_bytes()


def test_dpo_resume_refuses_another_commands_run(tmp_path, capsys):
    """A `loopline train` run's checkpoints are not DPO's to continue (nor a DPO run's train's)."""
    run = tmp_path / "train"
    assert main(["train", *TINY, "sft.steps=2", "grpo.steps=1", "grpo.prompts_per_step=4", "grpo.group_size=2",
                 "grpo.micro_batch_size=8", f"out_dir={run}"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["dpo", "--resume", f"out_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "is of phase 'grpo'" in err, err


def test_rm_killed_in_its_warm_start_and_in_rm_resumes_to_the_uninterrupted_end(tmp_path):
    """`loopline rm` SIGKILLed in its SFT warm start, resumed, SIGKILLed again between an RM step's row and its
    checkpoint, resumed to the end: the same reward model (bytes) and metrics rows as a run never interrupted. The
    pairs are the policy's own samples (preference.rejected=policy): a resumed phase reads them from loop.pt, and
    the reward model's weights, AdamW state and LR schedule from the checkpoint's reward/ shards."""
    args = [
        *TINY, "rm.steps=4", "rm.batch_size=8", "rm.micro_batch_size=4", "rm.eval_every=2",
        "preference.rejected=policy", "preference.num_train=16", "checkpoint_every=1", "deterministic=true",
    ]  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["rm", *args, f"out_dir={whole}"]) == 0
    assert (whole / "checkpoints" / "rm-000004" / "reward" / ".metadata").is_file()
    cmd = [sys.executable, "-m", "loopline.cli", "rm", *args, f"out_dir={killed}"]
    for i, point in enumerate(["step:sft:2", "step:rm:2"]):  # after the step's row, before its checkpoint
        kill_at([*cmd[:4], *(["--resume"] if i else []), *cmd[4:]], point, tmp_path / "markers", 180)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "rm-000001"
    assert main(["rm", "--resume", f"out_dir={killed}"]) == 0
    assert steady(read_metrics(killed)) == steady(read_metrics(whole))
    assert (killed / "reward_model" / "model.safetensors").read_bytes() == (
        whole / "reward_model" / "model.safetensors"
    ).read_bytes()
