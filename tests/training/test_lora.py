"""LoRA: only adapters train, merged weights reproduce the adapted model, engines receive the merged weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loopline.checkpoint.dcp import read_full_state
from loopline.checkpoint.state import RunState
from loopline.cli import main
from loopline.config import LoRAConfig, load_config
from loopline.loops.context import build_context
from loopline.loops.grpo import train_grpo
from loopline.loops.sft import train_sft
from loopline.metrics.logger import read_metrics
from loopline.runtime.scorer import ScorerRole, Scores
from loopline.training.lora import MergedWeights, apply_lora, has_lora, merged_state_dict

LORA = LoRAConfig(r=4, alpha=8.0)


def test_only_adapters_train_and_merged_weights_reproduce_the_model(small_model):
    plain = {k: v.clone() for k, v in small_model.state_dict().items()}
    model = apply_lora(small_model, LORA)
    assert has_lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    merged = merged_state_dict(model)
    assert merged.keys() == plain.keys()
    assert all(torch.equal(merged[k], plain[k]) for k in plain)  # B starts at 0: no change yet
    with torch.no_grad():  # move every adapter as training would
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn_like(p))
    merged = merged_state_dict(model)
    q = "model.layers.0.self_attn.q_proj"
    layer = model.get_submodule(q)
    by_hand = (
        plain[f"{q}.weight"] + (8.0 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    torch.testing.assert_close(merged[f"{q}.weight"], by_hand)
    # a plain model holding the merged weights computes what the adapted model computes
    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(merged)
    ids = torch.randint(3, 259, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model.eval()(ids).logits, atol=1e-5, rtol=1e-5)


def test_merged_weights_copy_nothing_until_read_and_read_as_the_merged_state_dict(small_model):
    """The in-process sync's view: plain tensors are the live ones; an adapted weight is merged when read (a new
    tensor each read, so no second copy of the model is held), equal to merged_state_dict's."""
    model = apply_lora(small_model, LORA)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn_like(p))
    view, eager = MergedWeights(model), merged_state_dict(model)
    assert list(view) == list(eager) and len(view) == len(eager)
    live = {t.data_ptr() for t in model.state_dict().values()}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert view["model.embed_tokens.weight"].data_ptr() in live  # a plain weight: the model's own tensor
    assert view[q].data_ptr() not in live and view[q].data_ptr() != eager[q].data_ptr()
    assert all(torch.equal(view[k], eager[k]) for k in eager)
    with pytest.raises(KeyError):
        view["model.layers.0.self_attn.q_proj.lora_A.default.weight"]  # adapters are not engine weights


def test_bad_target_modules_name_the_field(small_model):
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        apply_lora(small_model, LoRAConfig(r=2, target_modules=["no_such_proj"]))


TINY = [
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.optim.warmup_steps=0",
    "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.eval_every=0",
    "grpo.optim.warmup_steps=0", "grpo.optim.lr=1e-2",
    "data.task.num_train=100", "data.task.num_eval=8", "eval.num_prompts=8", "checkpoint_every=0",
    "progress=false", "tensorboard=false", "threads=1", "model.lora.r=4",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip


class DigitScorer(ScorerRole):  # take_stats, resize: as the in-process scorer
    """Dense stub reward (the random model never solves the task): the fraction of digits in the text."""

    def score(self, texts: list[str], answers: list[str]) -> Scores:
        rewards = torch.tensor([sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts])
        return Scores(rewards, rewards == 1.0)


def test_lora_sft_and_grpo_train_adapters_only_and_the_engine_gets_the_merged_model(tmp_path):
    cfg = load_config(None, [*TINY, f"out_dir={tmp_path}"])
    ctx = build_context(cfg)
    ctx.scorer = DigitScorer()
    frozen = {n: p.clone() for n, p in ctx.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.clone() for n, p in ctx.model.named_parameters() if p.requires_grad}
    try:
        state = train_sft(ctx, RunState(), None)
        assert state.step == 3
        train_grpo(ctx, RunState(phase="grpo"))
        engine = ctx.rollout.group.call("weights")[0]  # the one engine's whole weights (close() stops it)
    finally:
        ctx.close()
    params = dict(ctx.model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())  # the base weights never moved
    assert all(not torch.equal(params[n], v) for n, v in adapters.items() if "lora_B" in n)  # adapters did
    merged = merged_state_dict(ctx.model)
    assert engine.keys() == merged.keys()
    assert all(torch.equal(engine[k], merged[k]) for k in merged)
    assert any(not torch.equal(merged[k], frozen[k.replace(".weight", ".base_layer.weight")])
               for k in merged if k.replace(".weight", ".base_layer.weight") in frozen)  # fmt: skip


@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_lora_commands_write_plain_models(tmp_path, command):
    extra = {"sft": [], "dpo": ["dpo.steps=2", "dpo.batch_size=4"], "rm": ["rm.steps=2", "rm.batch_size=4"]}
    small = ["preference.num_train=16", "preference.num_eval=8", "dpo.eval_every=0", "rm.eval_every=0"]
    assert main([command, *TINY, *small, *extra[command], f"out_dir={tmp_path}"]) == 0
    if command != "rm":
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # a plain HF model: no adapter keys
        assert not any("lora_" in k or "base_layer" in k for k in model.state_dict())


@pytest.mark.slow
def test_a_lora_run_stopped_and_resumed_ends_like_the_uninterrupted_one(tmp_path, capsys):
    """`loopline train --resume` of a LoRA run: the adapters (and their optimizer state) come back from the
    checkpoint, so 2 GRPO steps + a resume to 3 end bitwise where 3 straight steps end."""
    # a constant lr: a decaying schedule over grpo.steps=2 then 3 is not the straight run's schedule over 3
    args = [
        *TINY,
        "checkpoint_every=1",
        "grpo.entropy_coef=0.01",
        "deterministic=true",
        "grpo.optim.schedule=constant",
    ]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert main(["train", *args, "grpo.steps=3", f"out_dir={straight}"]) == 0
    assert main(["train", *args, "grpo.steps=2", f"out_dir={stopped}"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", *args, "grpo.steps=3", f"out_dir={stopped}"]) == 0
    assert "(grpo step 2)" in capsys.readouterr().out

    def weights(run, name):
        return load_file(run / "checkpoints" / name / "model" / "model.safetensors")

    final_straight, final_resumed = weights(straight, "grpo-000003"), weights(stopped, "grpo-000003")
    assert final_resumed.keys() == final_straight.keys()
    assert not any("lora_" in k or "base_layer" in k for k in final_resumed)  # merged, plain HF names
    for name, value in final_straight.items():
        assert torch.equal(final_resumed[name], value), name
    # the resumed step trained the adapters on: the merged weights moved from step 2's
    step2 = weights(stopped, "grpo-000002")
    assert any(not torch.equal(final_resumed[k], step2[k]) for k in step2)
    # and the adapters themselves are in the checkpoint (DCP), equal in both runs
    a, b = (read_full_state(run / "checkpoints" / "grpo-000003" / "dcp") for run in (straight, stopped))
    lora_a = {k: v for k, v in _flat(a).items() if "lora_" in k}
    assert lora_a and all(torch.equal(v, _flat(b)[k]) for k, v in lora_a.items())
    # the same rows (the stopped run also evaluated at its last step 2: eval keys and wall times left out)
    rows = [
        [{k: v for k, v in r.items() if not k.startswith(("time_", "eval_")) and not k.endswith("tokens_per_s")}
         for r in read_metrics(run) if r["phase"] == "grpo"]
        for run in (straight, stopped)
    ]  # fmt: skip
    assert rows[0] == rows[1]


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out
