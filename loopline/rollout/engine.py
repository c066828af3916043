"""Generation engines behind one small protocol, and the built-in torch engine (KV cache, batched)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicCache, DynamicLayer

from loopline.models.cache import cache_argument, cache_of
from loopline.rollout.config import PACK_MIN_NEW_TOKENS
from loopline.rollout.packed import PackedLinears
from loopline.rollout.routes import RouteRecorder
from loopline.rollout.sampling import next_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature 0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # never sample EOS: lengths set by max_new_tokens and stop (benchmarks)


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int  # index into the prompts passed to generate()
    sample_index: int  # 0..n-1 among the samples of that prompt
    token_ids: list[int]  # generated tokens, including the stop token/string if one ended it
    logprobs: list[float]  # log-prob of each token under the distribution it was sampled from
    text: str
    finish_reason: str  # "stop" (eos or stop string) or "length"
    policy_version: int = 0  # the weights that sampled its first token
    token_versions: list[int] = field(default_factory=list)  # the weights that sampled each token
    partial: bool = False  # new weights arrived mid-generation: its tokens come from two or more versions
    # (P + T - 1, L, k) int16: an MoE model's top-k experts at each position of prompt + tokens but the last, in
    # each of its L MoE layers, as the engine routed them (TorchEngine(record_routes=True); rollout/routes.py)
    routes: torch.Tensor | None = None


class Engine(Protocol):
    """What the loops need from a generation engine."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]: ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...


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
            grown = 2 * self.buffers[0].shape[-2] if self.buffers is not None else self.capacity
            self._resize(key_states, value_states, max(grown, self.length + new))
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

    def _rebuild(self, rows: torch.Tensor | None, repeats: int = 1, first: int = 0) -> None:
        """Keep `rows` of the batch (or repeat every row `repeats` times) from column `first` on, copying only
        the filled part."""
        if self.buffers is None:
            return
        picked = []
        self.length -= first
        for b in self.buffers:
            filled = b[:, :, first : first + self.length]
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

    def select(self, rows: torch.Tensor, first: int) -> None:
        """Keep `rows`, without the columns before `first`."""
        self._rebuild(rows, first=first)

    def stack(self, rows: torch.Tensor, first: int, other: _PreallocatedLayer, headroom: int) -> None:
        """Keep `rows` from column `first` on, then append every row of `other` below them; the two parts'
        filled columns right-aligned (zeros on the left of the narrower part, which the attention mask hides),
        with `headroom` free columns after them for the tokens to come."""
        assert self.buffers is not None and other.buffers is not None
        parts = [
            [b[rows, :, first : self.length] for b in self.buffers],
            [b[:, :, : other.length] for b in other.buffers],
        ]
        width = max(part[0].shape[-2] for part in parts)
        stacked = []
        for i in range(2):  # keys, values
            top, bottom = parts[0][i], parts[1][i]
            shape = (top.shape[0] + bottom.shape[0], top.shape[1], width + headroom, top.shape[-1])
            buffer = top.new_zeros(shape)
            buffer[: top.shape[0], :, width - top.shape[-2] : width] = top
            buffer[top.shape[0] :, :, width - bottom.shape[-2] : width] = bottom
            stacked.append(buffer)
        self.buffers, self.length = (stacked[0], stacked[1]), width
        self._views()


def _preallocated_cache(capacity: int) -> DynamicCache:
    """A DynamicCache whose layers are _PreallocatedLayer(capacity), made as the model reaches each layer."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(_PreallocatedLayer, capacity)  # type: ignore[assignment]
    return cache


@dataclass
class _Running:
    """The sequences an engine computes together: one row each, in the cache and in every tensor here."""

    cache: DynamicCache
    logits: torch.Tensor  # (B, V) next-token logits of each row
    attention: torch.Tensor  # (B, W) 1 on the cache columns a row attends to
    next_pos: torch.Tensor  # (B, 1) position of each row's next token
    sample: torch.Tensor  # (B,) which completion each row is (prompt index * n + sample index)
    count: torch.Tensor  # (B,) tokens generated so far
    live: torch.Tensor  # (B,) bool, still generating

    def keep(self, rows: torch.Tensor, trim: bool) -> None:
        """Drop every row but `rows` (a copy of the cache's filled part); trim: and the columns none of them
        attends to any more (shapes change, so a batch that started whole does not trim: it stays bitwise as
        before)."""
        first = self._first_column(rows) if trim else 0
        for layer in self.cache.layers:
            cast(_PreallocatedLayer, layer).select(rows, first)
        for name in ("logits", "next_pos", "sample", "count", "live"):
            setattr(self, name, getattr(self, name)[rows])
        self.attention = self.attention[rows, first:]

    def _first_column(self, rows: torch.Tensor) -> int:
        """The first cache column any of `rows` attends to (left of it: padding, or the finished rows' past)."""
        attention = self.attention[rows]
        return int(attention.any(dim=0).float().argmax()) if len(rows) else attention.shape[1]

    def join(self, new: _Running, headroom: int) -> None:
        """Append `new`'s rows (groups just prefilled) to the live rows, which alone are kept; columns that no
        kept row attends to any more are dropped, so the cache never grows with the number of prompts served."""
        rows = self.live.nonzero().flatten()
        first = self._first_column(rows)
        attention = self.attention[rows]
        for layer, other in zip(self.cache.layers, new.cache.layers):
            cast(_PreallocatedLayer, layer).stack(rows, first, cast(_PreallocatedLayer, other), headroom)
        width = self.cache.layers[0].keys.shape[-2]
        attention = attention[:, first:]
        self.attention = torch.cat([_left_pad(attention, width), _left_pad(new.attention, width)], dim=0)
        for name in ("logits", "next_pos", "sample", "count", "live"):
            setattr(self, name, torch.cat([getattr(self, name)[rows], getattr(new, name)]))


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros((mask.shape[0], width - mask.shape[1])), mask], dim=1)


class TorchEngine:
    """Batched sampling with a KV cache on any HF causal LM; runs wherever the model lives.

    Sampling draws from the engine's own generator when built with `seed` (its state is part of a
    checkpoint: rng_state/set_rng_state), else from the process's torch RNG; params.seed overrides both.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        seed: int | None = None,
        max_rows: int = 0,
        keep_stale_kv: bool = False,
        record_routes: bool = False,
        pack_weights: bool = True,
    ) -> None:
        """max_rows: sequences computed at once (runtime.engine_max_rows); 0 = all of a call's at once.
        keep_stale_kv: weights offered during a generate call (a partial rollout) leave the cache of the sequences
        in flight as the old weights filled it (faster, but their next tokens attend to another policy's keys and
        values); by default the cache is recomputed under the new weights. record_routes: an MoE model's
        completions carry the experts its routers chose (Completion.routes). pack_weights: on a CPU, a call of at
        least PACK_MIN_NEW_TOKENS new tokens decodes on reordered copies of the linear weights (rollout/packed.py)."""
        if max_rows < 0:
            raise ValueError(f"max_rows must be at least 0, got {max_rows}")
        self.model = model
        self.max_rows = max_rows
        self.keep_stale_kv = keep_stale_kv
        self.record_routes = record_routes
        self.pack_weights = pack_weights
        self._routes: RouteRecorder | None = None  # the routes of the generate call running
        self._packed: PackedLinears | None = None  # the reordered weights of the generate call running
        if record_routes:
            RouteRecorder(model, 0, 0)  # a dense model has none to record: say so now, not at the first call
        # weights offered while a generate call runs wait here for its next decode step (offer_weights)
        self._cond = threading.Condition()
        self._generating = False
        self._offered: tuple[Mapping[str, torch.Tensor], int] | None = None
        self.tokenizer = tokenizer
        self.version = 0
        self.generator: torch.Generator | None = None
        if seed is not None:
            device = next(model.parameters()).device
            self.generator = torch.Generator(device=device).manual_seed(seed)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # transformers 5.x renamed `past_key_values` to `cache`; accept either release line
        self._cache_arg = cache_argument(model) or "past_key_values"
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

    def commit_weights(self, version: int) -> None:
        """The model's tensors hold weights `version` (a sync wrote them in place)."""
        self.version = version

    def offer_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Take new weights from another thread: now when idle; during a generate call at its next decode step,
        where the sequences in flight keep their tokens and go on under the new weights (a partial rollout).
        `state_dict` must stay untouched until `wait_taken` returns."""
        with self._cond:
            if self._generating:
                self._offered = (state_dict, version)
            else:
                self.update_weights(state_dict, version)

    def wait_taken(self) -> None:
        """Wait until the weights offered last are in the model (at most one decode step)."""
        with self._cond:
            self._cond.wait_for(lambda: self._offered is None)

    def _take_offered(self) -> bool:
        """Load weights offered during this generate call, if any; True if the weights changed."""
        with self._cond:
            if self._offered is None:
                return False
            self.update_weights(*self._offered)
            self._offered = None
            if self._packed is not None:
                self._packed.pack()
            self._cond.notify_all()
            return True

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

    def _forward_padded(
        self, sequences: list[list[int]], headroom: int
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward of `sequences`, left-padded so that all end at the same column: the cache (room for
        `headroom` more columns), each row's next-token logits, attention mask and position ids."""
        device = next(self.model.parameters()).device
        width = max(len(p) for p in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, p in enumerate(sequences):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = _preallocated_cache(width + headroom)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,  # the next token's logits only: not (rows x prompt tokens x vocabulary) of them
            **{self._cache_arg: cache},
        )
        return cache_of(out), out.logits[:, -1, :], attention, positions

    def _prefill(self, prompts: list[list[int]], first: int, n: int, headroom: int) -> _Running:
        """Prompts first, first + 1, ... prefilled in one forward (left-padded), each row then repeated for its n
        samples: the group shares its prompt's KV, copies of the prefilled rows, not n prefills."""
        device = next(self.model.parameters()).device
        cache, logits, attention, positions = self._forward_padded(prompts, headroom)
        if self._routes is not None:
            self._routes.prefilled(prompts, first, n)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, attention = logits.repeat_interleave(n, 0), attention.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        rows = len(prompts) * n
        sample = torch.arange(first * n, first * n + rows, device=device)
        return _Running(
            cache, logits, attention, positions[:, -1:] + 1, sample,
            count=torch.zeros(rows, dtype=torch.long, device=device),
            live=torch.ones(rows, dtype=torch.bool, device=device),
        )  # fmt: skip

    def _recompute(
        self, batch: _Running, prompts: list[list[int]], tokens: torch.Tensor, n: int, max_new: int
    ) -> _Running:
        """The live rows of `batch` prefilled again, prompt and tokens so far, under the weights now loaded: no
        sequence goes on from keys and values that other weights computed."""
        rows = batch.live.nonzero().flatten()
        sample, count = batch.sample[rows], batch.count[rows]
        sequences = [
            prompts[s // n] + tokens[s, :c].tolist() for s, c in zip(sample.tolist(), count.tolist())
        ]
        cache, logits, attention, positions = self._forward_padded(sequences, max_new - int(count.min()))
        if self._routes is not None:
            self._routes.stepped(sample, count, torch.ones_like(count, dtype=torch.bool))
        return _Running(
            cache, logits, attention, positions[:, -1:] + 1, sample, count,
            live=torch.ones(len(rows), dtype=torch.bool, device=logits.device),
        )  # fmt: skip

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """n completions per prompt; prompts are token ids (no padding).

        Continuous batching: at most max_rows sequences compute at once (all when 0). Waiting prompts enter with
        their n samples once a quarter of the rows (at least n) are free, prefilled once; a finished sequence
        leaves the batch (its cache row dropped) once finished rows are a quarter of it, or when waiting prompts
        take its row, so a long tail neither keeps finished rows computing nor holds waiting prompts back.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        total = len(prompts) * n
        slots = self.max_rows or total
        if slots < n:
            raise ValueError(
                f"engine max_rows ({slots}) is below the {n} samples of one prompt, which start together"
            )
        with self._cond:
            self._generating = True
        if self.record_routes:
            self._routes = RouteRecorder(self.model, total, params.max_new_tokens)
        pack = self.pack_weights and params.max_new_tokens >= PACK_MIN_NEW_TOKENS
        try:
            with (
                self._routes.hooks() if self._routes is not None else contextlib.nullcontext(),
                PackedLinears(self.model, slots) if pack else contextlib.nullcontext() as packed,
            ):
                self._packed = packed
                return self._generate(prompts, params, n, total, slots)
        finally:
            self._routes = self._packed = None
            with self._cond:
                self._generating = False
            self._take_offered()  # weights offered during the last decode step

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int, total: int, slots: int
    ) -> list[Completion]:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator(device=device).manual_seed(params.seed)
        stopper = self._stopper(tuple(params.stop))
        max_new = params.max_new_tokens

        tokens = torch.full((total, max_new), self.pad_id, dtype=torch.long, device=device)
        token_logps = torch.zeros((total, max_new), device=device)
        versions = torch.zeros((total, max_new), dtype=torch.long)  # the weights that sampled each token
        lengths = [max_new] * total
        finish = ["length"] * total
        admitted = min(len(prompts), slots // n)  # prompts started so far, in order
        batch = self._prefill(prompts[:admitted], 0, n, max_new)
        while True:
            free = slots - int(batch.live.sum())
            # waiting prompts take the rows of finished ones, a quarter of the rows at a time (or a group, if
            # larger): each entry costs a prefill and a copy of the cache, so one per few finishes
            if admitted < len(prompts) and free >= max(n, slots // 4):
                enter = min(len(prompts) - admitted, free // n)
                new = self._prefill(prompts[admitted : admitted + enter], admitted, n, max_new)
                batch.join(new, headroom=max_new)
                admitted += enter
            logits = batch.logits.float()
            if params.ignore_eos and self.tokenizer.eos_token_id is not None:
                logits[:, self.tokenizer.eos_token_id] = float("-inf")
            token, logp = next_tokens(logits, params.temperature, params.top_k, params.top_p, gen)
            live = batch.live
            token = torch.where(live, token, self.pad_id)
            sample, count = batch.sample[live], batch.count[live]
            tokens[sample, count] = token[live]
            token_logps[sample, count] = logp.gather(1, token[:, None]).squeeze(1)[live]
            versions[sample.cpu(), count.cpu()] = self.version
            batch.count = batch.count + live

            done = stopper.stops(token) & live
            for i in (stopper.may_complete(token) & live & ~done).nonzero().flatten().tolist():
                done[i] = stopper.hit(tokens[batch.sample[i], : batch.count[i]].tolist())
            for i in done.nonzero().flatten().tolist():
                row = int(batch.sample[i])
                lengths[row], finish[row] = int(batch.count[i]), "stop"
            done |= live & (batch.count == max_new)  # at the length limit ("length", as set)
            batch.live = live & ~done
            if not bool(batch.live.any()) and admitted == len(prompts):
                break
            # finished rows leave the batch once they are a quarter of it: dropping them costs a copy of the
            # cache's filled part, so one copy per few finishes rather than one per step
            if int((~batch.live).sum()) * 4 >= len(batch.live):
                kept = batch.live.nonzero().flatten()
                batch.keep(kept, trim=slots < total)
                token = token[kept]
            if len(batch.live) == 0:
                continue  # every row finished: the waiting prompts enter at the loop's top
            if self._take_offered() and not self.keep_stale_kv:
                batch = self._recompute(batch, prompts, tokens, n, max_new)
                continue  # the recomputed forward gave every row's next-token logits
            batch.attention = torch.cat(
                [batch.attention, batch.attention.new_ones((len(batch.live), 1))], dim=1
            )
            out = self.model(
                input_ids=token[:, None],
                attention_mask=batch.attention,
                position_ids=batch.next_pos,
                use_cache=True,
                **{self._cache_arg: batch.cache},
            )
            batch.cache, batch.logits = cache_of(out), out.logits[:, -1, :]
            batch.next_pos = batch.next_pos + 1
            if self._routes is not None:
                self._routes.stepped(batch.sample, batch.count, batch.live)

        self.model.train(was_training)
        return self._completions((tokens, token_logps, versions), lengths, finish, n)

    def _completions(
        self,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        lengths: list[int],
        finish: list[str],
        n: int,
    ) -> list[Completion]:
        """The generated rows (tokens, their log-probs, their weights' versions) as Completions (row i: prompt
        i // n, sample i % n)."""
        routes = self._routes
        token_lists, logp_lists, version_lists = (t.tolist() for t in rows)
        ids_lists = [token_lists[i][: lengths[i]] for i in range(len(lengths))]
        # one call for the batch (fast tokenizers decode it in one pass)
        texts = self.tokenizer.batch_decode(ids_lists, skip_special_tokens=True)
        completions = []
        for i, ids in enumerate(ids_lists):
            by = version_lists[i][: lengths[i]]
            completions.append(
                Completion(
                    prompt_index=i // n,
                    sample_index=i % n,
                    token_ids=ids,
                    logprobs=logp_lists[i][: lengths[i]],
                    text=texts[i],
                    finish_reason=finish[i],
                    policy_version=by[0],
                    token_versions=by,
                    partial=by[0] != by[-1],
                    routes=routes.routes(i, i // n, lengths[i]) if routes is not None else None,
                )
            )
        return completions
