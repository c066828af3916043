"""The pods' memory when the k8s section does not give it: estimated from the model's shape (the built-in tiny
model, or a model directory's config.json) and the roles each pod holds (loopline.k8s.memory, the stand-in for
`loopline plan`). Checked by order of magnitude, against the parameters torch counts, and by what must grow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopline.config import load_config
from loopline.errors import UserError
from loopline.k8s.memory import (
    BUILTIN_VOCAB,
    GIB,
    ModelShape,
    group_memory,
    head_memory,
    model_shape,
    role_rank_bytes,
)
from loopline.k8s.render import render
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer

# Qwen2.5-0.5B's shape (its config.json's numbers): 0.49B parameters with tied embeddings
QWEN_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
}


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi")
    return int(quantity[:-2])


def _head_memory(objects: list[dict]) -> str:
    head = objects[-1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["requests"]["memory"] == head["resources"]["limits"]["memory"]
    return head["resources"]["requests"]["memory"]


@pytest.fixture
def qwen(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    return tmp_path


def test_the_built_in_model_counts_as_torch_counts_it():
    cfg = load_config()
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer) == BUILTIN_VOCAB
    model = build_tiny_model(cfg.model.tiny, tokenizer, seed=0)
    assert model_shape(cfg).params == sum(p.numel() for p in model.parameters())


def test_a_qwen_05b_config_counts_049b_parameters(qwen):
    shape = model_shape(load_config(None, [f"model.path={qwen}"]))
    assert shape.params == pytest.approx(0.494e9, rel=0.01)
    untied = ModelShape(**{**shape.__dict__, "tied": False})
    assert untied.params - shape.params == 151936 * 896  # a head of its own


def test_the_default_job_asks_for_a_few_gib_not_a_fixed_8(capsys):
    memory = _gib(head_memory(load_config()))
    assert 2 <= memory <= 8  # the built-in model is ~0.8M parameters: the processes' overhead dominates
    assert _head_memory(render(load_config())) == f"{memory}Gi"


def test_a_05b_model_on_cpu_needs_tens_of_gib_and_far_less_on_gpu(qwen):
    cfg = load_config(None, [f"model.path={qwen}"])
    # fp32 weights + grads + Adam: 16 bytes x 0.49B = 7.4 GiB, plus a micro-batch's logits over 152k tokens
    actor = role_rank_bytes(cfg, "actor", gpu=False) / GIB
    assert 7.4 < actor < 60
    assert role_rank_bytes(cfg, "actor", gpu=True) / GIB == pytest.approx(1.84, rel=0.01)  # one fp32 copy
    assert 10 <= _gib(head_memory(cfg)) <= 100
    bf16 = load_config(None, [f"model.path={qwen}", "model.dtype=bfloat16"])
    assert role_rank_bytes(bf16, "rollout", gpu=True) == role_rank_bytes(cfg, "rollout", gpu=True) // 2


def test_what_must_grow_grows(qwen):
    base = [f"model.path={qwen}", "runtime.backend=ray"]
    cfg = load_config(None, base)
    more_rows = load_config(None, [*base, "grpo.prompts_per_step=512", "eval.batch_size=8"])
    assert role_rank_bytes(more_rows, "rollout", False) > role_rank_bytes(cfg, "rollout", False)
    vllm = load_config(None, [*base, "rollout.engine=vllm", "rollout.vllm.cpu_kv_cache_gib=20"])
    assert role_rank_bytes(vllm, "rollout", False) == role_rank_bytes(vllm, "rollout", True) + 20 * GIB
    sharded = load_config(
        None, [*base, "runtime.trainer_ranks=4", "grpo.micro_batch_size=1", "sft.micro_batch_size=1"]
    )
    one = load_config(None, [*base, "grpo.micro_batch_size=1", "sft.micro_batch_size=1"])
    assert role_rank_bytes(sharded, "actor", False) < role_rank_bytes(one, "actor", False) / 3
    kl = load_config(None, [*base, "grpo.kl_coef=0.01"])  # the reference joins the actor's pods
    assert _gib(group_memory(kl, "actor", 1, False)) > _gib(group_memory(cfg, "actor", 1, False))
    assert _gib(group_memory(cfg, "env", 1, False)) < 4  # env workers hold no model
    code = load_config(None, [*base, "env.name=code", "env.sandbox.memory_mb=4096"])
    assert _gib(group_memory(code, "env", 1, False)) >= 4 + _gib(
        group_memory(cfg, "env", 1, False)
    )  # a sandbox


def test_an_example_s_pools_get_estimates_where_the_config_gives_none():
    cfg = load_config("examples/k8s.yaml", ["k8s.head.memory=null"])
    groups = cfg.k8s.groups
    for name in groups:
        groups[name] = groups[name].model_copy(update={"memory": None})
    job = render(cfg)[-1]["spec"]["rayClusterSpec"]
    memory = {
        g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"]
        for g in job["workerGroupSpecs"]
    }
    # 8 GPU ranks a pod: the host holds the process overheads and a copy of the weights per rank
    assert all(8 <= _gib(m) <= 64 for m in memory.values()), memory
    assert _head_memory(render(cfg)) == head_memory(cfg)
    assert _head_memory(render(load_config("examples/k8s.yaml"))) == "32Gi"  # given: kept


def test_a_model_that_cannot_be_read_here_asks_for_the_memory_fields(tmp_path):
    cfg = load_config(None, ["model.path=/runs/x/model"])  # on the volume: no config.json here
    with pytest.raises(UserError, match=r"k8s.head.memory / k8s.groups.<pool>.memory: .* set them"):
        render(cfg)
    assert (
        _head_memory(render(load_config(None, ["model.path=/runs/x/model", "k8s.head.memory=20Gi"])))
        == "20Gi"
    )
