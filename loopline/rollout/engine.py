"""Generation engines behind one small protocol, and the built-in torch engine (KV cache, batched)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache, DynamicLayer


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


class _StopMatcher:
    """Stop tokens and stop strings, matched without decoding every token.

    A stop string can only be completed by a token whose own text holds the string's last character (the text
    before it held no match, or generation would have stopped), so only those tokens, a table per tokenizer,
    trigger a decode of the tail. BPE vocabularies merge a stop string into longer tokens (a double-newline token
    holds a newline): the tail's decoded text still shows it. A last character a single token may not show on
    its own (a space, which SentencePiece-style decoders strip from a lone token; a non-ASCII character, which
    byte-level tokens may split) makes every token a trigger, as before.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], pieces: list[str]) -> None:
        self.tokenizer = tokenizer
        self.strings = list(stop)
        ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        for s in stop:
            encoded = tokenizer.encode(s, add_special_tokens=False)
            if len(encoded) == 1:
                ids.add(encoded[0])
        self.token_ids = torch.tensor(sorted(ids), dtype=torch.long)
        lasts = {s[-1] for s in stop if s}
        self.every_token = any(c == " " or not c.isascii() for c in lasts)
        self.triggers = torch.tensor([any(c in p for c in lasts) for p in pieces], dtype=torch.bool)

    def stops(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows whose new token is a stop token (eos, or a one-token stop string)."""
        return torch.isin(tokens, self.token_ids.to(tokens.device))

    def may_complete(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows whose new token could complete a stop string: only these need `hit`."""
        if not self.strings:
            return torch.zeros_like(tokens, dtype=torch.bool)
        if self.every_token:
            return torch.ones_like(tokens, dtype=torch.bool)
        table = self.triggers.to(tokens.device)
        inside = tokens < table.numel()  # ids past the tokenizer's pieces (padded embeddings): decode them
        return torch.where(inside, table[tokens.clamp(max=table.numel() - 1)], True)

    def hit(self, generated: list[int]) -> bool:
        """Whether the decoded tail of `generated` holds a stop string."""
        tail = self.tokenizer.decode(generated[-32:])
        return any(s in tail for s in self.strings)


class _PreallocatedLayer(DynamicLayer):
    """A cache layer that writes new keys and values into buffers sized for the whole generation, where
    DynamicLayer concatenates: copying the whole cache at every decode step was half of a step's time."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self.buffers is None or self.length + new > self.buffers[0].shape[-2]:
            self._resize(key_states, value_states, max(self.capacity, self.length + new))
        assert self.buffers is not None
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, self.length : self.length + new] = states
        self.length += new
        return self._views()

    def _resize(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        fresh = tuple(t.new_empty((*t.shape[:2], capacity, t.shape[-1])) for t in (keys, values))
        if self.buffers is not None:
            for old, buffer in zip(self.buffers, fresh):
                buffer[:, :, : self.length] = old[:, :, : self.length]
        self.buffers = fresh  # type: ignore[assignment]
        self.device, self.is_initialized = keys.device, True

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.buffers is not None
        self.keys, self.values = (b[:, :, : self.length] for b in self.buffers)
        return self.keys, self.values

    def _rebuild(self, rows: torch.Tensor | None, repeats: int = 1) -> None:
        """Keep `rows` of the batch (or repeat every row `repeats` times), copying only the filled part."""
        if self.buffers is None:
            return
        picked = []
        for b in self.buffers:
            filled = b[:, :, : self.length]
            filled = filled[rows] if rows is not None else filled.repeat_interleave(repeats, dim=0)
            buffer = filled.new_empty((filled.shape[0], *b.shape[1:]))
            buffer[:, :, : self.length] = filled
            picked.append(buffer)
        self.buffers = (picked[0], picked[1])
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebuild(None, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebuild(indices)


def _preallocated_cache(capacity: int) -> DynamicCache:
    """A DynamicCache whose layers are _PreallocatedLayer(capacity), made as the model reaches each layer."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(_PreallocatedLayer, capacity)  # type: ignore[assignment]
    return cache


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
        self._pieces: list[str] | None = None  # each token's own text, for the stop matchers' trigger tables
        self._stoppers: dict[tuple[str, ...], _StopMatcher] = {}

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

    def _stopper(self, stop: tuple[str, ...]) -> _StopMatcher:
        """The stop matcher for `stop`, built once per engine (its trigger table reads the whole vocabulary)."""
        if stop not in self._stoppers:
            if self._pieces is None:
                self._pieces = self.tokenizer.batch_decode([[t] for t in range(len(self.tokenizer))])
            self._stoppers[stop] = _StopMatcher(self.tokenizer, stop, self._pieces)
        return self._stoppers[stop]

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """n completions per prompt; prompts are token ids (no padding).

        Each prompt is prefilled once and its KV cache shared by its n samples; finished sequences leave the
        batch (their cache rows dropped) once they are a quarter of it, so a long tail does not keep the
        finished ones computing.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=device).manual_seed(params.seed)

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = _preallocated_cache(width + params.max_new_tokens)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
        )
        cache, logits = _cache_of(out), out.logits[:, -1, :]
        if n > 1:  # the group shares its prompt's KV: copies of the prefilled rows, not n prefills
            cache.batch_repeat_interleave(n)
            logits, attention = logits.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)

        batch = len(prompts) * n
        stopper = self._stopper(tuple(params.stop))
        tokens = torch.full((batch, params.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        token_logps = torch.zeros((batch, params.max_new_tokens), device=device)
        lengths = [params.max_new_tokens] * batch
        finish = ["length"] * batch
        rows = torch.arange(batch, device=device)  # the original index of each row of the batch
        live = torch.ones(batch, dtype=torch.bool, device=device)  # rows still generating
        next_pos = positions[:, -1:] + 1
        for step in range(params.max_new_tokens):
            logits = logits.float()
            if params.temperature == 0.0:
                token = logits.argmax(dim=-1)
                logp = torch.log_softmax(logits, dim=-1)
            else:
                logp = torch.log_softmax(
                    _filter_logits(logits / params.temperature, params.top_k, params.top_p), -1
                )
                token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            token = torch.where(live, token, self.pad_id)
            tokens[rows[live], step] = token[live]
            token_logps[rows[live], step] = logp.gather(1, token[:, None]).squeeze(1)[live]

            done = stopper.stops(token) & live
            for i in (stopper.may_complete(token) & live & ~done).nonzero().flatten().tolist():
                done[i] = stopper.hit(tokens[rows[i], : step + 1].tolist())
            if bool(done.any()):
                for i in rows[done].tolist():
                    lengths[i], finish[i] = step + 1, "stop"
                live &= ~done
                if not bool(live.any()):
                    break
                # finished rows leave the batch once they are a quarter of it: dropping them costs a copy of
                # the cache's filled part, so one copy per few finishes rather than one per step
                if int((~live).sum()) * 4 >= len(rows):
                    kept = live.nonzero().flatten()
                    cache.batch_select_indices(kept)
                    rows, token, attention, next_pos = (
                        rows[kept],
                        token[kept],
                        attention[kept],
                        next_pos[kept],
                    )
                    live = live[kept]
            if step + 1 == params.max_new_tokens:
                break
            attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
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
        token_lists, logp_lists = tokens.tolist(), token_logps.tolist()
        completions = []
        for i in range(batch):
            ids = token_lists[i][: lengths[i]]
            completions.append(
                Completion(
                    prompt_index=i // n,
                    sample_index=i % n,
                    token_ids=ids,
                    logprobs=logp_lists[i][: lengths[i]],
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason=finish[i],
                    policy_version=self.version,
                )
            )
        return completions
