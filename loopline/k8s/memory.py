"""How much memory a run's pods ask for when the k8s section does not say: an estimate from the model's shape and
the roles each pod holds. A stand-in until `loopline plan` (memory per role) exists; that plan will replace it.

The sum, per pod: a fixed overhead per Python process (torch and transformers imported, the allocator's slack),
plus per rank on a CPU pod a trainer's weights, gradients and Adam's two moments (sharded over the trainer ranks,
as FSDP2 shards them) and one micro-batch's logits; an engine's weights and the KV cache of its rows; a
reference's or reward model's weights; an env worker of the code env its sandbox's memory cap. On a GPU pod the model lives in GPU memory and the host keeps one copy of
the weights (loading, the checkpoint's whole-model gather). Then HEADROOM over the sum, rounded up to a GiB.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loopline.config import RunConfig
from loopline.errors import UserError

GIB = 2**30
# A Python process with torch and transformers imported. Measured here (2026-12-04): the default job's whole process
# tree peaked at 0.63 GiB RSS on the local backend (two processes), 2.42 GiB on ray (driver, GCS, raylet, dashboard,
# three actors and Ray's idle workers); 1 GiB leaves room for allocator slack and larger tokenizers.
PROCESS_OVERHEAD = 1 * GIB
RAY_HEAD_OVERHEAD = 1 * GIB  # the head node's GCS, raylet and dashboard agent
RAY_NODE_OVERHEAD = GIB // 2  # a worker node's raylet
HEADROOM = 1.25  # over the estimate: fragmentation, Ray's object store in /dev/shm, what the sum leaves out
BUILTIN_VOCAB = 259  # the built-in byte tokenizer: 256 bytes + pad, bos, eos
DEFAULT_PROMPT_TOKENS = 256  # prompt length assumed when data.max_prompt_tokens and data.max_seq_len are 0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINER_ROLES = ("actor", "critic")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only transformer."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    max_positions: int
    tied: bool = True
    experts: int = 1  # MoE: MLPs per layer

    @property
    def params(self) -> int:
        """Parameters: embeddings (and an untied head), per layer attention (q, k, v with biases, o), the MLP's
        three projections per expert, two norms, and the final norm."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q + 2 * kv + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate * self.experts
        layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * layer + self.hidden


def model_shape(cfg: RunConfig) -> ModelShape:
    """The policy's shape: model.tiny for the built-in model, else model.path's config.json (it must be readable
    here: UserError naming the k8s fields to set otherwise)."""
    m = cfg.model
    if not m.path:
        t = m.tiny
        return ModelShape(
            t.hidden_size,
            t.num_layers,
            BUILTIN_VOCAB,
            t.intermediate_size,
            t.num_heads,
            t.num_kv_heads,
            t.hidden_size // t.num_heads,
            t.max_position_embeddings,
        )
    path = Path(m.path) / "config.json"
    try:
        c = json.loads(path.read_text())
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return ModelShape(
            hidden=hidden,
            layers=int(c["num_hidden_layers"]),
            vocab=int(c["vocab_size"]),
            intermediate=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            max_positions=int(c.get("max_position_embeddings") or 4096),
            tied=bool(c.get("tie_word_embeddings", False)),
            experts=int(c.get("num_experts") or c.get("num_local_experts") or 1),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"k8s.head.memory / k8s.groups.<pool>.memory: the pods' memory is estimated from the model, and "
            f"{path} cannot be read here ({type(e).__name__}: {e}); set them (e.g. k8s.head.memory=32Gi)"
        ) from None


def _seq_len(cfg: RunConfig, shape: ModelShape) -> int:
    if cfg.data.max_seq_len:
        return min(cfg.data.max_seq_len, shape.max_positions)
    prompt = cfg.data.max_prompt_tokens or DEFAULT_PROMPT_TOKENS
    return min(prompt + cfg.grpo.sampling.max_new_tokens, shape.max_positions)


def role_rank_bytes(cfg: RunConfig, role: str, gpu: bool) -> int:
    """Host memory of one rank of `role` besides its process's overhead."""
    shape = model_shape(cfg)
    width = DTYPE_BYTES[cfg.model.dtype]
    weights = shape.params * width
    if (
        role == "env"
    ):  # no model; env.name=code runs each program in a sandbox capped at env.sandbox.memory_mb
        return cfg.env.sandbox.memory_mb * 2**20 if cfg.env.name == "code" else 0
    if gpu:
        return weights  # the model is on the GPU; the host stages one copy of the weights
    seq = _seq_len(cfg, shape)
    ranks = cfg.runtime.trainer_ranks
    if role in TRAINER_ROLES:
        state = weights * 4 // ranks  # weights, gradients, Adam's two moments, sharded over the trainer ranks
        rows = max(cfg.grpo.micro_batch_size, cfg.sft.micro_batch_size)
        logits = rows * seq * shape.vocab * 4 * 2  # float32 logits and their gradient
        return state + logits
    if role == "rollout":
        batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
        rows = cfg.runtime.engine_max_rows or math.ceil(batch / cfg.runtime.engines)
        rows = max(rows, cfg.eval.batch_size)
        kv = rows * seq * shape.layers * 2 * shape.kv_heads * shape.head_dim * width
        if cfg.rollout.engine == "vllm":  # vLLM on CPU reserves a KV cache of its own size, whatever the rows
            kv = cfg.rollout.vllm.cpu_kv_cache_gib * GIB
        return weights + kv
    # ref and reward: frozen weights (the reference sharded like the actor), a forward's logits
    rows = max(cfg.grpo.micro_batch_size, cfg.reward.batch_size if role == "reward" else 0)
    return weights // (ranks if role == "ref" else 1) + rows * seq * shape.vocab * 4


def pod_memory_bytes(
    cfg: RunConfig, ranks: dict[str, int], processes: int, gpu: bool, ray_overhead: int
) -> int:
    """Estimated memory of a pod holding `ranks` (role -> ranks on this pod) in `processes` Python processes."""
    total = processes * PROCESS_OVERHEAD + ray_overhead
    total += sum(n * role_rank_bytes(cfg, role, gpu) for role, n in ranks.items())
    return total


def quantity(nbytes: int) -> str:
    """Bytes with HEADROOM, rounded up to a whole GiB, as a Kubernetes quantity."""
    return f"{max(1, math.ceil(nbytes * HEADROOM / GIB))}Gi"


def _wanted(cfg: RunConfig) -> list[str]:
    """The model roles a run has besides actor and rollout."""
    roles = []
    if cfg.grpo.advantage == "gae":
        roles.append("critic")
    if cfg.grpo.kl_coef > 0 or cfg.dpo.reference == "online":
        roles.append("ref")
    if cfg.reward.source != "verifier":
        roles.append("reward")
    return roles


def head_memory(cfg: RunConfig) -> str:
    """The head pod's memory, estimated (the stand-in until `loopline plan` gives memory per role): on the local
    backend the whole run (one process with every model role, and the env worker processes); on ray the driver
    and Ray's head services."""
    if cfg.runtime.backend == "ray":
        return quantity(PROCESS_OVERHEAD + RAY_HEAD_OVERHEAD)
    ranks = {r: 1 for r in ("actor", "rollout", *_wanted(cfg))}
    gpu = cfg.k8s.head.gpu > 0
    return quantity(pod_memory_bytes(cfg, ranks, 1 + cfg.runtime.env_workers, gpu, RAY_HEAD_OVERHEAD))


def group_memory(cfg: RunConfig, pool: str, per_pod: int, gpu: bool) -> str:
    """A worker group's pod memory, estimated (the stand-in until `loopline plan` gives memory per role): the ranks
    of each role on `pool` that one pod holds (one per bundle), the critic and reference beside the actor unless
    placed elsewhere."""
    placement = cfg.runtime.pools()
    roles = list(placement.roles_on(pool))
    if "actor" in roles:
        roles += [r for r in _wanted(cfg) if r not in placement.roles and r != "reward"]
    rt = cfg.runtime
    total = {"actor": rt.trainer_ranks, "rollout": rt.engines, "env": rt.env_workers}
    ranks = {r: min(per_pod, total.get(r, rt.trainer_ranks)) for r in roles}
    return quantity(pod_memory_bytes(cfg, ranks, sum(ranks.values()), gpu, RAY_NODE_OVERHEAD))
