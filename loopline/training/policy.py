"""The policy trainer: log-probs of response tokens, SFT and GRPO update steps, optimizer state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from loopline.algorithms.losses import entropy_from_logprobs
from loopline.algorithms.policy_loss import PolicyLoss
from loopline.algorithms.preference import (
    PreferenceLossOutput,
    dpo_hinge_loss,
    dpo_ipo_loss,
    dpo_robust_loss,
    dpo_sigmoid_loss,
)
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.data.preference import PairBatch
from loopline.training.config import DPOConfig, GRPOConfig, OptimConfig
from loopline.training.logits import TokenScores, at_least_float32, head_scores, hidden_states_out
from loopline.training.micro import micro_batches, pair_micro_batches
from loopline.training.optim import apply_update, build_optimizer
from loopline.training.packing import pack, packed_forward
from loopline.training.parallel import (
    all_reduce_sum,
    clip_grad_norm,
    full_optimizer_state,
    is_sharded,
    load_full_optimizer_state,
)
from loopline.training.prefix import shared_prompt_logits, shared_prompts
from loopline.training.replay import RouteReplay, engine_routes
from loopline.training.router import RouterStats


def grpo_loss(cfg: GRPOConfig, max_len: int | None = None) -> PolicyLoss:
    """The policy objective of a GRPO-family phase, built once from its config (grpo.policy_loss, clip_low/high,
    dual_clip, loss_agg, entropy_coef, kl_estimator). max_len: the response width fixed_length aggregation
    divides by (default grpo.sampling.max_new_tokens)."""
    return PolicyLoss(
        surrogate=cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        agg=cfg.loss_agg, max_len=cfg.sampling.max_new_tokens if max_len is None else max_len,
        entropy_coef=cfg.entropy_coef, kl_estimator=cfg.kl_estimator,
    )  # fmt: skip


def _dpo_sigmoid(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, pairs: PairBatch, cfg: DPOConfig
) -> PreferenceLossOutput:
    return dpo_sigmoid_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)


def _dpo_robust(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, pairs: PairBatch, cfg: DPOConfig
) -> PreferenceLossOutput:
    return dpo_robust_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing)


def _dpo_hinge(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, pairs: PairBatch, cfg: DPOConfig
) -> PreferenceLossOutput:
    return dpo_hinge_loss(pc, pr, rc, rr, cfg.beta)


def _dpo_ipo(
    pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, pairs: PairBatch, cfg: DPOConfig
) -> PreferenceLossOutput:
    lengths_c, lengths_r = pairs.chosen.response_mask.sum(1), pairs.rejected.response_mask.sum(1)
    return dpo_ipo_loss(pc, pr, rc, rr, lengths_c, lengths_r, cfg.beta)


# dpo.loss -> the loss; each takes (policy chosen, policy rejected, ref chosen, ref rejected, pairs, cfg)
DPO_LOSSES: dict[str, Callable[..., PreferenceLossOutput]] = {
    "sigmoid": _dpo_sigmoid,
    "robust": _dpo_robust,
    "hinge": _dpo_hinge,
    "ipo": _dpo_ipo,
}


def sequence_logprobs(
    model: PreTrainedModel,
    batch: TokenBatch,
    packed: bool = False,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """Summed log-prob of each row's response tokens under `model`, (B,)."""
    logp, _ = response_logprobs(
        model, batch, packed=packed, share_prompts=share_prompts, chunk_tokens=chunk_tokens
    )
    return (logp * batch.response_mask).sum(dim=1)


def response_logprobs(
    model: PreTrainedModel,
    batch: TokenBatch,
    with_entropy: bool = False,
    packed: bool = False,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, C) of the response tokens under `model`, and their entropies if asked.
    packed: one forward over the real tokens only (model.packing); 0 on padding. share_prompts: padded rows
    with the same prompt share one forward of it (model.share_prompts). chunk_tokens: the head's logits
    chunk_tokens positions at a time, never all of them (model.logits_chunk_tokens; 0 = all at once).
    entropy_grad=False: the entropies are a statistic (no gradient flows through them)."""
    if chunk_tokens:
        scores, lay_out = _chunked_scores(
            model, batch, packed, share_prompts, chunk_tokens, with_entropy, entropy_grad=entropy_grad
        )
        entropy = lay_out(scores.entropy) if scores.entropy is not None else None
        return lay_out(scores.logp), entropy
    outputs, targets, lay_out = _response_outputs(model, batch, packed, share_prompts)
    every = torch.log_softmax(
        at_least_float32(outputs), dim=-1
    )  # one pass serves the token log-probs and the entropy
    logp = every.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = (
        lay_out(entropy_from_logprobs(every if entropy_grad else every.detach())) if with_entropy else None
    )
    return lay_out(logp), entropy


def behaviour_logprobs(
    model: PreTrainedModel,
    batch: TokenBatch,
    temperature: float,
    packed: bool = False,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Response-token log-probs (B, C) from one forward pass: as trained (T=1, the GRPO ratio's denominator)
    and as sampled (logits / temperature, what an engine reports; T=1 when greedy)."""
    tempered = temperature not in (0.0, 1.0)
    if chunk_tokens:
        scores, lay_out = _chunked_scores(
            model, batch, packed, share_prompts, chunk_tokens, temperature=temperature if tempered else None
        )
        trained = lay_out(scores.logp)
        return trained, lay_out(scores.tempered) if scores.tempered is not None else trained
    logits, targets, lay_out = _response_outputs(model, batch, packed, share_prompts)
    logits, targets = at_least_float32(logits), targets.unsqueeze(-1)
    trained = lay_out(torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1))
    if not tempered:
        return trained, trained
    return trained, lay_out(torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets).squeeze(-1))


def _chunked_scores(
    model: PreTrainedModel,
    batch: TokenBatch,
    packed: bool,
    share_prompts: bool,
    chunk_tokens: int,
    with_entropy: bool = False,
    temperature: float | None = None,
    entropy_grad: bool = True,
) -> tuple[TokenScores, Callable[[torch.Tensor], torch.Tensor]]:
    """The forwards of _response_outputs run to the hidden states, then the head chunk by chunk: per-token
    scores over the flattened response positions, and what lays a (positions,) value out as (B, C)."""
    with hidden_states_out(model) as head:
        hidden, targets, lay_out = _response_outputs(model, batch, packed, share_prompts)
    scores = head_scores(
        head,
        hidden.reshape(-1, hidden.shape[-1]),
        targets.reshape(-1),
        chunk_tokens,
        with_entropy,
        temperature,
        entropy_grad,
    )
    shape = targets.shape
    return scores, lambda values: lay_out(values.view(shape))


def _response_outputs(
    model: PreTrainedModel, batch: TokenBatch, packed: bool, share_prompts: bool
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """What the model outputs at the positions that predict the response tokens (its logits, or its hidden states
    under hidden_states_out), those tokens, and what lays a value per token out as (B, C). Padded: (B, C, X),
    position t predicting token t + 1, each distinct prompt forwarded once when rows share one (a GRPO group) and
    share_prompts. Packed: (N, X) for the N real response tokens only, each read at the token before it in its
    packed row."""
    p = batch.prompt_len
    targets = batch.input_ids[:, p:]  # (B, C)
    # a sharded model's ranks must all make the same forwards: it shares on every slice, distinct prompts or not
    shared = shared_prompts(batch, always=is_sharded(model)) if share_prompts and not packed else None
    if shared is not None:
        outputs = shared_prompt_logits(model, batch, shared)
        if outputs is not None:
            return outputs, targets, lambda values: values
    if not packed:
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        with engine_routes(model, batch.routes):
            outputs = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=positions,
                use_cache=False,
            ).logits  # no cache: nothing reads it, and a checkpointed layer could not recompute one it fills
        return outputs[:, p - 1 : -1, :], targets, lambda values: values
    packing = pack(batch.input_ids, batch.attention_mask)
    outputs = packed_forward(model, packing, batch.routes).logits.flatten(0, 1)  # (R * W, X)
    real = batch.attention_mask[:, p:].bool()  # (B, C)
    # a response token's predecessor is the token before it in its sequence (a prompt has at least one)
    before = (packing.slot[:, p:][real] - 1).clamp(min=0)

    def lay_out(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(real.shape)
        out[real] = values
        return out

    return outputs[before], targets[real], lay_out


def _share(micro: TokenBatch, totals: tuple[float, float], agg: str) -> float:
    """Weight of a micro-batch's mean in the global batch's mean, so accumulation is exact.

    `totals` = (response tokens, rows) of the global batch: over every rank when data-parallel.
    """
    tokens, rows = totals
    if agg == "token_mean":
        return float(micro.response_mask.sum()) / max(1.0, tokens)
    return len(micro) / rows


@dataclass
class SFTStepStats:
    """What one SFT step reports (PolicyTrainer.sft_step): the token-mean cross-entropy over the global batch."""

    loss: float  # token mean of the response tokens' NLL
    grad_norm: float  # before clipping; not finite when the update was skipped
    lr: float
    # an MoE policy's router metrics (RouterStats), set after the rest: not a float like them
    router: dict[str, float] = field(default_factory=dict, init=False)

    @property
    def extra(self) -> dict[str, float]:
        """The statistics besides loss, grad_norm and lr, by metrics-row name: an MoE policy's router metrics."""
        return dict(self.router)


@dataclass
class PolicyStepStats:
    """What one RL policy step reports (PolicyTrainer.policy_step); every value a mean over the global batch."""

    loss: float  # the objective: surrogate - entropy bonus + KL term (aggregated as grpo.loss_agg)
    grad_norm: float  # before clipping; not finite when the update was skipped
    lr: float
    policy_loss: float  # the surrogate alone
    kl: float  # the KL-to-reference term (0 when it is off), aggregated as the loss
    entropy: float  # token mean of the policy's entropy
    clip_fraction: float  # token fraction whose ratio was clipped away
    approx_kl: float  # token mean of the k3 estimate of KL(old || new)
    # an MoE policy's router metrics (RouterStats), set after the rest: not a float like them
    router: dict[str, float] = field(default_factory=dict, init=False)

    @property
    def extra(self) -> dict[str, float]:
        """The statistics besides loss, grad_norm and lr, by metrics-row name, in the row's order."""
        names = ("policy_loss", "kl", "entropy", "clip_fraction", "approx_kl")
        return {**{name: getattr(self, name) for name in names}, **self.router}


@dataclass
class DPOStepStats:
    """What one DPO step reports (PolicyTrainer.dpo_step); every value a mean over the global batch's pairs."""

    loss: float  # the objective: pref_loss + dpo.nll_coef * chosen_nll
    grad_norm: float  # before clipping; not finite when the update was skipped
    lr: float
    pref_loss: float  # the dpo.loss term alone
    chosen_nll: float  # the chosen completion's per-token NLL (RPO's anchor)
    pref_accuracy: float  # fraction of pairs whose implicit reward ranks chosen above rejected
    reward_margin: float  # implicit reward of chosen minus rejected
    chosen_reward: float  # implicit reward beta * (log p - log p_ref) of the chosen completion
    rejected_reward: float  # the same of the rejected completion
    # an MoE policy's router metrics (RouterStats), set after the rest: not a float like them
    router: dict[str, float] = field(default_factory=dict, init=False)

    @property
    def extra(self) -> dict[str, float]:
        """The statistics besides loss, grad_norm and lr, by metrics-row name, in the row's order."""
        names = (
            "pref_loss",
            "chosen_nll",
            "pref_accuracy",
            "reward_margin",
            "chosen_reward",
            "rejected_reward",
        )
        return {**{name: getattr(self, name) for name in names}, **self.router}


class PolicyTrainer:
    """Owns the trainable model, its optimizer and LR schedule; one method per kind of update.

    Data-parallel: pass the data-parallel ranks' `group` and a model under FSDP2 (training.parallel.shard_model,
    which sums gradients). Each rank steps on its slice of the global batch; micro-batches are weighted
    by global token and row counts, so N ranks make the same update as one rank on the whole batch.
    Every rank must run the same number of micro-batches (equal slices): FSDP2 gathers in each forward.
    With tensor parallelism (training.parallel.parallelize) `group` is the mesh's "dp" group: the TP
    ranks of one dp rank get the same rows and must not be counted twice.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        optim: OptimConfig,
        total_steps: int,
        group: dist.ProcessGroup | None = None,
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
        packed: bool = False,
        share_prompts: bool = True,
        chunk_tokens: int = 0,
        max_tokens: int = 0,
        router_aux_loss_coef: float | None = None,
        routing_replay: bool | None = None,
    ) -> None:
        """loss, micro_batch_size: the RL phase's policy objective (grpo_loss) and sequences per forward/backward,
        which policy_step applies; an SFT phase leaves them None. packed: forwards over packed sequences
        (model.packing); share_prompts: padded rows with one prompt share its forward (model.share_prompts);
        chunk_tokens: the head's logits that many tokens at a time (model.logits_chunk_tokens; 0 = all);
        max_tokens: policy_step's micro-batches by token count instead (grpo.max_tokens_per_micro_batch; 0 = off);
        router_aux_loss_coef: an MoE model's load-balancing loss weight (model.router_aux_loss_coef);
        routing_replay: an MoE model's forwards against the engine's routes its batches carry (training.replay),
        imposing them if True (grpo.routing_replay=true), only counting route_mismatch if False; None: neither."""
        self.model = model
        self.packed = packed
        self.share_prompts = share_prompts
        self.chunk_tokens = chunk_tokens
        self.cfg = optim
        self.group = group
        self.loss = loss
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens
        self.router = RouterStats(model, router_aux_loss_coef)  # an MoE model's; nothing for a dense one
        moe = bool(self.router.layers)
        self.replay = RouteReplay(model, routing_replay) if moe and routing_replay is not None else None
        self.optimizer, self.scheduler = build_optimizer(model, optim, total_steps)
        self.updates = 0  # optimizer steps taken by this trainer (skipped non-finite ones included)
        self.lock = threading.Lock()  # held while the update changes the weights and optimizer state

    def _totals(self, batch: TokenBatch) -> tuple[float, float]:
        """(response tokens, rows) of the global batch: one all_reduce over the group per step."""
        local = torch.tensor([float(batch.response_mask.sum()), float(len(batch))], dtype=torch.float64)
        tokens, rows = all_reduce_sum(local, self.group).tolist()
        return tokens, rows

    def _global_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """Share-weighted statistics summed over the group (each rank holds its part of each mean)."""
        total = all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64), self.group)
        return dict(zip(sums, total.tolist()))

    def _step(self, lr_scale: float = 1.0) -> tuple[float, float]:
        """The update: a step's last collective is the grad norm's, so a rank past it commits the step whatever
        its peers do (a healed trainer tells committed steps from lost ones by `updates`)."""
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.grad_clip)  # the step's last collective
        with (
            self.lock
        ):  # the update and its count change together: a healing driver reads them from another thread
            lr = apply_update(self.optimizer, self.scheduler, grad_norm, lr_scale)
            self.updates += 1
        return float(grad_norm), lr

    def sft_step(
        self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0, max_tokens: int = 0
    ) -> SFTStepStats:
        """One optimizer step of token-mean cross-entropy on response tokens (prompt masked), at the schedule's
        learning rate times lr_scale; max_tokens: micro-batches by token count (sft.max_tokens_per_micro_batch)."""
        self.model.train()
        totals = self._totals(batch)
        total = 0.0
        field = "sft.max_tokens_per_micro_batch"
        for micro in micro_batches(batch, micro_batch_size, max_tokens, self.packed, self.group, field):
            logp, _ = response_logprobs(
                self.model,
                micro,
                packed=self.packed,
                share_prompts=self.share_prompts,
                chunk_tokens=self.chunk_tokens,
            )
            mask = micro.response_mask
            loss = -(logp * mask).sum() / mask.sum().clamp(min=1.0)
            (self.router.objective(loss) * _share(micro, totals, "token_mean")).backward()
            total += float(loss.detach()) * _share(micro, totals, "token_mean")
        sums = self._global_sums({"loss": total})
        router = self.router.metrics(self.group)  # before the step's last collective, the grad norm's
        grad_norm, lr = self._step(lr_scale)
        stats = SFTStepStats(grad_norm=grad_norm, lr=lr, **sums)
        stats.router = router
        return stats

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        """One optimizer step of the phase's policy objective (self.loss) at this step's KL coefficient."""
        if self.loss is None or self.micro_batch_size is None:
            raise RuntimeError(
                "policy_step needs the trainer built with loss= and micro_batch_size= (an RL phase)"
            )
        return self._policy_step(batch, self.loss, kl_coef, self.micro_batch_size)

    def _policy_step(
        self, batch: RolloutBatch, loss_fn: PolicyLoss, kl_coef: float, micro_batch_size: int
    ) -> PolicyStepStats:
        self.model.train()
        sums = {
            "loss": 0.0,
            "policy_loss": 0.0,
            "kl": 0.0,
            "entropy": 0.0,
            "clip_fraction": 0.0,
            "approx_kl": 0.0,
        }
        totals = self._totals(batch)
        field = "grpo.max_tokens_per_micro_batch"
        for micro in micro_batches(batch, micro_batch_size, self.max_tokens, self.packed, self.group, field):
            share = _share(micro, totals, loss_fn.agg)
            token_share = _share(micro, totals, "token_mean")  # for the token-mean statistics
            logp, entropy = response_logprobs(
                self.model,
                micro,
                with_entropy=True,
                packed=self.packed,
                share_prompts=self.share_prompts,
                chunk_tokens=self.chunk_tokens,
                entropy_grad=bool(loss_fn.entropy_coef),  # else only the step's entropy statistic
            )
            assert entropy is not None
            # on-policy with a single update per rollout: the behaviour log-probs equal the current
            old = micro.old_logprobs if micro.old_logprobs is not None else logp.detach()
            mask = micro.response_mask
            out = loss_fn(
                logp, old, micro.advantages, mask, entropy, micro.ref_logprobs, kl_coef, micro.is_weights
            )
            ent = _masked_mean(entropy, mask)
            (self.router.objective(out.loss) * share).backward()
            for key, value, weight in (
                ("loss", out.loss, share),
                ("policy_loss", out.surrogate.loss, share),
                ("kl", out.kl, share),
                ("entropy", ent, token_share),
                ("clip_fraction", out.surrogate.clip_fraction, token_share),
                ("approx_kl", out.surrogate.approx_kl, token_share),
            ):
                sums[key] += float(value.detach()) * weight
        sums = self._global_sums(sums)
        router = self.router.metrics(self.group)  # before the step's last collective, the grad norm's
        if self.replay is not None:
            router.update(self.replay.metrics(self.group))
        grad_norm, lr = self._step()
        stats = PolicyStepStats(grad_norm=grad_norm, lr=lr, **sums)
        stats.router = router
        return stats

    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        """One optimizer step of the dpo.loss objective; pairs carry their reference log-probs."""
        if pairs.ref_chosen is None or pairs.ref_rejected is None:
            raise ValueError("dpo_step needs the pairs' reference log-probs (ref_chosen, ref_rejected)")
        self.model.train()
        dpo_loss = DPO_LOSSES[cfg.loss]
        sums = dict.fromkeys(("loss", "pref_loss", "chosen_nll", "pref_accuracy", "reward_margin"), 0.0)
        sums.update(chosen_reward=0.0, rejected_reward=0.0)
        _, rows = self._totals(pairs.chosen)  # pairs over every rank: each rank's share of the global mean
        budget, field = cfg.max_tokens_per_micro_batch, "dpo.max_tokens_per_micro_batch"
        for micro in pair_micro_batches(pairs, cfg.micro_batch_size, budget, self.packed, self.group, field):
            share = len(micro) / rows  # every loss is a mean over pairs
            chosen_tokens, _ = response_logprobs(
                self.model,
                micro.chosen,
                packed=self.packed,
                share_prompts=self.share_prompts,
                chunk_tokens=self.chunk_tokens,
            )  # (b, C)
            mask = micro.chosen.response_mask
            chosen = (chosen_tokens * mask).sum(dim=1)  # (b,)
            rejected = sequence_logprobs(
                self.model, micro.rejected, self.packed, self.share_prompts, self.chunk_tokens
            )  # (b,)
            out = dpo_loss(chosen, rejected, micro.ref_chosen, micro.ref_rejected, micro, cfg)
            # RPO: the chosen completion's NLL (per-token mean, then mean over pairs) anchors its likelihood
            nll = (-chosen / mask.sum(dim=1).clamp(min=1.0)).mean()
            loss = out.loss + cfg.nll_coef * nll
            (self.router.objective(loss) * share).backward()
            for key, value in (
                ("loss", loss.detach()),
                ("pref_loss", out.loss.detach()),
                ("chosen_nll", nll.detach()),
                ("pref_accuracy", (out.chosen_rewards > out.rejected_rewards).float().mean()),
                ("reward_margin", (out.chosen_rewards - out.rejected_rewards).mean()),
                ("chosen_reward", out.chosen_rewards.mean()),
                ("rejected_reward", out.rejected_rewards.mean()),
            ):
                sums[key] += float(value) * share
        sums = self._global_sums(sums)
        router = self.router.metrics(self.group)  # before the step's last collective, the grad norm's
        grad_norm, lr = self._step()
        stats = DPOStepStats(grad_norm=grad_norm, lr=lr, **sums)
        stats.router = router
        return stats

    def state_dict(self) -> dict:
        """Optimizer state by parameter name (whole tensors; on rank 0 only when sharded) and LR schedule."""
        return {
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` (every rank passes the whole of it; sharded ranks keep their part)."""
        load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
