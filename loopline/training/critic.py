"""Scalar heads on a transformer body: PPO's critic (a value per response position) and reward models.

`ScalarModel` is the policy's transformer body (copied, so it trains on its own) plus a linear head on the
last hidden state. The critic reads it at every response position; a reward model reads it at each
sequence's last token. `CriticTrainer` fits the values to GAE returns with PPO's clipped value loss.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from loopline.algorithms.losses import clipped_value_loss
from loopline.algorithms.preference import bradley_terry_loss
from loopline.data.batches import TokenBatch, collate, split_rows
from loopline.data.preference import PairBatch
from loopline.training.config import CriticConfig, RewardModelConfig
from loopline.training.micro import micro_batches, pair_micro_batches
from loopline.training.optim import build_optimizer, optimizer_step
from loopline.training.packing import pack, packed_forward
from loopline.training.parallel import all_reduce_sum, apply_activation_checkpointing


class ScalarModel(nn.Module):
    """A transformer body and a linear head: one scalar per position, (B, L)."""

    def __init__(self, body: nn.Module, hidden_size: int, packed: bool = False) -> None:
        """packed: forwards over packed sequences (model.packing)."""
        super().__init__()
        self.body = body
        self.packed = packed
        self.head = nn.Linear(hidden_size, 1)
        # start at 0: the first values (or rewards) carry no opinion
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(
        cls, policy: PreTrainedModel, packed: bool = False, checkpointing: str = "none"
    ) -> ScalarModel:
        """A copy of the causal LM's transformer body (without the LM head) with a fresh scalar head; its decoder
        layers recomputed in backward as `checkpointing` says (training.activation_checkpointing), whatever the
        policy's own.

        The copy trains what the policy trains: every weight, or only its LoRA adapters (model.lora)."""
        body = copy.deepcopy(policy.base_model)
        for (
            module
        ) in body.modules():  # a checkpointed policy's wrapped forwards (instance attributes) stay behind
            module.__dict__.pop("forward", None)
        return cls(apply_activation_checkpointing(body, checkpointing), policy.config.hidden_size, packed)

    def save(self, path: str | Path) -> None:
        """The body as a Hugging Face directory (transformers' AutoModel loads it) plus head.safetensors."""
        path = Path(path)
        self.body.save_pretrained(path)  # type: ignore[operator]  # the body is a Hugging Face model
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, path / "head.safetensors")

    @classmethod
    def load(cls, path: str | Path, packed: bool = False) -> ScalarModel:
        """A model written by save()."""
        path = Path(path)
        if not (path / "head.safetensors").is_file():
            raise ValueError(f"'{path}' is not a saved scalar model (no head.safetensors)")
        body = AutoModel.from_pretrained(path)
        model = cls(body, body.config.hidden_size, packed)
        model.head.load_state_dict(load_file(path / "head.safetensors"))
        return model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scalar at every position, (B, L) float32 (0 on padding when packed)."""
        if self.packed:
            packing = pack(input_ids, attention_mask)
            hidden = packed_forward(self.body, packing).last_hidden_state  # (R, W, H)
            return packing.unpack(self.head(hidden.float()).squeeze(-1))
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # no cache: nothing reads it, and a checkpointed layer could not recompute one it fills
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        )
        return self.head(hidden.last_hidden_state.float()).squeeze(-1)

    def response_values(self, batch: TokenBatch) -> torch.Tensor:
        """Value of the state before each response token, (B, C): position t predicts token t + 1."""
        out = self(batch.input_ids, batch.attention_mask)
        return out[:, batch.prompt_len - 1 : -1]

    def last_token_scores(self, batch: TokenBatch) -> torch.Tensor:
        """The scalar at each sequence's last real token, (B,) (prompts are left-padded, responses right-padded)."""
        out = self(batch.input_ids, batch.attention_mask)  # (B, L)
        length = batch.response_mask.sum(dim=1).long()  # (B,) response tokens
        last = batch.prompt_len - 1 + length  # an empty response scores the prompt's last token
        return out.gather(1, last.unsqueeze(1)).squeeze(1)


@dataclass
class ValueBatch(TokenBatch):
    """A rollout's tokens with the critic's targets."""

    old_values: torch.Tensor  # (B, C) values at rollout time (the clip's centre)
    returns: torch.Tensor  # (B, C) GAE returns, the regression targets


@dataclass
class ValueStepStats:
    """What one critic step reports (CriticTrainer.step); every value a token mean over the global batch."""

    loss: float  # the clipped value loss
    grad_norm: float
    lr: float
    clip_fraction: float  # token fraction where the clipped error was the larger
    value_mean: float  # the critic's mean value over the response tokens

    @property
    def extra(self) -> dict[str, float]:
        """The statistics besides loss, grad_norm and lr, by metrics-row name, in the row's order."""
        return {"value_clip_fraction": self.clip_fraction, "value_mean": self.value_mean}


class CriticTrainer:
    """Owns the value model and its optimizer: values for GAE, and clipped value-loss steps."""

    def __init__(
        self,
        model: ScalarModel,
        cfg: CriticConfig,
        total_steps: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """group: the data-parallel ranks of a model under FSDP2 (training.parallel.shard_model sums gradients);
        each rank then steps on its slice and the loss is weighted by global token counts, as PolicyTrainer."""
        self.model = model
        self.cfg = cfg
        self.group = group
        self.optimizer, self.scheduler = build_optimizer(model, cfg.optim, total_steps)

    def state_dict(self) -> dict:
        """Weights, optimizer state and LR schedule: what a checkpoint needs to continue the critic exactly."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() of a critic of the same shape."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Values (B, C) of the response positions, without gradients."""
        self.model.eval()
        with torch.no_grad():
            return torch.cat(
                [self.model.response_values(m) for m in split_rows(batch, self.cfg.micro_batch_size)]
            )

    def step(self, batch: ValueBatch) -> ValueStepStats:
        """One optimizer step of token-mean clipped value loss over micro-batches."""
        self.model.train()
        if self.group is None:
            tokens = float(batch.response_mask.sum().clamp(min=1.0))
        else:  # the global batch's tokens: each rank's loss is its share of the whole batch's token mean
            local = batch.response_mask.sum().to(torch.float64).reshape(1)
            tokens = max(float(all_reduce_sum(local, self.group)[0]), 1.0)
        sums = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0}
        budget, packed = self.cfg.max_tokens_per_micro_batch, self.model.packed
        field = "critic.max_tokens_per_micro_batch"
        for micro in micro_batches(batch, self.cfg.micro_batch_size, budget, packed, self.group, field):
            share = float(micro.response_mask.sum()) / tokens  # token_mean over the whole batch
            values = self.model.response_values(micro)
            out = clipped_value_loss(
                values, micro.old_values, micro.returns, micro.response_mask, self.cfg.value_clip
            )
            (out.loss * share).backward()
            mean = (values.detach() * micro.response_mask).sum() / micro.response_mask.sum().clamp(min=1.0)
            sums["value_loss"] += float(out.loss.detach()) * share
            sums["value_clip_fraction"] += float(out.clip_fraction) * share
            sums["value_mean"] += float(mean) * share
        grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, self.cfg.optim.grad_clip)
        if self.group is not None:  # each rank holds its share of each global mean
            total = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64), self.group)
            sums = dict(zip(sums, total.tolist()))
        return ValueStepStats(
            loss=sums["value_loss"],
            grad_norm=grad_norm,
            lr=lr,
            clip_fraction=sums["value_clip_fraction"],
            value_mean=sums["value_mean"],
        )


@dataclass
class RewardStepStats:
    """What one reward-model step reports (RewardTrainer.step); every value a mean over the global batch's pairs."""

    loss: float  # the Bradley-Terry loss (with rm.margin and centring)
    grad_norm: float  # before clipping; not finite when the update was skipped
    lr: float
    pair_accuracy: float  # fraction of pairs scored chosen > rejected (a tie counts half)
    reward_margin: float  # score of chosen minus rejected
    reward_mean: float  # mean score of chosen and rejected

    @property
    def extra(self) -> dict[str, float]:
        """The statistics besides loss, grad_norm and lr, by metrics-row name, in the row's order."""
        return {
            "pair_accuracy": self.pair_accuracy,
            "reward_margin": self.reward_margin,
            "reward_mean": self.reward_mean,
        }


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Fraction of pairs scored chosen > rejected, a tie counting half (an untrained head scores 50%)."""
    return float((chosen > rejected).float().mean() + 0.5 * (chosen == rejected).float().mean())


class RewardTrainer:
    """Owns a reward model (ScalarModel) and its optimizer: Bradley-Terry steps on preference pairs."""

    def __init__(
        self,
        model: ScalarModel,
        cfg: RewardModelConfig,
        total_steps: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """group: the data-parallel ranks of a model under FSDP2 (gradients summed): each rank steps on its slice
        of the pairs, its loss weighted by its share of the global pair count, as PolicyTrainer."""
        self.model = model
        self.cfg = cfg
        self.group = group
        self.optimizer, self.scheduler = build_optimizer(model, cfg.optim, total_steps)

    def scores(self, batch: TokenBatch) -> torch.Tensor:
        """Reward of each sequence (its last token), (B,), without gradients."""
        self.model.eval()
        with torch.no_grad():
            parts = split_rows(batch, self.cfg.micro_batch_size)
            return torch.cat([self.model.last_token_scores(m) for m in parts])

    def step(self, pairs: PairBatch) -> RewardStepStats:
        """One optimizer step of the Bradley-Terry loss (margin = the pair's + rm.margin, centring)."""
        self.model.train()
        sums = {"loss": 0.0, "pair_accuracy": 0.0, "reward_margin": 0.0, "reward_mean": 0.0}
        rows = len(pairs)
        if self.group is not None:  # the pairs of every rank
            rows = int(all_reduce_sum(torch.tensor([float(rows)], dtype=torch.float64), self.group)[0])
        budget, packed = self.cfg.max_tokens_per_micro_batch, self.model.packed
        field = "rm.max_tokens_per_micro_batch"
        for micro in pair_micro_batches(pairs, self.cfg.micro_batch_size, budget, packed, self.group, field):
            share = len(micro) / rows  # the loss is a mean over pairs
            chosen = self.model.last_token_scores(micro.chosen)  # (b,)
            rejected = self.model.last_token_scores(micro.rejected)  # (b,)
            loss = bradley_terry_loss(chosen, rejected, micro.margin + self.cfg.margin, self.cfg.center_coef)
            (loss * share).backward()
            chosen, rejected = chosen.detach(), rejected.detach()
            sums["loss"] += float(loss.detach()) * share
            sums["pair_accuracy"] += pairwise_accuracy(chosen, rejected) * share
            sums["reward_margin"] += float((chosen - rejected).mean()) * share
            sums["reward_mean"] += float((chosen + rejected).mean() / 2) * share
        grad_norm, lr = optimizer_step(self.model, self.optimizer, self.scheduler, self.cfg.optim.grad_clip)
        if self.group is not None:  # each rank holds its share of each global mean
            total = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64), self.group)
            sums = dict(zip(sums, total.tolist()))
        return RewardStepStats(grad_norm=grad_norm, lr=lr, **sums)


class RewardModelScorer:
    """A trained reward model (written by `loopline rm`) scoring prompt + completion token ids."""

    def __init__(self, model: ScalarModel, pad_id: int, eos_id: int | None, batch_size: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.pad_id, self.eos_id, self.batch_size = pad_id, eos_id, batch_size

    @classmethod
    def load(
        cls, path: str | Path, pad_id: int, eos_id: int | None, batch_size: int, packed: bool = False
    ) -> RewardModelScorer:
        """The scalar model saved at `path` (ScalarModel.save); packed: scores over packed sequences."""
        return cls(ScalarModel.load(path, packed), pad_id, eos_id, batch_size)

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """Reward of each completion, (B,). EOS is appended where missing: the model was fit on completions
        that end with it (as SFT targets do), while an engine's completion may end at a stop string."""
        eos = [] if self.eos_id is None else [self.eos_id]
        ended = [c if c[-1:] == eos else c + eos for c in completions]
        batch = collate(prompts, ended, self.pad_id)
        with torch.no_grad():
            return torch.cat([self.model.last_token_scores(m) for m in split_rows(batch, self.batch_size)])
