"""The scaled-down Qwen3-MoE preset (128 experts, 8 per token) through every command on the local backend: `train`
(SFT, then PPO: the critic is built from the MoE body) with the load-balancing loss and routing replay on, its
router metrics in metrics.jsonl, TensorBoard and the curves; `export`; `eval` and `generate`; `dpo` and `rm` from
the exported directory (model.path)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loopline.cli import main
from loopline.config import ModelConfig
from loopline.metrics.keys import declared
from loopline.metrics.logger import read_metrics
from loopline.models.load import load_policy
from tests.conftest import need_module

pytestmark = pytest.mark.e2e

SMALL = [
    "progress=false", "threads=1", "data.task.num_train=32", "data.task.num_eval=4", "data.task.num_val=4",
    "eval.num_prompts=4", "eval.sampling.max_new_tokens=6", "preference.num_train=8",
]  # fmt: skip
MOE = ["model.init=random", "model.preset=qwen3-moe-tiny"]
ROUTER = {"router_cv", "router_aux_loss", "router_cv_layer0", "router_cv_layer1", "router_aux_loss_layer1"}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """The trained BPE tokenizer goes to a cache of the session's own, never the user's ~/.cache."""
    monkeypatch.setenv("LOOPLINE_CACHE", str(tmp_path_factory.getbasetemp() / "loopline-cache"))


def test_moe_preset_through_every_command(tmp_path, capsys):
    run, exported = tmp_path / "run", tmp_path / "exported"
    train = [
        *MOE, *SMALL, f"out_dir={run}", "model.router_aux_loss_coef=0.01", "grpo.advantage=gae",
        "grpo.routing_replay=true",
        "sft.steps=1", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
        "grpo.steps=1", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=2",
        "grpo.micro_batch_size=4", "grpo.eval_every=0", "grpo.sampling.max_new_tokens=6",
    ]  # fmt: skip
    assert main(["train", *train]) == 0
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["phase"] for r in rows] == ["sft", "grpo"]
    for row in rows:  # router metrics in every training phase, declared keys, sane values
        assert row.keys() >= ROUTER and all(declared(k) for k in row)
        assert 0 < row["router_cv"] < 128**0.5 and row["router_aux_loss"] > 0
    assert "value_loss" in rows[1]  # PPO's critic trained on the MoE body
    # the engine's routes reached the trainer: replayed, and its own router's disagreement with them counted
    assert "route_mismatch" not in rows[0] and 0 <= rows[1]["route_mismatch"] <= 1
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"
    need_module("tensorboard", "tensorboard is not installed (pip install loopline[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"sft/router_cv", "grpo/router_aux_loss_layer1"} <= set(events.Tags()["scalars"])

    assert main(["export", str(run), str(exported)]) == 0
    trained = AutoModelForCausalLM.from_pretrained(exported)
    start, _ = load_policy(ModelConfig(init="random", preset="qwen3-moe-tiny"), seed=0)
    assert type(trained).__name__ == "Qwen3MoeForCausalLM"
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        assert not torch.equal(start.get_parameter(name), trained.get_parameter(name))
    capsys.readouterr()
    assert main(["eval", str(run), *SMALL]) == 0
    assert '"eval_accuracy"' in capsys.readouterr().out
    assert main(["generate", f"model.path={exported}", "--prompt", "1+2=", "threads=1"]) == 0
    assert capsys.readouterr().out.strip()

    pref = [f"model.path={exported}", *SMALL, "tensorboard=false", "sft.steps=0"]
    assert main(["dpo", *pref, f"out_dir={tmp_path / 'dpo'}", "dpo.steps=1", "dpo.batch_size=4",
                 "dpo.micro_batch_size=2", "dpo.eval_every=0"]) == 0  # fmt: skip
    (dpo,) = [r for r in read_metrics(tmp_path / "dpo") if r["phase"] == "dpo" and "loss" in r]
    assert dpo.keys() >= ROUTER
    assert main(["rm", *pref, f"out_dir={tmp_path / 'rm'}", "rm.steps=1", "rm.batch_size=4",
                 "rm.micro_batch_size=2", "rm.eval_every=0"]) == 0  # fmt: skip
    assert (tmp_path / "rm" / "reward_model" / "head.safetensors").is_file()
