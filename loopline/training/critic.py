"""Scalar heads on a transformer body: PPO's critic (a value per response position) and reward models.

`ScalarModel` is the policy's transformer body (copied, so it trains on its own) plus a linear head on the
last hidden state. The critic reads it at every response position; a reward model reads it at each
sequence's last token. `CriticTrainer` fits the values to GAE returns with PPO's clipped value loss.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from loopline.algorithms.losses import clipped_value_loss
from loopline.config import CriticConfig
from loopline.data.batches import TokenBatch, split_rows
from loopline.training.policy import StepStats, build_optimizer, optimizer_step


class ScalarModel(nn.Module):
    """A transformer body and a linear head: one scalar per position, (B, L)."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        # start at 0: the first values (or rewards) carry no opinion
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel) -> ScalarModel:
        """A copy of the causal LM's transformer body (without the LM head) with a fresh scalar head."""
        body = copy.deepcopy(policy.base_model).requires_grad_(True)
        return cls(body, policy.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scalar at every position, (B, L) float32."""
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
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


class CriticTrainer:
    """Owns the value model and its optimizer: values for GAE, and clipped value-loss steps."""

    def __init__(self, model: ScalarModel, cfg: CriticConfig, total_steps: int) -> None:
        self.model = model
        self.cfg = cfg
        self.optimizer, self.scheduler = build_optimizer(model, cfg.optim, total_steps)

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Values (B, C) of the response positions, without gradients."""
        self.model.eval()
        with torch.no_grad():
            return torch.cat(
                [self.model.response_values(m) for m in split_rows(batch, self.cfg.micro_batch_size)]
            )

    def step(self, batch: ValueBatch) -> StepStats:
        """One optimizer step of token-mean clipped value loss over micro-batches."""
        self.model.train()
        tokens = float(batch.response_mask.sum().clamp(min=1.0))
        sums = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0}
        for micro in split_rows(batch, self.cfg.micro_batch_size):
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
        loss = sums.pop("value_loss")
        return StepStats(loss=loss, grad_norm=grad_norm, lr=lr, extra=sums)
