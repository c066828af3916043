"""Typed configuration for a whole run: YAML file plus dotted `a.b.c=value` overrides.

Every field has a default that works on the built-in tiny model and a one-line description;
`loopline config` prints them. Unknown keys and bad values fail at load with the dotted key named.

Each section lives beside the code that reads it, in the lowest room that reads it (the room's
`config.py`: pydantic only, so loading a config imports no torch); this module composes them into
RunConfig, holds the checks across sections, and re-exports every section so that
`from loopline.config import X` works for all of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from loopline.checkpoint.config import CheckpointConfig
from loopline.data.config import DataConfig, PreferenceDataConfig, TaskConfig
from loopline.distributed.cluster import ClusterConfig
from loopline.distributed.placement import PlacementConfig
from loopline.envs.config import EnvConfig
from loopline.k8s.config import K8sConfig
from loopline.metrics.config import MetricsConfig
from loopline.models.config import LoRAConfig, ModelConfig, TinyModelConfig
from loopline.rollout.config import EvalConfig, RolloutConfig, SamplingConfig, VllmConfig
from loopline.runtime.config import RuntimeConfig

# The base and the loader's helpers live in the leaf loopline.section (imported by sections beside their
# code in every room); re-exported here, where RunConfig composes them.
from loopline.section import (
    ConfigError,
    Section,
    flat_values,
    format_validation_error,
    given_tree,
    mark_given,
    merge_trees,
    parse_overrides,
    read_tree,
)
from loopline.training.config import (
    CriticConfig,
    DPOConfig,
    GRPOConfig,
    OptimConfig,
    RewardConfig,
    RewardModelConfig,
    SFTConfig,
    TrainingConfig,
)

__all__ = [
    "PATH_KEYS",
    "absolute_paths",
    "relative_paths",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "GRPOConfig",
    "K8sConfig",
    "LoRAConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "PlacementConfig",
    "PreferenceDataConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "SFTConfig",
    "SamplingConfig",
    "Section",
    "TaskConfig",
    "TinyModelConfig",
    "TrainingConfig",
    "VllmConfig",
    "describe",
    "format_validation_error",
    "load_config",
    "merge_trees",
    "parse_overrides",
    "read_tree",
    "save_config",
]


class RunConfig(Section):
    """A whole run: model, data, SFT warm start, GRPO, eval, outputs."""

    out_dir: str = Field("runs/default", description="Run directory (config, metrics, checkpoints, plots).")
    seed: int = Field(0, description="Seed for data, init, sampling.")
    threads: int = Field(
        1,
        ge=0,
        description="torch CPU threads per process, at most a Ray actor's CPUs (fixed, so runs replay on any "
        "machine; 2 made the default job's GRPO stage ~1.3x faster on 2 cores but moved its results); 0 = torch default.",
    )
    malloc_mmap_threshold_kib: int = Field(
        1024,
        ge=0,
        le=32768,
        description="glibc (Linux): a memory block of at least this many KiB (a tensor's) is mapped on its own and "
        "goes back to the OS when freed. glibc's default threshold grows up to 32 MiB as blocks are freed, after "
        "which a step's freed gradients and activations stay in the heap, counted in the process's memory (about "
        "2.8 GiB of the Qwen2.5-0.5B bench run's peak, docs/guide/memory-plan.md); 0 = glibc's default.",
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
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig, description="Weights & Biases logging (curves and config)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig, description="What scores the RL loop's completions.")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description="Forward/backward switches of every trainer (memory)."
    )
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO critic (advantage=gae).")
    preference: PreferenceDataConfig = Field(
        default_factory=PreferenceDataConfig, description="DPO/RM pairs."
    )
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="`loopline dpo`, after the SFT warm start.")
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig, description="`loopline rm`.")
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="The RL reward (GRPO family, PPO)."
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Which engine samples (built-in or vLLM)."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    k8s: K8sConfig = Field(
        default_factory=K8sConfig, description="`loopline k8s`: the run as a KubeRay RayJob on Kubernetes."
    )

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
        # the built-in rows: 'a+b=' prompts with answers, or the code task's (entry_point, test)
        builtin_fields = self.env.builtin_row_fields
        unread = [f for f in self.env.row_fields if f not in builtin_fields]
        if unread and self.data.source == "builtin":
            raise ValueError(
                f"env.name={self.env.name} reads the fields {', '.join(unread)} of each row, which the built-in "
                "task's rows lack: give it a file dataset that has them (data.source=jsonl data.train_path=... "
                "data.eval_path=...)"
            )
        if self.env.own_rows and self.data.source != "builtin":
            raise ValueError(
                f"env.name={self.env.name} makes its own episodes (reset seeds, env.openenv): it takes "
                f"data.source=builtin, not {self.data.source}"
            )
        if self.grpo.max_staleness and self.runtime.backend != "ray":
            raise ValueError(
                f"grpo.max_staleness={self.grpo.max_staleness} overlaps generation and training on separate "
                "actors: it needs runtime.backend=ray (the local backend runs the engine in this process, "
                "between training steps; 0 = synchronous)"
            )
        if self.model.lora.r and self.runtime.backend != "local":
            raise ValueError("model.lora (r > 0) runs on runtime.backend 'local' only for now")
        if self.sft.batch_size % n:
            raise ValueError(
                f"sft.batch_size ({self.sft.batch_size}) must be a multiple of runtime.trainer_ranks ({n})"
            )
        if self.rollout.engine == "vllm" and self.grpo.partial_rollouts != "none":
            raise ValueError(
                f"grpo.partial_rollouts={self.grpo.partial_rollouts!r} loads weights into an engine mid-generation, "
                "which only the built-in engine does (rollout.engine=torch); with rollout.engine=vllm use "
                "grpo.partial_rollouts=none"
            )
        if self.grpo.routing_replay:
            self._check_replay()
        if 0 < self.runtime.engine_max_rows < self.grpo.group_size:
            raise ValueError(
                f"runtime.engine_max_rows ({self.runtime.engine_max_rows}) must hold one prompt's "
                f"grpo.group_size ({self.grpo.group_size}) samples, which start together (or be 0: no cap)"
            )
        return self

    def _check_replay(self) -> None:
        """grpo.routing_replay=true needs the engine's routes in every training forward of the policy."""
        why = {
            "rollout.engine=vllm": self.rollout.engine == "vllm",  # it does not report routes
            f"runtime.trainer_pp={self.runtime.trainer_pp}": self.runtime.trainer_pp > 1,
            f"training.activation_checkpointing={self.training.activation_checkpointing}": (
                self.training.activation_checkpointing != "none"
            ),
            f"env.name={self.env.name} (multi-turn)": self.env.multi_turn,
        }
        for key, on in why.items():
            if on:
                raise ValueError(
                    f"grpo.routing_replay=true is not built with {key}: the trainer's forwards there cannot take "
                    "the engine's routes (set grpo.routing_replay=false)"
                )

    @model_validator(mode="after")
    def _ep_fits(self) -> RunConfig:
        ep, mixed = self.runtime.trainer_ep, self.training.mixed_precision
        if ep > 1 and mixed == "bf16":  # FSDP2's casts skip the experts it leaves alone
            raise ValueError(
                f"runtime.trainer_ep={ep} with training.mixed_precision={mixed} is not built: set "
                "runtime.trainer_ep=1"
            )
        return self

    @model_validator(mode="after")
    def _mixed_precision_fits(self) -> RunConfig:
        if self.training.mixed_precision != "bf16":  # auto is resolved to what the run allows (plan_auto)
            return self
        if self.model.dtype != "float32":
            raise ValueError(
                f"training.mixed_precision={self.training.mixed_precision} keeps float32 master weights and "
                f"computes in bfloat16: set model.dtype=float32 (not {self.model.dtype})"
            )
        if self.grpo.advantage == "gae":
            raise ValueError(
                f"training.mixed_precision={self.training.mixed_precision} covers the policy and its reference, not "
                "PPO's critic (grpo.advantage=gae): set training.mixed_precision=none or another grpo.advantage"
            )
        rt = self.runtime
        for key, value in (("runtime.trainer_tp", rt.trainer_tp), ("runtime.trainer_pp", rt.trainer_pp)):
            if value > 1:
                raise ValueError(
                    f"training.mixed_precision={self.training.mixed_precision} runs on the local backend and on "
                    f"FSDP2 ranks only, not with {key}={value}: set {key}=1 or training.mixed_precision=none"
                )
        return self

    @property
    def compute_dtype(self) -> str:
        """The dtype the policy trainer computes in: bfloat16 under training.mixed_precision=bf16, else model.dtype."""
        return "bfloat16" if self.training.mixed_precision == "bf16" else self.model.dtype

    @property
    def engine_dtype(self) -> str:
        """rollout.dtype resolved: auto = what the trainer computes in (compute_dtype)."""
        return self.compute_dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    @property
    def engine_shares_weights(self) -> bool:
        """The local engine generates with the actor's parameters themselves (rollout.share_weights): only where
        a sync would write the same values into a copy (no LoRA merge, no cast). The local loop is synchronous:
        the engine never generates while the actor steps."""
        return (
            self.rollout.share_weights
            and self.runtime.backend == "local"
            and self.rollout.engine == "torch"
            and not self.model.lora.r
            and self.engine_dtype == self.model.dtype
        )

    @property
    def engine_packs_weights(self) -> bool:
        """A CPU torch engine decodes on reordered copies of its float32 linear weights (rollout.pack_weights;
        auto: where the engine shares the local actor's weights, whose freed gradients make room for the copy)."""
        mode = self.rollout.pack_weights
        if mode == "never" or self.rollout.engine != "torch" or self.engine_dtype != "float32":
            return False
        return mode == "always" or self.engine_shares_weights

    @model_validator(mode="after")
    def _pipeline_fits(self) -> RunConfig:
        rt = self.runtime
        stages = rt.trainer_pp * rt.trainer_pp_virtual
        if self.model.builtin and self.model.tiny.num_layers % stages:
            raise ValueError(
                f"model.tiny.num_layers ({self.model.tiny.num_layers}) must be divisible by runtime.trainer_pp * "
                f"runtime.trainer_pp_virtual ({rt.trainer_pp} * {rt.trainer_pp_virtual}): each stage holds an "
                "equal run of layers"
            )
        return self


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: RunConfig | None = None
) -> RunConfig:
    """Load a RunConfig from an optional YAML file and dotted overrides; raise ConfigError if bad.

    base: the config the file and overrides apply to (default: every field's default), e.g. a resumed run's.
    """
    given = read_tree(path, overrides)
    # Start from the defaults, so a section given in part keeps the rest of its own defaults:
    # sft.optim.lr=... must not reset sft.optim.schedule to OptimConfig's generic one.
    tree = merge_trees((base if base is not None else RunConfig()).model_dump(), given)
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, RunConfig, set(flat_values(given)))) from None
    # what the file and overrides (and the base's own input) set, not every field the defaults filled in: the
    # auto choices (training.memory, training.mixed_precision) never change a field the user set
    mark_given(cfg, merge_trees(given_tree(base), given) if base is not None else given)
    return cfg


# The fields that name files or directories on this machine: a run's saved config holds them absolute, so that a
# resume, an env worker or `loopline eval RUN` started in another directory reads the same files.
PATH_KEYS = (
    "model.path", "model.config", "model.tokenizer", "data.train_path", "data.eval_path", "preference.train_path",
    "preference.eval_path", "reward.model_path",
)  # fmt: skip


def relative_paths(cfg: RunConfig) -> dict[str, str]:
    """{dotted key: value} of the PATH_KEYS set to a relative path."""
    out = {}
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and not Path(value).is_absolute():
            out[key] = value
    return out


def absolute_paths(cfg: RunConfig, base: str | Path) -> RunConfig:
    """`cfg` with its relative PATH_KEYS made absolute against `base` (a copy; cfg itself is left as it is)."""
    relative = relative_paths(cfg)
    if not relative:
        return cfg
    cfg = cfg.model_copy(deep=True)
    for key, value in relative.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, os.path.normpath(Path(base) / value))
    return cfg


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


def check_preference(cfg: RunConfig, command: str) -> None:
    """Checks for `loopline dpo` / `loopline rm` that a plain config load cannot make."""
    if cfg.preference.source == "builtin" and cfg.data.source != "builtin":
        raise ConfigError(f"preference.source 'builtin' needs data.source 'builtin', got {cfg.data.source!r}")
    if cfg.runtime.trainer_pp > 1:
        raise ConfigError(
            f"runtime.trainer_pp={cfg.runtime.trainer_pp}: `loopline {command}` does not run through the pipeline "
            "yet (train and sft do); use trainer_pp=1 with trainer_tp and FSDP2"
        )
