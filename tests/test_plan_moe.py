"""`loopline plan` on mixtures of experts: total parameters for memory, active parameters (the top-k experts a token
goes through) for FLOPs, read from a preset's published shape."""

from __future__ import annotations

import pytest

from loopline.config import load_config
from loopline.plan import model_shape, phases, step_flops

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "preset, total, active",
    [
        ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),  # Qwen3-30B-A3B: "30.5B total, 3.3B activated"
        ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),  # Mixtral 8x7B: 46.7B, 12.9B per token
    ],
)
def test_moe_parameters_total_and_active(preset, total, active):
    cfg = load_config(overrides=["model.init=random", f"model.preset={preset}"])
    shape = model_shape(cfg)
    # exact but for q/k/v biases the plan counts and these models lack (Qwen3's q/k norms aside): < 1e-4
    assert shape.params == pytest.approx(total, rel=1e-4)
    assert shape.active_params == pytest.approx(active, rel=1e-4)
    (sft, grpo) = phases(cfg, "train", shape)
    flops = dict(step_flops(cfg, "train"))
    assert flops["sft train"] == 6.0 * shape.active_params * sft.step_rows * sft.seq


def test_dense_active_equals_total():
    shape = model_shape(load_config(overrides=["model.init=random", "model.preset=qwen2.5-0.5b"]))
    assert shape.active_params == shape.params
