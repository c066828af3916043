"""Published shapes of a few public causal LMs (`model.preset`), as the fields of their Hugging Face
config.json: a run with `model.init=random` builds the architecture from them with random weights, so that
memory and speed at a real size can be measured without downloading anything.

The numbers are those of each model's public config.json (the base models); token ids are left out: the run's
own tokenizer sets them. Plain data, no torch: loading a config validates preset names against this table.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-0.5B: 494,032,768 parameters (tied embeddings)
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Qwen/Qwen2.5-1.5B: 1,543,714,304 parameters (tied embeddings)
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    # Qwen/Qwen3-0.6B: 596,049,920 parameters (tied embeddings; q/k norms, head_dim 128 > hidden / heads)
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
    },
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings; llama3 rope scaling)
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
}
