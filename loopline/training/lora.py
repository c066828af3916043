"""LoRA adapters (peft) on the policy, and the merged weights the engines and exported models receive.

`apply_lora` injects adapters into the model in place (it stays the same transformers class, so every
role keeps calling it as before) and freezes everything else: the optimizers, which take the parameters
that require grad, then train the adapters only. Engines and Hugging Face exports take
`MergedWeights` / `merged_state_dict`: the plain parameter names with W + scale * B A folded in, so an engine
holds an ordinary model and never sees an adapter.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from loopline.models.config import LoRAConfig

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """Inject adapters of rank cfg.r into cfg.target_modules (in place); only they stay trainable."""
    if cfg.r <= 0:
        raise ValueError("model.lora.r must be > 0 to apply LoRA")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft scales by any number
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
    )
    try:
        model = inject_adapter_in_model(peft_cfg, model)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules: {e}") from None
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def _lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """The modules that carry adapters, by name. Without peft imported there are none: peft (with accelerate,
    ~0.5 s) is imported only by a run that uses LoRA, not by every trainer, engine and CLI process."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer  # noqa: F811 - the class itself, at run time

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    """True if any module of the model carries LoRA adapters."""
    return bool(_lora_layers(model))


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their plain names, adapters folded in; `state_dict()` if it has none."""
    return dict(MergedWeights(model))


class MergedWeights(Mapping[str, torch.Tensor]):
    """The model's weights under their plain names, each adapted weight merged (W + scale * B A) only when read.

    An in-process weight sync reads them one by one into the engine, so it holds one merged matrix beside the model
    at a time rather than a second copy of every adapted weight (at 1.5B parameters, gigabytes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        state = model.state_dict()  # references to the live tensors, no copies
        self._plain = {k: v for k, v in state.items() if "lora_" not in k and ".base_layer." not in k}
        self._adapted: dict[str, LoraLayer] = {}
        for name, layer in _lora_layers(model).items():
            self._adapted[f"{name}.weight"] = layer
            bias = layer.get_base_layer().bias
            if bias is not None:
                self._plain[f"{name}.bias"] = bias.detach()  # type: ignore[operator]  # a Linear's bias

    def __getitem__(self, name: str) -> torch.Tensor:
        layer = self._adapted.get(name)
        if layer is None:
            return self._plain[name]
        with torch.no_grad():
            weight = layer.get_base_layer().weight.detach().clone()  # type: ignore[operator]  # a Linear's weight
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    # scale * B @ A; defined by each LoraLayer kind (Linear, Embedding, ...), not the base class
                    weight += layer.get_delta_weight(adapter).to(weight.dtype)  # type: ignore[attr-defined]
        return weight

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._adapted

    def __len__(self) -> int:
        return len(self._plain) + len(self._adapted)
