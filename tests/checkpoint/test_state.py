"""Checkpoints: whole-or-nothing directories, a `latest` pointer, pruning, and exact reloads."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from loopline.checkpoint.state import (
    RunState,
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from loopline.models.load import build_tiny_model


def _save(run_dir, model, tokenizer, phase, step, keep_last=3):
    state = RunState(phase=phase, step=step, sampler={"epoch": 0, "position": step, "size": 10, "seed": 1})
    return save_checkpoint(run_dir, state, model, tokenizer, {"step": step}, keep_last=keep_last)


def test_save_then_load_restores_everything(tmp_path, small_model, tokenizer, small_cfg):
    with torch.no_grad():
        small_model.model.norm.weight.add_(0.5)  # differ from a fresh init
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    expected_rng = rng_state()
    path = _save(tmp_path, small_model, tokenizer, "grpo", 4)
    assert path.name == "grpo-000004"
    assert json.loads((path / "state.json").read_text())["step"] == 4

    fresh = build_tiny_model(small_cfg, tokenizer, seed=1)
    state, trainer_state, rng = load_checkpoint(path, fresh)
    assert state == RunState("grpo", 4, {"epoch": 0, "position": 4, "size": 10, "seed": 1})
    assert trainer_state == {"step": 4}
    for name, tensor in small_model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied

    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    set_rng_state(rng)
    assert torch.equal(torch.get_rng_state(), expected_rng["torch"])
    assert (random.random(), np.random.rand()) == (
        random.Random(12).random(),
        np.random.RandomState(13).rand(),
    )


def test_latest_points_at_the_newest_whole_checkpoint(tmp_path, small_model, tokenizer):
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, small_model, tokenizer, "sft", 3)
    assert latest_checkpoint(tmp_path).name == "sft-000003"
    _save(tmp_path, small_model, tokenizer, "grpo", 2)
    assert latest_checkpoint(tmp_path).name == "grpo-000002"


def test_leftover_tmp_dir_is_ignored_then_replaced(tmp_path, small_model, tokenizer):
    _save(tmp_path, small_model, tokenizer, "grpo", 2)
    # a crash while writing step 4 leaves a half-written temporary directory behind
    half = checkpoint_root(tmp_path) / ".tmp-grpo-000004"
    (half / "model").mkdir(parents=True)
    (half / "state.json").write_text('{"phase": "grpo", "step": 4')
    assert latest_checkpoint(tmp_path).name == "grpo-000002"
    # it does not count as a checkpoint for pruning either
    for step in (3, 5):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=2)
    names = sorted(p.name for p in checkpoint_root(tmp_path).iterdir() if p.is_dir())
    assert names == [".tmp-grpo-000004", "grpo-000003", "grpo-000005"]
    # and writing that step again starts from a clean temporary directory
    path = _save(tmp_path, small_model, tokenizer, "grpo", 4, keep_last=5)
    assert not half.exists()
    assert json.loads((path / "state.json").read_text())["step"] == 4


def test_keep_last_keeps_the_newest(tmp_path, small_model, tokenizer):
    _save(tmp_path, small_model, tokenizer, "sft", 600)
    for step in range(1, 6):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=3)
    names = sorted(p.name for p in checkpoint_root(tmp_path).iterdir() if p.is_dir())
    # SFT comes before RL: the three newest are the last three RL checkpoints
    assert names == ["grpo-000003", "grpo-000004", "grpo-000005"]
    assert latest_checkpoint(tmp_path).name == "grpo-000005"


def test_keep_last_zero_keeps_everything(tmp_path, small_model, tokenizer):
    for step in range(1, 5):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=0)
    assert len([p for p in checkpoint_root(tmp_path).iterdir() if p.is_dir()]) == 4


def test_checkpoint_model_dir_loads_with_transformers(tmp_path, small_model, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _save(tmp_path, small_model, tokenizer, "grpo", 1)
    model = AutoModelForCausalLM.from_pretrained(path / "model")
    tok = AutoTokenizer.from_pretrained(path / "model")
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, small_model.eval()(input_ids=ids).logits)
