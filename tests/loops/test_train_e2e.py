"""The real `loopline` entry point for a few steps: weights change, metrics and curves are written,
the saved policy loads with transformers, and --resume continues where a run stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from loopline.cli import main
from loopline.config import load_config
from loopline.data.datasets import PromptRow
from loopline.loops.context import encode_prompt
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy

pytestmark = pytest.mark.slow

# The built-in default job on a tiny budget.
TINY = [
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=3", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.eval_every=0",
    "data.task.num_train=200", "data.task.num_eval=20", "eval.num_prompts=20",
    "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip
GRPO_KEYS = {
    "phase", "step", "reward_mean", "reward_std", "accuracy", "loss", "policy_loss", "kl", "entropy",
    "clip_fraction", "grad_norm", "lr", "response_len_mean", "response_len_max", "truncated_fraction",
    "rollout_tokens_per_s", "train_tokens_per_s",
    "time_rollout", "time_score", "time_experience", "time_train", "time_sync",
    "score_retries", "env_workers_replaced", "env_workers",  # the env pool: worker processes on local too
}  # fmt: skip


def _train(out_dir: Path, *extra: str, resume: bool = False) -> None:
    assert main(["train", *(["--resume"] if resume else []), *TINY, f"out_dir={out_dir}", *extra]) == 0


def _ckpt(run: Path, name: str) -> Path:
    return run / "checkpoints" / name


def _steps(run: Path, phase: str) -> list[int]:
    return [r["step"] for r in read_metrics(run) if r["phase"] == phase]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """SFT 3 steps, GRPO 3 steps, checkpoints at GRPO steps 2 and 3."""
    run = tmp_path_factory.mktemp("base") / "run"
    _train(run)
    return run


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    """The same job run to GRPO step 5 without interruption."""
    run = tmp_path_factory.mktemp("straight") / "run"
    _train(run, "grpo.steps=5")
    return run


def test_parameters_changed_from_the_initial_weights(base_run):
    cfg = load_config(base_run / "config.yaml")
    init, _ = load_policy(cfg.model, seed=cfg.seed)  # what the run started from
    trained = load_file(_ckpt(base_run, "grpo-000003") / "model" / "model.safetensors")
    changed = [k for k, v in init.state_dict().items() if k in trained and not torch.equal(trained[k], v)]
    assert len(changed) == len(trained), sorted(set(trained) - set(changed))  # every saved tensor moved
    # and the SFT checkpoint is a different point again
    sft = load_file(_ckpt(base_run, "sft-000003") / "model" / "model.safetensors")
    assert any(not torch.equal(sft[k], init.state_dict()[k]) for k in sft)


def test_metrics_rows_have_the_documented_keys(base_run):
    rows = read_metrics(base_run)
    assert [(r["phase"], r["step"]) for r in rows] == [
        ("sft", 0), ("sft", 1), ("sft", 2), ("sft", 3), ("grpo", 0), ("grpo", 1), ("grpo", 2), ("grpo", 3)
    ]  # fmt: skip
    for r in rows:
        if r["phase"] == "grpo" and r["step"] > 0:
            assert not GRPO_KEYS - r.keys(), GRPO_KEYS - r.keys()
            assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_std"] >= 0.0
            assert 0 < r["response_len_mean"] <= r["response_len_max"] <= 8  # grpo.sampling.max_new_tokens
            assert r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
            assert all(r[k] >= 0 for k in GRPO_KEYS if k.startswith("time_"))
            assert r["entropy"] > 0
        if r["phase"] == "sft" and r["step"] > 0:
            assert {"loss", "grad_norm", "lr", "tokens_per_s", "time_train"} <= r.keys()
    # held-out eval before SFT, at the end of SFT (= before RL) and at the end of RL
    evals = [(r["phase"], r["step"]) for r in rows if "eval_accuracy" in r]
    assert evals == [("sft", 0), ("sft", 3), ("grpo", 0), ("grpo", 3)]
    sft_losses = [r["loss"] for r in rows if r["phase"] == "sft" and "loss" in r]
    assert sft_losses[-1] < sft_losses[0]


def test_curves_and_config_are_written(base_run):
    png = base_run / "curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert load_config(base_run / "config.yaml").grpo.steps == 3


def test_saved_policy_loads_with_transformers(base_run):
    model_dir = _ckpt(base_run, "grpo-000003") / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ours, _ = load_policy(load_config(overrides=[f"model.path={model_dir}"]).model)
    ids = tok(["1+2=", "30+40="], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, ours(**ids).logits)
    assert (base_run / "checkpoints" / "latest").read_text().strip() == "grpo-000003"


def _check_resumed_like_straight(resumed: Path, straight: Path) -> None:
    # every step logged exactly once, in order, as in the uninterrupted run
    assert _steps(resumed, "sft") == _steps(straight, "sft") == [0, 1, 2, 3]
    assert _steps(resumed, "grpo") == _steps(straight, "grpo") == [0, 1, 2, 3, 4, 5]
    final_resumed = json.loads((_ckpt(resumed, "grpo-000005") / "state.json").read_text())
    final_straight = json.loads((_ckpt(straight, "grpo-000005") / "state.json").read_text())
    assert final_resumed == final_straight  # phase, step and sampler position
    assert final_resumed["sampler"]["position"] == 5 * 4  # 5 steps x 4 prompts, within the first epoch
    latest = (resumed / "checkpoints" / "latest").read_text().strip()
    assert latest == "grpo-000005"


def test_resume_with_more_steps_continues(base_run, straight_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    _train(run, "grpo.steps=5", resume=True)
    assert f"resumed from {_ckpt(run, 'grpo-000003')} (grpo step 3)" in capsys.readouterr().out
    _check_resumed_like_straight(run, straight_run)


def test_resume_after_a_crash_between_checkpoints(base_run, straight_run, tmp_path, capsys):
    # The run died after logging step 3 but before writing its checkpoint: the newest whole
    # checkpoint is step 2, and a half-written step-3 directory is left behind.
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    shutil.move(_ckpt(run, "grpo-000003"), _ckpt(run, ".tmp-grpo-000003"))
    (run / "checkpoints" / "latest").write_text("grpo-000002")
    _train(run, "grpo.steps=5", resume=True)
    assert "(grpo step 2)" in capsys.readouterr().out
    _check_resumed_like_straight(run, straight_run)


def test_resume_from_the_sft_checkpoint(base_run, straight_run, tmp_path, capsys):
    # The run died during RL before its first RL checkpoint: only the end-of-SFT checkpoint is whole.
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    for name in ("grpo-000002", "grpo-000003"):
        shutil.rmtree(_ckpt(run, name))
    (run / "checkpoints" / "latest").write_text("sft-000003")
    _train(run, "grpo.steps=5", resume=True)
    assert "(sft step 3)" in capsys.readouterr().out
    _check_resumed_like_straight(run, straight_run)


def test_plot_command_rewrites_curves(base_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    (run / "curves.png").unlink()
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "curves.png")
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fresh_run_in_a_used_directory_starts_new_metrics(base_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    _train(run, "grpo.steps=1", "sft.steps=1", "--overwrite")  # without it the used directory is refused
    steps = [(r["phase"], r["step"]) for r in read_metrics(run)]
    assert steps == [("sft", 0), ("sft", 1), ("grpo", 0), ("grpo", 1)]


@pytest.mark.parametrize(
    "variant",
    [
        [],
        # KL to the reference, two updates per rollout (old log-probs), per-sequence mean, micro-batches
        ["grpo.kl_coef=0.05", "grpo.epochs_per_step=2", "grpo.loss_agg=seq_mean", "grpo.micro_batch_size=4"],
    ],
    ids=["default", "kl_epochs"],
)
def test_grpo_updates_the_policy_when_rewards_differ(tmp_path, variant):
    # A jsonl task whose answer is always "7": after 8 SFT steps the policy says "7" about half the
    # time at temperature 1, so groups have mixed rewards, non-zero advantages and a real RL update.
    data = tmp_path / "sevens.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}:", "answer": "7"}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    _train(
        run, "data.source=jsonl", f"data.train_path={data}", f"data.eval_path={data}", "eval.num_prompts=8",
        "sft.steps=8", "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0", "grpo.steps=2", *variant,
    )  # fmt: skip
    rl = [r for r in read_metrics(run) if r["phase"] == "grpo" and r["step"] > 0]
    assert any(0.0 < r["reward_mean"] < 1.0 and r["grad_norm"] > 0 for r in rl)
    if variant:
        # step 2 samples from a policy that step 1 moved away from the reference; and the second
        # update of each step sees ratios != 1 against the first one's old log-probs
        assert rl[1]["kl"] > 0 and rl[1]["approx_kl"] > 0
    else:
        assert all(r["kl"] == 0 and r["approx_kl"] == 0 for r in rl)  # on-policy, no reference
    sft = load_file(_ckpt(run, "sft-000008") / "model" / "model.safetensors")
    rl_weights = load_file(_ckpt(run, "grpo-000002") / "model" / "model.safetensors")
    assert any(not torch.equal(sft[k], rl_weights[k]) for k in sft)


def test_chat_data_with_a_chat_template_model(tmp_path, small_model, tokenizer):
    # A local HF model directory whose tokenizer has a chat template, and chat-format rows with answers.
    tokenizer.save_pretrained(tmp_path / "model")
    small_model.save_pretrained(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    tok.save_pretrained(tmp_path / "model")
    rows_in = [
        {"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}],
         "answer": str(i + 1)}
        for i in range(20)
    ]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
    run = tmp_path / "run"
    _train(
        run, f"model.path={tmp_path / 'model'}", "model.use_chat_template=true", "data.source=jsonl",
        f"data.train_path={data}", f"data.eval_path={data}", "eval.num_prompts=4", "sft.steps=2", "grpo.steps=1",
    )  # fmt: skip
    assert _steps(run, "grpo") == [0, 1]
    rows = read_metrics(run)
    sft_rows = [r for r in rows if r["phase"] == "sft" and "loss" in r]
    assert [r["step"] for r in sft_rows] == [1, 2] and all(0 < r["loss"] < 10 for r in sft_rows)
    (rl,) = [r for r in rows if r["phase"] == "grpo" and r["step"] == 1]
    assert 0.0 <= rl["reward_mean"] <= 1.0 and rl["response_len_mean"] > 0 and rl["entropy"] > 0
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in rows if "eval_accuracy" in r)
    # the checkpoint is the trained model with the template's tokenizer: it renders a chat row the same way
    final = _ckpt(run, "grpo-000001") / "model"
    saved_tok = AutoTokenizer.from_pretrained(final)
    assert saved_tok.chat_template == tok.chat_template
    row = PromptRow(0, "", messages=tuple(rows_in[3]["messages"]))
    ids = encode_prompt(
        saved_tok, row, use_chat_template=load_config(run / "config.yaml").model.use_chat_template
    )
    assert saved_tok.decode(ids) == "<user>3+1=\n<assistant>"  # the assistant turn is what SFT teaches
    weights = load_file(final / "model.safetensors")
    initial = small_model.state_dict()
    assert any(not torch.equal(weights[k], initial[k]) for k in weights if k in initial)


def test_sft_eval_and_generate_commands(base_run, tmp_path, capsys):
    model_dir = _ckpt(base_run, "grpo-000003") / "model"
    small = [f"out_dir={tmp_path / 'x'}", "data.task.num_train=200", "data.task.num_eval=20", "threads=1"]
    assert main(["eval", f"model.path={model_dir}", "eval.num_prompts=5", *small]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == {"eval_accuracy", "eval_reward_mean", "eval_response_len"}
    assert 0.0 <= result["eval_accuracy"] <= 1.0
    assert (
        main(
            ["generate", f"model.path={model_dir}", "--prompt", "1+2=", "--prompt", "5+5=", "-n", "2", *small]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [row["prompt"] for row in lines] == ["1+2=", "1+2=", "5+5=", "5+5="]
    assert all(row["finish"] in ("stop", "length") for row in lines)
    sft_dir = tmp_path / "sft"
    sft_args = [
        "sft.steps=2",
        "sft.batch_size=4",
        "sft.micro_batch_size=4",
        "eval.num_prompts=4",
        "progress=false",
    ]
    assert main(["sft", *small[1:], f"out_dir={sft_dir}", *sft_args, "tensorboard=false"]) == 0
    assert AutoModelForCausalLM.from_pretrained(sft_dir / "model") is not None
    assert _steps(sft_dir, "sft") == [0, 1, 2]
