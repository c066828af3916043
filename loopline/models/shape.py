"""A decoder-only transformer's shape from a model config alone (no torch, nothing read but a config.json): its
parameter counts (all, active per token, LoRA adapters) and the floats a layer keeps for backward, which the
memory plan (loopline.plan) and the pods' memory (loopline.k8s) are computed from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loopline.errors import UserError
from loopline.models.config import ModelConfig, shape_fields

BUILTIN_VOCAB = 259  # the built-in byte tokenizer: 256 bytes + pad, bos, eos


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder-only transformer."""

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
    experts_per_token: int = 1  # MoE: the MLPs each token goes through (top-k)

    @property
    def params(self) -> int:
        """Parameters: embeddings (and an untied head), per layer attention (q, k, v with biases, o), the MLP's
        three projections per expert (and an MoE layer's router), two norms, and the final norm."""
        return self._count(self.experts)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: params with an MoE layer's top-k experts only (= params if dense)."""
        return self._count(self.experts_per_token)

    def _count(self, mlps: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q + 2 * kv + q * self.hidden
        router = self.hidden * self.experts if self.experts > 1 else 0
        layer = attention + 3 * self.hidden * self.intermediate * mlps + router + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * layer + self.hidden

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Adapter parameters at rank r: r x (in + out) per targeted projection per layer."""
        q, kv, h, i = (
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.hidden,
            self.intermediate,
        )
        sizes = {
            "q_proj": h + q,
            "k_proj": h + kv,
            "v_proj": h + kv,
            "o_proj": q + h,
            "gate_proj": h + i,
            "up_proj": h + i,
            "down_proj": i + h,
        }
        if self.experts > 1:  # an MoE layer's experts: 3-D parameters, not linear modules that adapters wrap
            del sizes["gate_proj"], sizes["up_proj"], sizes["down_proj"]
        per_layer = sum(n for name, n in sizes.items() if any(name.endswith(t) for t in targets))
        return self.layers * r * per_layer

    @property
    def act_floats_per_token(self) -> int:
        """Floats one decoder layer keeps for backward per token: the norms' inputs and outputs, q, k, v (before
        and after rotary), the attention output, the MLP's gate, up, activation and product (in each of the
        token's experts), the residuals."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 6 * self.hidden + 3 * q + 4 * kv + 4 * self.intermediate * self.experts_per_token


def hf_config(m: ModelConfig) -> dict:
    """The policy's Hugging Face config numbers: model.tiny's for the built-in model, else model.preset's or the
    config.json of model.config or model.path. The one place the plan reads a model's shape from. UserError
    naming the field when the file cannot be read here."""
    if m.builtin:
        t = m.tiny
        return {
            "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_layers,
            "vocab_size": BUILTIN_VOCAB,
            "intermediate_size": t.intermediate_size,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "max_position_embeddings": t.max_position_embeddings,
            "tie_word_embeddings": True,
        }
    try:
        return shape_fields(m) or {}
    except (OSError, ValueError) as e:
        key = "model.config" if m.config else "model.path"
        path = Path(m.config or m.path) / "config.json"
        raise UserError(f"{key}: {path} cannot be read here ({type(e).__name__}: {e})") from None


def shape_of(m: ModelConfig) -> ModelShape:
    """The policy's shape, from hf_config."""
    c = hf_config(m)
    try:
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
            experts_per_token=int(c.get("num_experts_per_tok") or 1),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"model.path: {m.path}/config.json lacks a decoder's shape ({e})") from None
