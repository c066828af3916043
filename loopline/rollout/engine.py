"""Generation engines behind one small protocol, and the built-in torch engine (KV cache, batched)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature 0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts passed to generate()
    sample_index: int  # 0..n-1 among the samples of that prompt
    token_ids: list[int]  # generated tokens, including the stop token/string if one ended it
    logprobs: list[float]  # log-prob of each token under the distribution it was sampled from
    text: str
    finish_reason: str  # "stop" (eos or stop string) or "length"
    policy_version: int = 0


class Engine(Protocol):
    """What the loops need from a generation engine."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]: ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and outside the smallest set with mass >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@dataclass
class _StopMatcher:
    """Finds stop tokens and stop strings. Every stop string is looked for in the decoded tail, as
    BPE vocabularies merge it into longer tokens (a double-newline token holds a newline)."""

    tokenizer: PreTrainedTokenizerBase
    stop: tuple[str, ...]
    token_ids: set[int] = field(default_factory=set)
    strings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tokenizer.eos_token_id is not None:
            self.token_ids.add(self.tokenizer.eos_token_id)
        for s in self.stop:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                self.token_ids.add(ids[0])
            self.strings.append(s)

    def hit(self, generated: list[int], new_token: int) -> bool:
        if new_token in self.token_ids:
            return True
        if not self.strings:
            return False
        tail = self.tokenizer.decode(generated[-32:])
        return any(s in tail for s in self.strings)


def _cache_of(out: object) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


class TorchEngine:
    """Batched sampling with a KV cache on any HF causal LM; runs wherever the model lives.

    Sampling draws from the engine's own generator when built with `seed` (its state is part of a
    checkpoint: rng_state/set_rng_state), else from the process's torch RNG; params.seed overrides both.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.version = 0
        self.generator: torch.Generator | None = None
        if seed is not None:
            device = next(model.parameters()).device
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # transformers 5.x renamed `past_key_values` to `cache`; accept either release line
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy new weights in place (same layout as the model: the in-process transport)."""
        params = self.model.state_dict(keep_vars=True)  # includes tied aliases such as lm_head.weight
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in params:
                    raise KeyError(f"engine model has no parameter '{name}'")
                params[name].copy_(tensor)
        self.version = version

    def rng_state(self) -> torch.Tensor | None:
        """The sampling generator's state (a copy), or None when the engine samples from the process's RNG."""
        return None if self.generator is None else self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Continue sampling from `state` (from rng_state)."""
        if self.generator is None:
            raise ValueError(
                "this engine samples from the process's torch RNG: it has no generator to restore"
            )
        self.generator.set_state(state)

    def reseed(self, seed: int) -> None:
        """Restart the sampling generator from `seed`."""
        if self.generator is None:
            raise ValueError(
                "this engine samples from the process's torch RNG: it has no generator to reseed"
            )
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """n completions per prompt; prompts are token ids (no padding)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=device).manual_seed(params.seed)

        expanded = [p for p in prompts for _ in range(n)]
        batch, width = len(expanded), max(len(p) for p in expanded)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(expanded):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        stopper = _StopMatcher(self.tokenizer, tuple(params.stop))
        generated: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        active = torch.ones(batch, dtype=torch.bool, device=device)

        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True
        )
        cache, logits = _cache_of(out), out.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        for _ in range(params.max_new_tokens):
            logits = logits.float()
            if params.temperature == 0.0:
                token = logits.argmax(dim=-1)
                logp = torch.log_softmax(logits, dim=-1)
            else:
                logp = torch.log_softmax(
                    _filter_logits(logits / params.temperature, params.top_k, params.top_p), -1
                )
                token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            token = torch.where(active, token, torch.full_like(token, self.pad_id))
            token_logp = logp.gather(1, token[:, None]).squeeze(1)

            # one host sync per step: the tokens are needed on the host for stop checks anyway
            token_list, logp_list, active_list = token.tolist(), token_logp.tolist(), active.tolist()
            for i in range(batch):
                if not active_list[i]:
                    continue
                generated[i].append(token_list[i])
                logprobs[i].append(logp_list[i])
                if stopper.hit(generated[i], token_list[i]):
                    finish[i] = "stop"
                    active[i] = False
            if not bool(active.any()):
                break
            attention = torch.cat([attention, active[:, None].long()], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            cache, logits = _cache_of(out), out.logits[:, -1, :]
            next_pos = next_pos + 1

        self.model.train(was_training)
        return [
            Completion(
                prompt_index=i // n,
                sample_index=i % n,
                token_ids=generated[i],
                logprobs=logprobs[i],
                text=self.tokenizer.decode(generated[i], skip_special_tokens=True),
                finish_reason=finish[i],
                policy_version=self.version,
            )
            for i in range(batch)
        ]
