"""The training sections: the optimizer, and each phase's step settings (SFT, the GRPO family and PPO's critic,
DPO, the reward model, and the RL reward that scores with it through training.critic's RewardModelScorer).
Read by training.policy and training.critic and by the loops that drive them; kept here, the lowest room that
reads them. Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from loopline.rollout.config import SamplingConfig
from loopline.section import LocalPath, Section


def token_budget_field() -> Any:
    """A section's max_tokens_per_micro_batch (0 = off): the same meaning in every section that trains."""
    return Field(
        0,
        ge=0,
        description="Group the rows into micro-batches by their real token count (prompt + completion; packed: "
        "the packed length) so that each micro-batch holds at most this many padded tokens, first-fit "
        "decreasing; every data-parallel rank runs as many. Replaces micro_batch_size; the loss is normalised "
        "as without it. Must hold the longest row. 0 = off (micro_batch_size rows).",
    )


# parameters (as float32 bytes) one call of AdamW's step takes (training/optim.py step_in_chunks): its foreach
# temporaries are one chunk's, not the model's; a larger tensor is a chunk alone
STEP_CHUNK_BYTES = 256 * 2**20


class OptimConfig(Section):
    """AdamW with linear warmup and a schedule."""

    lr: float = Field(3e-4, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr / peak lr for decaying schedules.")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global grad norm.")


class SFTConfig(Section):
    """Supervised warm start (prompt-masked next-token loss)."""

    steps: int = Field(
        800, ge=0, description="Optimizer steps (at most, with stop_at_accuracy); 0 skips SFT."
    )
    batch_size: int = Field(64, gt=0, description="Sequences per step.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    max_tokens_per_micro_batch: int = token_budget_field()
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=2e-3, schedule="cosine", warmup_steps=30)
    )
    eval_every: int = Field(100, ge=0, description="Held-out eval every N steps; 0 = only at the end.")
    stop_at_accuracy: float | None = Field(
        0.35,
        ge=0.0,
        le=1.0,
        description="End SFT at the first check where greedy accuracy on the validation split (data.task.num_val, "
        "built-in task; file datasets have none, so SFT runs all steps) reaches this; null = run all steps. "
        "Makes the warm start a fixed skill level, not a fixed step count whose result moves with float noise.",
    )
    check_every: int = Field(
        5,
        gt=0,
        description="Steps between validation checks (stop_at_accuracy) while the last check was below half "
        "the target; above that, every step, so that a steep rise is not overshot.",
    )
    near_target_lr: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Learning-rate multiplier once a check has passed half the target (stop_at_accuracy): the rise "
        "to the target is steep, and smaller steps land nearer it instead of jumping past.",
    )
    coarse_val: int = Field(
        256,
        gt=0,
        description="Validation problems a check reads while the last check was below half the target (the "
        "split's first N): enough to see the rise begin, cheap enough to check often. Checks past half the target "
        "read the whole split, and only they can end SFT.",
    )

    def fine_check(self, last_accuracy: float) -> bool:
        """Whether the next check reads the whole validation split (past half the target) or its first coarse_val."""
        return self.stop_at_accuracy is not None and last_accuracy >= self.stop_at_accuracy / 2

    def check_due(self, step: int, last_accuracy: float) -> bool:
        """Whether SFT's stopping rule checks the validation split after `step`."""
        if self.stop_at_accuracy is None:
            return False
        return step % self.check_every == 0 or self.fine_check(last_accuracy)


class GRPOConfig(Section):
    """Group-relative policy optimisation."""

    steps: int = Field(
        300, ge=0, description="RL steps (one rollout + update each; at most, with stop_at_accuracy)."
    )
    stop_at_accuracy: float | None = Field(
        0.70,
        ge=0.0,
        le=1.0,
        description="End RL at the first check where greedy accuracy on the validation split (data.task.num_val, "
        "built-in task; file datasets have none, so RL runs all steps) reaches this; null = run all steps. "
        "Makes the end a fixed skill level, not a fixed step count whose result moves with float noise.",
    )
    check_every: int = Field(
        5, gt=0, description="Steps between validation checks (stop_at_accuracy), each on the whole split."
    )
    no_signal_steps: int = Field(
        5,
        ge=0,
        description="Say so (a warning when it happens, and in the end-of-run report with the likeliest causes) when "
        "this many consecutive steps (all of them, in a shorter run) lacked learning signal (no_signal_share). 0: "
        "never.",
    )
    no_signal_share: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="A step lacks learning signal when at most this share of its groups got rewards that differ "
        "(only those have nonzero advantages; 0: every group's rewards equal, every reward 0 say).",
    )
    prompts_per_step: int = Field(64, gt=0, description="Prompts sampled per step.")
    group_size: int = Field(8, gt=1, description="Completions per prompt.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    max_tokens_per_micro_batch: int = token_budget_field()
    epochs_per_step: int = Field(1, gt=0, description="Passes over each rollout batch.")
    adv_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group std, the batch std, or nothing."
    )
    adv_eps: float = Field(1e-4, ge=0.0, description="Added to the std before dividing.")
    clip_low: float = Field(0.2, ge=0.0, description="Ratio clip below 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="Ratio clip above 1 + clip_high.")
    loss_agg: Literal["seq_mean", "token_mean", "fixed_length"] = Field(
        "token_mean",
        description="Per-sequence mean, token mean over the batch, or sum / (B * max_new_tokens).",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL-to-reference loss term; 0 = no ref model."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (entropy is logged regardless).")
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=3e-4, schedule="cosine", warmup_steps=10)
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    eval_every: int = Field(25, ge=0, description="Held-out eval every N steps; 0 = only at the end.")
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = Field(
        "grpo",
        description="Advantage estimator: grpo (group-normalised), dr_grpo (group mean only), rloo (leave-one-out), "
        "reinforce_pp / reinforce_pp_baseline (token-level, batch-whitened), gae (PPO: a critic, see `critic`).",
    )
    policy_loss: Literal["clip", "gspo"] = Field(
        "clip", description="clip: PPO token-ratio clip; gspo: sequence-ratio clip (clip_low/high ~3e-4)."
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual clip c > 1: caps the loss of tokens with A < 0 at -c A; None = off."
    )
    minibatches: int = Field(
        1, gt=0, description="Optimizer steps per epoch, each on a shuffled slice of the rollout (PPO-style)."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over response tokens.")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (advantage=gae).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss", description="Where the KL to the reference goes: a loss term, or a per-token reward penalty."
    )
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: kl_coef throughout; adaptive: from kl_coef, steer the KL to kl_target."
    )
    kl_target: float = Field(0.01, gt=0.0, description="Per-token KL the adaptive controller aims for.")
    kl_horizon: int = Field(10000, gt=0, description="Adaptive controller horizon, in samples.")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose scores are all equal; sample more prompts to refill."
    )
    max_sampling_rounds: int = Field(
        4, gt=0, description="Most generate calls per step (dynamic_sampling); then equal groups fill in."
    )
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO soft overlong penalty over the last N tokens to max_new_tokens; 0 = off."
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Penalty reached at max_new_tokens.")
    mask_truncated: bool = Field(
        False, description="DAPO overlong filtering: completions cut at max_new_tokens get no loss."
    )
    behaviour_correction: Literal["none", "tis", "mask_token", "mask_seq"] = Field(
        "none",
        description="Off-policy correction for samples the engine drew under other numerics (or older weights): "
        "the ratio is taken against the trainer's log-probs before the update, and each token is weighted by "
        "trainer / engine probability at the sampling temperature: tis truncates the weight at behaviour_cap; "
        "mask_token zeroes tokens whose weight is outside [1/cap, cap]; mask_seq zeroes whole sequences whose "
        "geometric-mean weight is. Costs one forward per step; none = no weight.",
    )
    behaviour_cap: float = Field(
        2.0, gt=1.0, description="Truncation (tis) or masking bound (mask_*) of the behaviour weight."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous RL (runtime.backend=ray): the engines generate batches up to this many policy "
        "versions ahead, on their own actors while the trainer trains. Batch b is generated under version "
        "max(0, b - k) on a fixed schedule, so a run replays and resumes exactly; a checkpoint holds the batches "
        "generated ahead. Needs behaviour_correction (the samples come from older weights). 0 = synchronous.",
    )
    partial_rollouts: Literal["none", "recompute_kv", "keep_stale_kv"] = Field(
        "none",
        description="With max_staleness >= 1: the trainer syncs each new version at once, and the engines take "
        "it mid-batch: sequences in flight keep their tokens and go on under the new weights (each token records "
        "its version; a sample's staleness counts from its first token). Batches then start under the newest "
        "weights, so staleness is often below max_staleness, but what a run samples depends on timing (no exact "
        "replay; resumes stay exactly-once). recompute_kv prefills the sequences in flight again under the new "
        "weights; keep_stale_kv goes on from the cache the old weights filled (cheaper, off-policy keys/values). "
        "none = the fixed schedule.",
    )
    routing_replay: bool = Field(
        False,
        description="Mixtures of experts: true = the trainer's forwards on the samples route each token to the "
        "experts the engine's routers chose for it (rollout routing replay), so training and sampling use the same "
        "experts; the expert weights still come from the trainer's own router. false = the trainer routes by its "
        "own router. Either way, with the built-in engine, each step logs route_mismatch: the share of tokens "
        "whose top-k experts the trainer's router chose differently from the engine's.",
    )

    @model_validator(mode="after")
    def _variants_fit(self) -> GRPOConfig:
        if self.policy_loss == "gspo" and self.advantage in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
            raise ValueError(
                f"policy_loss 'gspo' needs one advantage per sequence; advantage '{self.advantage}' is per token "
                "(use grpo, dr_grpo or rloo)"
            )
        if self.policy_loss == "gspo" and self.dual_clip is not None:
            raise ValueError("dual_clip applies to policy_loss 'clip' only")
        if self.behaviour_correction != "none" and (self.sampling.top_p < 1.0 or self.sampling.top_k > 0):
            raise ValueError(
                f"behaviour_correction '{self.behaviour_correction}' compares the engine's log-probs with the "
                "trainer's, which it cannot recompute under top_p/top_k filtering: set sampling.top_p=1 and "
                "sampling.top_k=0, or behaviour_correction=none"
            )
        if self.max_staleness and self.behaviour_correction == "none":
            raise ValueError(
                f"max_staleness={self.max_staleness} trains samples up to {self.max_staleness} policy versions "
                "old: set behaviour_correction (tis, mask_token or mask_seq) so that each token is weighted by "
                "the trainer's probability over the engine's"
            )
        if self.partial_rollouts != "none" and not self.max_staleness:
            raise ValueError(
                f"partial_rollouts={self.partial_rollouts!r} lets new weights into batches being generated ahead "
                "of training: set max_staleness >= 1 (the synchronous loop has no batch in flight at a sync)"
            )
        if self.overlong_buffer > self.sampling.max_new_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be <= sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens})"
            )
        if (self.kl_controller == "adaptive" or self.kl_in == "reward") and self.kl_coef == 0:
            raise ValueError(
                f"kl_controller={self.kl_controller!r}, kl_in={self.kl_in!r} needs kl_coef > 0 (the initial coefficient)"
            )
        return self


class CriticConfig(Section):
    """The value model of PPO (grpo.advantage=gae): the policy's transformer body, copied, plus a linear head."""

    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10), description="Critic optimizer."
    )
    value_clip: float | None = Field(
        0.2, gt=0.0, description="Clip of V - V_old in the value loss; None = plain squared error."
    )
    micro_batch_size: int = Field(64, gt=0, description="Sequences per critic forward/backward.")
    max_tokens_per_micro_batch: int = token_budget_field()


class DPOConfig(Section):
    """Direct preference optimisation on pairs, against the policy as DPO starts (after SFT), frozen."""

    steps: int = Field(150, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, gt=0, description="Pairs per step.")
    micro_batch_size: int = Field(32, gt=0, description="Pairs per forward/backward.")
    max_tokens_per_micro_batch: int = token_budget_field()
    loss: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid", description="sigmoid (DPO), ipo, hinge (SLiC) or robust (label noise label_smoothing)."
    )
    beta: float = Field(0.1, gt=0.0, description="Strength of the implicit KL constraint.")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="Assumed label-flip rate (sigmoid: cDPO, robust: rDPO)."
    )
    nll_coef: float = Field(
        1.0,
        ge=0.0,
        description="RPO: weight of the chosen completion's NLL (keeps its likelihood up); 0 = plain DPO.",
    )
    reference: Literal["precomputed", "online"] = Field(
        "precomputed",
        description="precomputed: reference log-probs of every pair once, up front; online: a frozen copy.",
    )
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10), description="DPO optimizer."
    )
    eval_every: int = Field(50, ge=0, description="Held-out eval every N steps; 0 = only at the end.")


class RewardModelConfig(Section):
    """Bradley-Terry reward model: the policy's body (after SFT) with a scalar head at the last token."""

    steps: int = Field(300, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, gt=0, description="Pairs per step.")
    micro_batch_size: int = Field(32, gt=0, description="Pairs per forward/backward.")
    max_tokens_per_micro_batch: int = token_budget_field()
    margin: float = Field(0.0, description="Margin added to every pair's own (data) margin in the loss.")
    center_coef: float = Field(
        0.01, ge=0.0, description="Weight of mean((r_c + r_r)^2), centring the rewards."
    )
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=10), description="RM optimizer."
    )
    eval_every: int = Field(100, ge=0, description="Held-out eval every N steps; 0 = only at the end.")


class RewardConfig(Section):
    """The RL reward: the task verifier, a trained reward model (`loopline rm`), or their sum."""

    source: Literal["verifier", "model", "sum"] = Field(
        "verifier",
        description="verifier; model: model_coef * RM score; sum: verifier + model_coef * RM score.",
    )
    model_path: Annotated[str, LocalPath("reward model directory")] = Field(
        "", description="A reward model directory written by `loopline rm`."
    )
    model_coef: float = Field(1.0, description="Weight of the reward model's score.")
    model_norm: Literal["none", "batch"] = Field(
        "none",
        description="none: raw scores; batch: whitened over each generate round (a step's batch; mean 0, std 1) "
        "before model_coef, so the coefficient means the same for any reward model.",
    )
    model_clip: float | None = Field(
        None, gt=0.0, description="Clamp the (whitened) score to [-model_clip, model_clip]; null = no clip."
    )
    batch_size: int = Field(256, gt=0, description="Completions per reward-model forward.")

    @model_validator(mode="after")
    def _model_given(self) -> RewardConfig:
        if self.source != "verifier" and not self.model_path:
            raise ValueError(
                f"source '{self.source}' needs model_path (a `loopline rm` reward_model directory)"
            )
        return self


class TrainingConfig(Section):
    """How every trainer (policy, critic, reward model) runs its forward and backward, whatever the phase."""

    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute decoder layers' activations in backward instead of keeping them: none; full = "
        "every layer (keeps only each layer's input); selective = every other layer (the odd-numbered ones). "
        "Same gradients, less memory, ~1/3 more compute on the checkpointed layers.",
    )
    mixed_precision: Literal["auto", "none", "bf16"] = Field(
        "auto",
        description="none: compute in model.dtype. bf16: the policy (and its frozen reference) run forwards and "
        "backwards on bfloat16 copies of float32 master weights; the optimizer steps the float32 masters with "
        "float32 AdamW moments, and gradients are accumulated and reduced in float32 (FSDP2's "
        "MixedPrecisionPolicy on Ray ranks, the same casts on the local backend). Needs model.dtype=float32; "
        "checkpoints keep the float32 masters. Less activation memory, more parameter memory (a bf16 copy). "
        "auto (resolved before a run starts, loopline.plan_auto): bf16 for a model of at least 100M parameters "
        "(never the built-in one) where this CPU's bf16 matmuls run at least 1.5x faster than float32 (a probe, "
        "cached per machine: `loopline doctor`) and the run allows it; none elsewhere.",
    )
    memory: Literal["auto", "manual"] = Field(
        "auto",
        description="auto: before a run starts, the memory plan turns on what the run needs to fit its nodes "
        "with a margin (model.logits_chunk_tokens, then activation_checkpointing, then token-budget micro-batches) "
        "and nothing where it fits without them; a field set in the config or an override is never changed, and "
        "the choice is printed in one line. manual: the fields as they are.",
    )
    memory_budget_gib: float = Field(
        0.0,
        ge=0.0,
        description="The memory (GiB) that training.memory=auto plans each node against; 0 = each node's own (this "
        "machine's MemTotal, a pool's declared memory). The check before a run still uses the node's own.",
    )
