"""Pipeline parallelism for the trainer: the model split into stages over the "pp" dim of a (pp, dp, tp) mesh.

`split_model` cuts an HF decoder-only LM (Llama/Qwen2 layout: model.embed_tokens, model.layers, model.norm,
model.rotary_emb, lm_head) into `StageModule`s by hand, not by tracing (tracing fixes the sequence length).
Each stage keeps its decoder layers under their original indices (a ModuleDict keyed "2", "3"), so its
parameter names are the unsplit model's: checkpoints and the weight sync see the same names as with pp = 1.
Every stage rebuilds position ids, the causal mask and rotary embeddings from the attention mask, which every
rank holds (torch's schedules pass step() kwargs to every stage); only hidden states travel between stages.
The last stage returns, per position, the log-prob of the next token and the entropy, (b, L, 2), so the
vocabulary-wide logits never leave it.

`PipelineTrainer` runs the SFT and GRPO/PPO policy steps through a torch.distributed.pipelining schedule
(GPipe, 1F1B or interleaved 1F1B) with the loss normalisation of `PolicyTrainer`: each micro-batch's loss is
its share of the global batch's mean (global token and row counts over the data-parallel ranks), the
schedule does not rescale gradients (scale_grads=False), so pp stages x dp ranks make one rank's update.
Per-token masks, advantages and old/reference log-probs travel in the schedule's `target`, split with the
rows. Shapes: a schedule's stages fix their tensor shapes at its first step (a longer batch aborts a rank, a
shorter one gives wrong values silently), so batches are padded to a width bucket and whole micro-batches,
and a schedule is built per (micro-batches, width): never reused on another shape.
Tied embeddings become two copies (first and last stage); their gradients are summed between those ranks.
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from loopline.algorithms.losses import entropy_from_logprobs
from loopline.algorithms.policy_loss import PolicyLoss
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.training.config import OptimConfig
from loopline.training.logits import at_least_float32, head_scores
from loopline.training.optim import apply_update, build_optimizer
from loopline.training.parallel import apply_tp, clip_grads_with_norm, shard_model, total_grad_norm
from loopline.training.pipeline_sizes import check_pp, padded_shape, rank_stages, stage_layers
from loopline.training.policy import PolicyStepStats, SFTStepStats

SCHEDULES = ("gpipe", "1f1b", "interleaved")
MAX_SCHEDULES = 8  # schedules (one per batch shape) a trainer keeps


B = TypeVar("B", bound=TokenBatch)


def pad_batch(batch: B, rows: int, width: int) -> B:
    """`batch` padded to `rows` x `width`: new columns on the right are padding (attention and response mask
    0), new rows repeat row 0 with its response mask zeroed (a real row: an all-padding one would attend to
    nothing). Padding trains nothing: every loss term is masked by the response mask."""
    extra_rows, extra_cols = rows - len(batch), width - batch.input_ids.shape[1]
    if len(batch) == 0 or extra_rows < 0 or extra_cols < 0:
        raise ValueError(f"cannot pad a {tuple(batch.input_ids.shape)} batch to ({rows}, {width})")

    def pad(value: torch.Tensor) -> torch.Tensor:
        if value.ndim == 2:  # per token: (B, L) or (B, C)
            value = nn.functional.pad(value, (0, extra_cols))
        return torch.cat([value, value[:1].expand(extra_rows, *value.shape[1:])])

    padded = batch.apply(pad)
    padded.response_mask[len(batch) :] = 0.0
    return padded


def _next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) the token each position predicts (the last position's is a dummy 0: never read)."""
    return torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)


def _micro_share(mask: torch.Tensor, totals: tuple[float, float], agg: str) -> float:
    """Weight of a micro-batch's `agg` mean in the global batch's: its tokens / all tokens (token_mean), else its
    rows (padding rows included: their terms are 0 and `aggregate` counts them) / all real rows."""
    tokens, rows = totals
    if agg == "token_mean":
        return float(mask.sum()) / max(1.0, tokens)
    return mask.shape[0] / rows


# ---------------------------------------------------------------- stages

RENAMED = (("cache", "past_key_values"),)  # (new, old) keyword names of transformers' mask functions


def _call_with_supported(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call `fn` with those of `kwargs` its signature names (transformers renamed these across versions); of a
    renamed argument whose old name is still accepted (and warned about), only the new name."""
    params = inspect.signature(fn).parameters
    chosen = {k: v for k, v in kwargs.items() if k in params}
    for new, old in RENAMED:
        if new in chosen:
            chosen.pop(old, None)
    return fn(**chosen)


def _masks(config: Any, h: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
    """The 4-D attention masks by layer type, as the HF model builds them (padding and causality)."""
    from transformers import masking_utils

    common = dict(
        config=config, inputs_embeds=h, input_embeds=h, attention_mask=attention_mask, cache=None,
        past_key_values=None, cache_position=torch.arange(h.shape[1], device=h.device), position_ids=positions,
    )  # fmt: skip
    masks = {"full_attention": _call_with_supported(masking_utils.create_causal_mask, **common)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        masks["sliding_attention"] = _call_with_supported(
            masking_utils.create_sliding_window_causal_mask, **common
        )
    return masks


class _Body(nn.Module):
    """A stage's part of the HF base model (`model.`): embeddings on the first stage, its layers, the final norm
    on the last, the rotary embedding on every one."""

    def __init__(self, base: Any, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens: nn.Module | None = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.norm: nn.Module | None = base.norm if last else None
        self.rotary_emb: nn.Module = base.rotary_emb


class StageModule(nn.Module):
    """One pipeline stage of an HF causal LM, its parameters named as in the whole model.

    forward(x, attention_mask, labels): x is input_ids (B, L) on the first stage, hidden states (B, L, H)
    after it; the last stage returns (B, L, 2) float32: log-prob of labels[:, t] at position t, and the
    entropy there (in eval mode also (B, L, 3): the log-prob at `temperature`, what an engine reports when it
    samples at it); the others return hidden states.
    """

    def __init__(self, model: Any, index: int, num_stages: int, layers: range) -> None:
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.config = model.config
        # one tensor as embeddings and head: split over pp > 1 it becomes two copies, kept equal by the trainer
        self.tied = model.lm_head.weight is model.model.embed_tokens.weight
        # what training.parallel's apply_tp / shard_model read off an HF model
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self._tp_plan = dict(getattr(model, "_tp_plan", None) or {})
        self.model = _Body(model.model, layers, self.first, self.last)
        self.lm_head: nn.Module | None = model.lm_head if self.last else None
        self.layer_types = list(
            getattr(model.config, "layer_types", None) or ["full_attention"] * len(layers)
        )
        self.temperature = 1.0  # eval's third channel: log-probs as sampled at this temperature
        self.chunk_tokens = 0  # the head's logits this many positions at a time (model.logits_chunk_tokens)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as training.policy's padded forward
        masks = _masks(self.config, h, attention_mask, positions)
        rotary = self.model.rotary_emb(h, positions)
        for name, layer in self.model.layers.items():
            h = layer(
                h,
                attention_mask=masks[self.layer_types[int(name)]],
                position_ids=positions,
                position_embeddings=rotary,
            )
            h = h[0] if isinstance(h, tuple) else h  # older transformers return (hidden, ...)
        if self.lm_head is None or self.model.norm is None:
            return h
        if self.chunk_tokens:
            return self._chunked_scores(self.lm_head, self.model.norm(h), labels)
        logits = at_least_float32(self.lm_head(self.model.norm(h)))  # (B, L, V)
        every = torch.log_softmax(logits, dim=-1)
        logp = every.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        channels = [logp, entropy_from_logprobs(every)]
        if not self.training:
            t = self.temperature
            tempered = torch.log_softmax(logits / t, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            channels.append(logp if t in (0.0, 1.0) else tempered)
        return torch.stack(channels, dim=-1)  # (B, L, 2), or (B, L, 3) in eval

    def _chunked_scores(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """forward's channels with the head's logits chunk_tokens positions at a time (training.logits)."""
        t = self.temperature
        tempered = not self.training and t not in (0.0, 1.0)
        scores = head_scores(
            head, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), self.chunk_tokens,
            with_entropy=True, temperature=t if tempered else None,
        )  # fmt: skip
        assert scores.entropy is not None  # asked for with_entropy
        channels = [scores.logp, scores.entropy]
        if not self.training:
            channels.append(scores.tempered if scores.tempered is not None else scores.logp)
        return torch.stack(channels, dim=-1).view(
            *labels.shape, len(channels)
        )  # (B, L, 2), or (B, L, 3) in eval


def check_split(model: nn.Module, pp: int, virtual: int = 1) -> int:
    """Raise ValueError unless `model` (Llama/Qwen2 layout) splits into pp * virtual stages; its layer count."""
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} is not an HF decoder-only LM with model.{{{','.join(needed)}}} and "
            "lm_head: train it with trainer_pp=1"
        )
    check_pp(len(base.layers), pp, virtual)
    return len(base.layers)


def split_model(model: nn.Module, pp_rank: int, pp: int, virtual: int = 1) -> list[StageModule]:
    """The stages pipeline rank `pp_rank` holds (`rank_stages`) of `model`, an HF Llama/Qwen2-layout causal LM.

    The stages take their parts of `model` (no copy); each keeps its layers under their original names.
    Raises ValueError for another layout or layers that do not divide by pp * virtual.
    """
    num_layers = check_split(model, pp, virtual)
    runs = stage_layers(num_layers, pp * virtual)
    return [StageModule(model, s, pp * virtual, runs[s]) for s in rank_stages(pp_rank, pp, virtual)]


class StageParts(nn.Module):
    """This rank's stages as one module named like the whole model (model.embed_tokens, model.layers.N,
    model.norm, lm_head; only the parts it holds): what checkpoints, whole-weight loads and the weight sync read,
    so they see the names of pp = 1. The parts are the stages' own modules, not copies."""

    def __init__(self, stages: Sequence[StageModule]) -> None:
        super().__init__()
        self.model = nn.Module()
        layers: dict[str, nn.Module] = {}
        for stage in stages:
            if stage.model.embed_tokens is not None:
                self.model.embed_tokens = stage.model.embed_tokens
            layers.update(stage.model.layers.items())
            if stage.model.norm is not None:
                self.model.norm = stage.model.norm
            if stage.lm_head is not None:
                self.lm_head = stage.lm_head
        self.model.layers = nn.ModuleDict(dict(sorted(layers.items(), key=lambda kv: int(kv[0]))))
        # a tied head without the embeddings (the last stage, pp > 1) is a copy of them: a checkpoint of an
        # unpipelined model has its optimizer state under the embeddings' name only
        copy = stages[0].tied and not hasattr(self.model, "embed_tokens") and hasattr(self, "lm_head")
        self.optim_aliases = {"lm_head.weight": "model.embed_tokens.weight"} if copy else {}


def pp_mesh(num_ranks: int, pp: int, tp: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """A 3-D ("pp", "dp", "tp") mesh over global ranks 0..num_ranks-1, tp innermost, pp outermost: rank
    (s * dp + d) * tp + t is stage rank s, data-parallel rank d, TP rank t. Every rank must call it."""
    if pp < 1 or tp < 1 or num_ranks % (pp * tp):
        raise ValueError(f"trainer_pp * trainer_tp = {pp} * {tp} must divide the {num_ranks} trainer ranks")
    grid = torch.arange(num_ranks).reshape(pp, num_ranks // (pp * tp), tp)
    return DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp", "tp"))


def parallelize_stages(stages: Sequence[StageModule], mesh: DeviceMesh) -> list[StageModule]:
    """Each stage: TP over mesh["tp"] (when it has more than one rank), then FSDP2 over mesh["dp"]."""
    for stage in stages:
        if mesh["tp"].size() > 1:
            apply_tp(stage, mesh["tp"])
        shard_model(stage, mesh["dp"])
    return list(stages)


def full_pipeline_state(stages: Sequence[StageModule], mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The whole model's weights by name, on CPU, on global rank 0 (empty elsewhere): each stage's tensors
    gathered over dp and tp, then over the pp group of rank 0. The names and the tied head are the unsplit
    model's state_dict's. Every rank must call it (the gathers are collectives)."""
    local = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            local[name] = whole.detach().cpu()
    if any((mesh.get_coordinate() or [0])[1:]):  # dp or tp rank > 0: rank 0's pp group holds it all
        return {}
    parts: list[Any] = [None] * mesh["pp"].size() if dist.get_rank() == 0 else []
    dist.gather_object(local, parts if parts else None, dst=0, group=mesh["pp"].get_group())
    return {name: t for part in parts for name, t in part.items()}


# ---------------------------------------------------------------- the trainer


@dataclass
class _Targets:
    """What a step's loss reads per micro-batch besides the last stage's output, packed in one (B, C, 5) tensor
    (torch's schedules split `target` with the rows): response mask, old, reference log-probs, advantages,
    behaviour weights. None-ness is the same for every row, so it stays out of the tensor."""

    packed: torch.Tensor
    has_old: bool
    has_ref: bool
    token_advantages: bool
    has_is_weights: bool


def _policy_targets(batch: RolloutBatch) -> _Targets:
    mask = batch.response_mask
    zeros = torch.zeros_like(mask)
    adv = batch.advantages.to(mask.dtype)
    adv = adv if adv.ndim == 2 else adv.unsqueeze(1).expand_as(mask)
    channels = [
        mask,
        batch.old_logprobs if batch.old_logprobs is not None else zeros,
        batch.ref_logprobs if batch.ref_logprobs is not None else zeros,
        adv,
        batch.is_weights if batch.is_weights is not None else zeros,
    ]
    return _Targets(
        torch.stack([c.to(mask.dtype) for c in channels], dim=-1),
        batch.old_logprobs is not None,
        batch.ref_logprobs is not None,
        batch.advantages.ndim == 2,
        batch.is_weights is not None,
    )


def _responses(out: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) (b, C) of the response tokens from the last stage's (b, L, 2): position t
    predicts token t + 1, so the C response tokens are read at L-C-1 .. L-2."""
    length = out.shape[1]
    resp = out[:, length - width - 1 : length - 1]
    return resp[..., 0], resp[..., 1]


class PipelineTrainer:
    """The policy trainer over pipeline stages: sft_step, policy_step and logprobs as `PolicyTrainer`'s.

    Every rank of a pp group passes the same rows (its data-parallel slice); the dp ranks' slices may differ
    in rows and width. Statistics come back on every rank. `stages` are this rank's (split_model, then
    parallelize_stages); `mesh` a pp_mesh.
    """

    def __init__(
        self,
        stages: Sequence[StageModule],
        mesh: DeviceMesh,
        optim: OptimConfig,
        total_steps: int,
        schedule: str = "1f1b",
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
        width_bucket: int = 64,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        if schedule != "interleaved" and len(stages) != 1:
            raise ValueError(f"schedule {schedule} runs one stage per rank, got {len(stages)}")
        self.stages = list(stages)
        self.mesh = mesh
        self.pp = mesh["pp"].size()
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self.device = torch.device(mesh.device_type)
        self.cfg, self.schedule_name = optim, schedule
        self.loss, self.micro_batch_size, self.width_bucket = loss, micro_batch_size, width_bucket
        self.modules = nn.ModuleList(self.stages)
        self.optimizer, self.scheduler = build_optimizer(self.modules, optim, total_steps)
        self.updates = 0  # optimizer steps taken (as PolicyTrainer.updates)
        self.lock = threading.Lock()  # as PolicyTrainer.lock
        self._schedules: dict[tuple[int, int, int, bool], Any] = {}
        self.max_schedules = MAX_SCHEDULES
        self._micro_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._tied, self._tied_group = self._tie()

    # ------------------------------------------------ plumbing

    def _tie(self) -> tuple[torch.Tensor | None, dist.ProcessGroup | None]:
        """Tied embeddings over pp > 1: (this rank's copy, the group of the first and last stage's ranks)."""
        if self.pp == 1 or not self.stages[0].tied:
            return None, None
        pp_rank, *rest = self.mesh.get_coordinate() or [0]
        if pp_rank not in (0, self.pp - 1):
            return None, None
        grid = self.mesh.mesh
        pair = [int(grid[(0, *rest)]), int(grid[(self.pp - 1, *rest)])]
        group = dist.new_group(pair, use_local_synchronization=True)
        copies = [s.model.embed_tokens for s in self.stages] + [s.lm_head for s in self.stages]
        mine = [cast(torch.Tensor, c.weight) for c in copies if c is not None]
        assert len(mine) == 1, "a rank holds one copy of a tied embedding when pp > 1"
        return mine[0], group

    def _schedule(self, n_micro: int, mbs: int, width: int, train: bool) -> Any:
        """The schedule for this shape (built on first use: its stages fix their shapes at their first step).
        The newest max_schedules are kept (each holds receive buffers for its micro-batches); every rank of a
        pp group sees the same shapes in the same order, so they build and drop schedules together."""
        key = (n_micro, mbs, width, train)
        if key in self._schedules:
            self._schedules[key] = self._schedules.pop(key)  # the most recently used last
        else:
            while len(self._schedules) >= self.max_schedules:
                del self._schedules[next(iter(self._schedules))]
            pipes: list[Any] = [
                PipelineStage(s, s.index, s.num_stages, self.device, group=self.pp_group) for s in self.stages
            ]
            loss_fn = self._loss_of_micro if train else None
            if self.schedule_name == "interleaved":
                self._schedules[key] = ScheduleInterleaved1F1B(pipes, n_micro, loss_fn, scale_grads=False)
            else:
                kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
                self._schedules[key] = kind(pipes[0], n_micro, loss_fn, scale_grads=False)
        return self._schedules[key]

    def _loss_of_micro(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._micro_loss is not None, "a train schedule runs inside sft_step or policy_step"
        return self._micro_loss(out, target)

    def _run(
        self, batch: B, mbs: int, train: bool, target: Callable[[B], torch.Tensor] | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """One pass of the schedule over `batch` in micro-batches of at most `mbs` rows, padded to the step's
        common shape: (micro-batches run, the last stage's merged output (B', L', C) on the rank that holds it
        (eval), else None). A batch of fewer than pp * mbs rows runs in pp smaller micro-batches."""
        local = torch.tensor([len(batch), batch.input_ids.shape[1]], dtype=torch.int64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.dp_group)  # dp ranks run the same shapes
        rows = int(local[0])
        mbs = min(mbs, max(1, math.ceil(rows / self.pp)))
        n_micro, width = padded_shape(rows, int(local[1]), mbs, self.pp, self.width_bucket)
        padded = pad_batch(batch, n_micro * mbs, width)
        ids, attn = padded.input_ids.to(self.device), padded.attention_mask.to(self.device)
        schedule = self._schedule(n_micro, mbs, width, train)
        kwargs: dict[str, Any] = {"attention_mask": attn, "labels": _next_tokens(ids)}
        if not train:
            with torch.no_grad():
                return n_micro, schedule.step(ids, **kwargs)
        assert target is not None
        if "return_outputs" in inspect.signature(schedule.step).parameters:  # where torch has it: keep none
            kwargs["return_outputs"] = False
        schedule.step(ids, target=target(padded).to(self.device), **kwargs)
        return n_micro, None

    def _holds_last(self) -> bool:
        return any(s.last for s in self.stages)

    def _totals(self, batch: TokenBatch) -> tuple[float, float]:
        """(response tokens, rows) of the global batch (over the dp ranks; the pp ranks share rows)."""
        local = torch.tensor([float(batch.response_mask.sum()), float(len(batch))], dtype=torch.float64)
        dist.all_reduce(local, group=self.dp_group)
        tokens, rows = local.tolist()
        return tokens, rows

    def _global_sums(self, keys: Sequence[str], records: list[list[float]], n_micro: int) -> dict[str, float]:
        """The last stage's share-weighted statistics of the step's n_micro micro-batches, summed over the dp
        ranks, on every pp rank. Only the last n_micro records count: torch 2.13 also calls the loss once on
        placeholder tensors (garbage values) when a schedule infers its shapes at its first step."""
        values = torch.zeros(len(keys), dtype=torch.float64)
        if self._holds_last():
            assert len(records) >= n_micro, "the loss ran on every micro-batch"
            values += torch.tensor(records[len(records) - n_micro :], dtype=torch.float64).sum(0)
        dist.all_reduce(values, group=self.pp_group)  # only the last stage's rank holds them
        dist.all_reduce(values, group=self.dp_group)
        return dict(zip(keys, values.tolist()))

    def _step(self, lr_scale: float) -> tuple[float, float]:
        """Sum the tied copies' gradients, clip to the global norm (the tied weight counted once), step."""
        if self._tied is not None and self._tied.grad is not None:
            grad = self._tied.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self._tied_group)
        params = [p for p in self.modules.parameters() if p.grad is not None]
        counted = [p for p in params if not (p is self._tied and any(s.last for s in self.stages))]
        norm_sq = total_grad_norm(counted).double().square().reshape(1)
        dist.all_reduce(norm_sq, group=self.pp_group)
        grad_norm = norm_sq.sqrt().to(torch.float32).reshape(())
        clip_grads_with_norm(params, self.cfg.grad_clip, grad_norm)
        with self.lock:
            lr = apply_update(self.optimizer, self.scheduler, grad_norm, lr_scale)
            self.updates += 1
        return float(grad_norm), lr

    # ------------------------------------------------ the steps

    def sft_step(
        self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0, max_tokens: int = 0
    ) -> SFTStepStats:
        """One optimizer step of token-mean cross-entropy on the response tokens (as PolicyTrainer.sft_step)."""
        assert not max_tokens, "one shape per schedule: config_rules refuses a token budget"
        self.modules.train()
        totals = self._totals(batch)
        records: list[list[float]] = []

        def micro_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            mask = target[..., 0]
            logp, _ = _responses(out, mask.shape[1])
            share = _micro_share(mask, totals, "token_mean")
            loss = -(logp * mask).sum() / mask.sum().clamp(min=1.0)
            records.append([float(loss.detach()) * share])
            return loss * share

        self._micro_loss = micro_loss
        mask_only: Callable[[TokenBatch], torch.Tensor] = lambda b: b.response_mask.unsqueeze(-1)  # noqa: E731
        n_micro, _ = self._run(batch, micro_batch_size, train=True, target=mask_only)
        grad_norm, lr = self._step(lr_scale)
        return SFTStepStats(grad_norm=grad_norm, lr=lr, **self._global_sums(["loss"], records, n_micro))

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        """One optimizer step of the phase's policy objective (as PolicyTrainer.policy_step)."""
        loss_fn = self.loss
        if loss_fn is None or self.micro_batch_size is None:
            raise RuntimeError("policy_step needs the trainer built with loss= and micro_batch_size=")
        self.modules.train()
        totals = self._totals(batch)
        keys = ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "approx_kl")
        records: list[list[float]] = []
        targets = _policy_targets(batch)  # the flags; the tensor is rebuilt on the padded batch

        def micro_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            mask, old, ref, adv, is_w = target.unbind(-1)  # (b, C) each
            logp, entropy = _responses(out, mask.shape[1])
            obj = loss_fn(
                logp,
                old if targets.has_old else logp.detach(),
                adv if targets.token_advantages else adv[:, 0],
                mask,
                entropy,
                ref if targets.has_ref else None,
                kl_coef,
                is_w if targets.has_is_weights else None,
            )
            share = _micro_share(mask, totals, loss_fn.agg)
            token_share = _micro_share(mask, totals, "token_mean")
            ent = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
            weighted = (
                (obj.loss, share),  # in the order of keys
                (obj.surrogate.loss, share),
                (obj.kl, share),
                (ent, token_share),
                (obj.surrogate.clip_fraction, token_share),
                (obj.surrogate.approx_kl, token_share),
            )
            records.append([float(value.detach()) * weight for value, weight in weighted])
            return obj.loss * share

        self._micro_loss = micro_loss
        n_micro, _ = self._run(
            batch, self.micro_batch_size, train=True, target=lambda b: _policy_targets(b).packed
        )
        grad_norm, lr = self._step(1.0)
        return PolicyStepStats(grad_norm=grad_norm, lr=lr, **self._global_sums(keys, records, n_micro))

    def logprobs(self, batch: TokenBatch, micro_batch_size: int | None = None) -> torch.Tensor:
        """Response log-probs (B, C) of this rank's rows, without gradients, in micro-batches of micro_batch_size
        rows (default: the trainer's): computed on the last stage and broadcast to every rank of the pp group."""
        return self.behaviour_logprobs(batch, 1.0, micro_batch_size)[0]

    def behaviour_logprobs(
        self, batch: TokenBatch, temperature: float, micro_batch_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows' response log-probs (B, C) from one pass without gradients: at T=1 and at
        `temperature` (as training.policy.behaviour_logprobs), on every rank of the pp group."""
        mbs = micro_batch_size or self.micro_batch_size
        if mbs is None:
            raise ValueError("logprobs needs micro_batch_size (the trainer was built without one)")
        self.modules.eval()
        for stage in self.stages:
            stage.temperature = temperature
        _, out = self._run(batch, mbs, train=False)
        rows, width = batch.response_mask.shape
        both = torch.zeros(2, rows, width, dtype=torch.float32, device=self.device)
        if self._holds_last():
            assert out is not None
            padded_width = out.shape[1] - batch.input_ids.shape[1] + width  # the padded batch's C
            length = out.shape[1]
            resp = out[:rows, length - padded_width - 1 : length - 1][:, :width]  # as _responses
            both.copy_(torch.stack([resp[..., 0], resp[..., 2]]))
        last = dist.get_global_rank(self.pp_group, self.pp - 1)
        dist.broadcast(both, src=last, group=self.pp_group)
        return both[0].cpu(), both[1].cpu()
