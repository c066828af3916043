"""Typed configuration for a whole run: YAML file plus dotted `a.b.c=value` overrides.

Every field has a default that works on the built-in tiny model and a one-line description;
`loopline config` prints them. Unknown keys and bad values fail at load with the dotted key named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

# The base and the loader's helpers live in the leaf loopline.section (imported by sections beside their
# code in every room); re-exported here, where RunConfig composes them.
from loopline.runtime.cluster import ClusterConfig
from loopline.runtime.placement import PlacementConfig
from loopline.section import (  # noqa: F401
    ConfigError,
    Section,
    format_validation_error,
    merge_trees,
    parse_overrides,
    read_tree,
)


class TinyModelConfig(Section):
    """Shape of the built-in Qwen2-architecture model (used when model.path is empty)."""

    hidden_size: int = Field(128, gt=0, description="Width of the residual stream.")
    num_layers: int = Field(4, gt=0, description="Number of transformer blocks.")
    num_heads: int = Field(4, gt=0, description="Attention heads per block.")
    num_kv_heads: int = Field(2, gt=0, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(384, gt=0, description="Width of the MLP.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest sequence the model accepts.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        return self


class LoRAConfig(Section):
    """LoRA adapters (peft): train low-rank updates of the target modules only; engines get merged weights."""

    r: int = Field(0, ge=0, description="Adapter rank; 0 = no LoRA, train every weight.")
    alpha: float = Field(16.0, gt=0.0, description="Scale numerator: the update is (alpha / r) * B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Names (suffixes) of the linear modules that get adapters.",
    )


class ModelConfig(Section):
    """Which policy model and tokenizer to train."""

    path: str = Field("", description="Local Hugging Face model directory; empty = the built-in tiny model.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Built-in model shape.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    use_chat_template: bool = Field(
        False, description="Wrap prompts with the tokenizer's chat template when it has one."
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters (r > 0 turns them on).")


class TaskConfig(Section):
    """The built-in verifiable task: integer addition, generated from a seed."""

    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of an operand.")
    max_digits: int = Field(3, ge=1, le=9, description="Most digits of an operand.")
    num_train: int = Field(20000, gt=0, description="Training problems generated.")
    num_eval: int = Field(
        1000, gt=0, description="Held-out problems, disjoint from training (1000: a 1-point change is 10)."
    )
    num_val: int = Field(
        512, ge=0, description="Validation problems, disjoint from both: sft.stop_at_accuracy reads them."
    )

    @model_validator(mode="after")
    def _digits_order(self) -> TaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        return self


class DataConfig(Section):
    """Where prompts come from and how rows map to fields."""

    source: Literal["builtin", "jsonl", "parquet", "hf_disk"] = Field(
        "builtin", description="builtin arithmetic task, or a file/dataset on disk."
    )
    train_path: str = Field("", description="Training prompts (file or saved HF dataset directory).")
    eval_path: str = Field("", description="Held-out prompts; empty = no held-out set for file sources.")
    prompt_field: str = Field("prompt", description="Row field holding the prompt text.")
    answer_field: str = Field("answer", description="Row field holding the reference answer.")
    completion_field: str = Field("completion", description="Row field holding an SFT target completion.")
    messages_field: str = Field("messages", description="Row field holding chat messages (SFT).")
    skip_bad_rows: bool = Field(
        False, description="Skip malformed rows (bad bytes, JSON, fields; no answer for RL) and count them."
    )
    max_prompt_tokens: int = Field(
        0, ge=0, description="Longest prompt in tokens; 0 = the model's max positions minus max_new_tokens."
    )
    max_seq_len: int = Field(
        0, ge=0, description="Longest prompt + SFT target in tokens; 0 = the model's max positions."
    )
    overlong: Literal["error", "skip"] = Field(
        "error", description="A row over a length limit: stop naming file and row, or skip and count it."
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="Built-in task settings.")


class SamplingConfig(Section):
    """How the engine samples completions."""

    max_new_tokens: int = Field(8, gt=0, description="Longest completion generated.")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Stop strings (kept in the output).")


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
        400, ge=0, description="Optimizer steps (at most, with stop_at_accuracy); 0 skips SFT."
    )
    batch_size: int = Field(64, gt=0, description="Sequences per step.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    optim: OptimConfig = Field(
        default_factory=lambda: OptimConfig(lr=2e-3, schedule="cosine", warmup_steps=30)
    )
    eval_every: int = Field(100, ge=0, description="Held-out eval every N steps; 0 = only at the end.")
    stop_at_accuracy: float | None = Field(
        0.3,
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

    def check_due(self, step: int, last_accuracy: float) -> bool:
        """Whether SFT's stopping rule checks the validation split after `step`."""
        if self.stop_at_accuracy is None:
            return False
        return step % self.check_every == 0 or last_accuracy >= self.stop_at_accuracy / 2


class GRPOConfig(Section):
    """Group-relative policy optimisation."""

    steps: int = Field(100, ge=0, description="RL steps (one rollout + update each).")
    prompts_per_step: int = Field(64, gt=0, description="Prompts sampled per step.")
    group_size: int = Field(8, gt=1, description="Completions per prompt.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
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
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10))
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

    @model_validator(mode="after")
    def _variants_fit(self) -> GRPOConfig:
        if self.policy_loss == "gspo" and self.advantage in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
            raise ValueError(
                f"policy_loss 'gspo' needs one advantage per sequence; advantage '{self.advantage}' is per token "
                "(use grpo, dr_grpo or rloo)"
            )
        if self.policy_loss == "gspo" and self.dual_clip is not None:
            raise ValueError("dual_clip applies to policy_loss 'clip' only")
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


class PreferenceDataConfig(Section):
    """Preference pairs for DPO and reward models (loopline.data.preference describes the row formats)."""

    source: Literal["builtin", "jsonl"] = Field(
        "builtin", description="builtin: pairs from the task (correct vs a wrong sum); jsonl: files."
    )
    train_path: str = Field("", description="Training pairs (jsonl).")
    eval_path: str = Field("", description="Held-out pairs (jsonl); empty = no held-out metrics.")
    prompt_field: str = Field("prompt", description="Row field holding the prompt (text or messages).")
    chosen_field: str = Field("chosen", description="Row field holding the preferred completion.")
    rejected_field: str = Field("rejected", description="Row field holding the dispreferred completion.")
    margin_field: str = Field("margin", description="Optional row field with a Bradley-Terry margin.")
    num_train: int = Field(4096, gt=0, description="Built-in pairs made from the first N training prompts.")
    num_eval: int = Field(500, gt=0, description="Held-out pairs scored (at most the split size).")
    rejected: Literal["synthetic", "policy"] = Field(
        "synthetic",
        description="builtin pairs' rejected side: a synthetic wrong sum, or each distinct wrong sample of "
        "the policy (after SFT; grpo.sampling, policy_samples per prompt): the mistakes RL will meet.",
    )
    policy_samples: int = Field(4, gt=0, description="Samples per prompt with rejected=policy.")

    @model_validator(mode="after")
    def _paths_given(self) -> PreferenceDataConfig:
        if self.source == "jsonl" and not self.train_path:
            raise ValueError("source 'jsonl' needs train_path")
        if self.rejected == "policy" and self.source != "builtin":
            raise ValueError("rejected 'policy' needs source 'builtin' (the verifier labels the samples)")
        return self


class DPOConfig(Section):
    """Direct preference optimisation on pairs, against the policy as DPO starts (after SFT), frozen."""

    steps: int = Field(150, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, gt=0, description="Pairs per step.")
    micro_batch_size: int = Field(32, gt=0, description="Pairs per forward/backward.")
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
    model_path: str = Field("", description="A reward model directory written by `loopline rm`.")
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


class EvalConfig(Section):
    """Held-out evaluation."""

    num_prompts: int = Field(1000, gt=0, description="Held-out prompts scored (at most the split size).")
    batch_size: int = Field(1000, gt=0, description="Prompts per generate call.")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.0), description="Greedy by default."
    )


class RuntimeConfig(Section):
    """Where the roles run: all in this process (local), or as worker groups on a Ray cluster (ray)."""

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: one process, no cluster; ray: actor, rollout and env worker groups on Ray.",
    )
    trainer_ranks: int = Field(
        1,
        gt=0,
        description="FSDP2 ranks of the actor (ray); each gets an equal slice, micro_batch_size is per rank.",
    )
    trainer_tp: int = Field(
        1,
        gt=0,
        description="Tensor-parallel size of the actor (ray): trainer_ranks form a (trainer_ranks/trainer_tp, "
        "trainer_tp) mesh; each group of trainer_tp ranks splits the decoder layers (the model's HF TP plan) "
        "and shares one data slice.",
    )
    engines: int = Field(
        1, gt=0, description="Rollout engines (ray), a whole model each; prompts split across them."
    )
    env_workers: int = Field(
        1, gt=0, description="CPU scorer workers (ray); completions are split across them."
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for a call on a worker group, and for the trainer's collectives.",
    )
    stage_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Watchdog: a loop stage (rollout, score, train, sync, eval, checkpoint) running longer "
        "than this fails the run with an error naming role, rank and stage; 0 = off.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="When a call on a worker group fails (ray: a rank died, or a collective broke with it), "
        "restart the roles from the last checkpoint, at most this many times.",
    )
    max_engine_replacements: int = Field(
        3,
        ge=0,
        description="Rollout engines whose actor dies (ray) are replaced in their bundle, synced to the current "
        "weights and their prompts issued again, at most this many times in a run; then the death is an error "
        "(and max_restarts applies).",
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="Which Ray: a local one or an address."
    )
    placement: PlacementConfig | None = Field(
        None,
        description="Pools and role -> pool map (roles actor, rollout, env); None = one pool per role "
        "with a {CPU: 1} bundle per rank.",
    )

    @model_validator(mode="after")
    def _tp_divides(self) -> RuntimeConfig:
        if self.trainer_ranks % self.trainer_tp:
            raise ValueError(
                f"trainer_ranks={self.trainer_ranks} must be divisible by trainer_tp={self.trainer_tp}"
            )
        return self

    @model_validator(mode="after")
    def _roles_fit(self) -> RuntimeConfig:
        if self.backend == "local":
            many = [f"{k}={v}" for k, v in self._ranks().items() if v > 1]
            if many:
                raise ValueError(
                    f"backend 'local' runs one rank per role; {', '.join(many)} needs backend=ray"
                )
            return self
        if self.placement is None:
            return self
        pools = {p.name: p for p in self.placement.pools}
        for role, ranks in self._ranks().items():
            field = {"actor": "trainer_ranks", "rollout": "engines", "env": "env_workers"}[role]
            if role not in self.placement.roles:
                raise ValueError(
                    f"placement.roles must place role '{role}' (its {ranks} rank(s) need a pool)"
                )
            pool = pools[self.placement.roles[role]]
            if pool.bundles < ranks:
                raise ValueError(
                    f"{field}={ranks} but pool '{pool.name}' of role '{role}' has {pool.bundles} bundles"
                )
        return self

    def _ranks(self) -> dict[str, int]:
        return {"actor": self.trainer_ranks, "rollout": self.engines, "env": self.env_workers}


class CheckpointConfig(Section):
    """Checkpoints: what they hold, how they are written, how many are kept."""

    keep_last: int = Field(3, ge=0, description="Whole checkpoints kept, the newest; 0 = keep all.")
    async_save: bool = Field(
        False,
        description="Copy the state at the save and write it in a background thread while training goes on; "
        "it becomes `latest` only once whole.",
    )
    hf_model: bool = Field(
        True,
        description="Also write the weights as model/model.safetensors (a Hugging Face directory) in each "
        "checkpoint; on ray this gathers the whole model on trainer rank 0. `loopline export` makes one "
        "from any checkpoint.",
    )
    save_timeout_s: float = Field(600.0, gt=0, description="Longest wait for a checkpoint write to finish.")


class RunConfig(Section):
    """A whole run: model, data, SFT warm start, GRPO, eval, outputs."""

    out_dir: str = Field("runs/default", description="Run directory (config, metrics, checkpoints, plots).")
    seed: int = Field(0, description="Seed for data, init, sampling.")
    threads: int = Field(
        1,
        ge=0,
        description="torch CPU threads per process (1: tiny models gain little from more, and avoid oversubscribed cores); 0 = torch default.",
    )
    deterministic: bool = Field(
        False,
        description="torch.use_deterministic_algorithms(True); with fixed threads a run killed and resumed "
        "on CPU ends bitwise equal to one never interrupted.",
    )
    checkpoint_every: int = Field(
        50, ge=0, description="Save every N optimizer steps (SFT and RL); 0 = only at the end of each phase."
    )
    progress: bool = Field(True, description="Show a progress bar.")
    tensorboard: bool = Field(True, description="Also log to TensorBoard when it is installed.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO critic (advantage=gae).")
    preference: PreferenceDataConfig = Field(
        default_factory=PreferenceDataConfig, description="DPO/RM pairs."
    )
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="`loopline dpo`, after the SFT warm start.")
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig, description="`loopline rm`.")
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="The RL reward (GRPO family, PPO)."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _batches_split_evenly(self) -> RunConfig:
        # every trainer rank must run the same number of micro-batches: FSDP2 gathers in each forward
        n = self.runtime.trainer_ranks
        rollout = self.grpo.prompts_per_step * self.grpo.group_size
        if rollout % n:
            raise ValueError(
                f"grpo.prompts_per_step * grpo.group_size ({rollout}) must be a multiple of "
                f"runtime.trainer_ranks ({n})"
            )
        if rollout % (n * self.grpo.minibatches):
            raise ValueError(
                f"grpo.prompts_per_step * grpo.group_size ({rollout}) must split into grpo.minibatches "
                f"({self.grpo.minibatches}) of a multiple of runtime.trainer_ranks ({n}) rows each"
            )
        if self.model.lora.r and self.runtime.backend != "local":
            raise ValueError("model.lora (r > 0) runs on runtime.backend 'local' only for now")
        if self.sft.batch_size % n:
            raise ValueError(
                f"sft.batch_size ({self.sft.batch_size}) must be a multiple of runtime.trainer_ranks ({n})"
            )
        return self


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: RunConfig | None = None
) -> RunConfig:
    """Load a RunConfig from an optional YAML file and dotted overrides; raise ConfigError if bad.

    base: the config the file and overrides apply to (default: every field's default), e.g. a resumed run's.
    """
    tree = read_tree(path, overrides)
    # Start from the defaults, so a section given in part keeps the rest of its own defaults:
    # sft.optim.lr=... must not reset sft.optim.schedule to OptimConfig's generic one.
    tree = merge_trees((base if base is not None else RunConfig()).model_dump(), tree)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (reloadable with load_config)."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def describe(cfg: BaseModel | None = None, prefix: str = "") -> list[str]:
    """One line per leaf field: dotted key, value (the default unless cfg says otherwise), description."""
    cfg = cfg if cfg is not None else RunConfig()
    lines: list[str] = []
    for name, field in type(cfg).model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            lines.extend(describe(value, key + "."))
        else:
            lines.append(f"{key} = {value!r}  # {field.description or ''}")
    return lines
