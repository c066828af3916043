"""`loopline bench step`: a few GRPO steps of the default job, split by stage, with the framework's share."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForCausalLM

from loopline.bench.step import STAGES, ComputeClock, main
from loopline.models.load import build_byte_tokenizer, build_tiny_model
from tests.conftest import SMALL


@pytest.mark.e2e  # GRPO steps of the default job (the rest of this module: unit)
def test_bench_step_splits_a_step_by_stage_and_ends_with_the_framework_share(capsys):
    small = [f"model.tiny.{k}={v}" for k, v in SMALL.model_dump().items() if k != "max_position_embeddings"]
    args = ["--steps", "4", *small, "grpo.prompts_per_step=4", "grpo.group_size=2", "threads=1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert not any("held-out accuracy" in line for line in lines)  # the job's own report stays out
    values = {k: v.split()[0] for k, v in (line.split(": ", 1) for line in lines)}
    assert values["steps_measured"] == "2"
    assert all(float(values[f"{stage}_ms"]) >= 0 for stage in STAGES) and float(values["train_ms"]) > 0
    share = float(values["framework_share"].rstrip("%"))
    assert 0 < share < 100 and lines[-1].startswith("framework_share: ")


def test_the_compute_clock_counts_forwards_backwards_and_optimizer_steps_once():
    model = build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = ComputeClock()
    with clock.installed(Qwen2ForCausalLM):
        model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
        opt.step()
    assert all(v > 0 for v in clock.seconds.values()), clock.seconds
    before = dict(clock.seconds)
    model(input_ids=torch.tensor([[1, 5, 6]]))  # uninstalled: not counted
    assert clock.seconds == before and Qwen2ForCausalLM.forward.__name__ == "forward"
