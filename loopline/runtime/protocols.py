"""The roles a loop drives, as interfaces only (no implementations here).

Each role has one worker class (a rank: runtime.actor.ActorWorker, engine.EngineWorker, critic.CriticWorker,
reference.ReferenceWorker; the scorer's env workers run envs.episodes) and one driver over the role's
WorkerGroup (runtime.actor.ActorRole, ...), the same code on either backend: locally the group is one rank in
this process, on Ray one actor per rank. runtime.roles.build_roles starts them; the loops see these protocols.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import torch
from transformers import PreTrainedModel

from loopline.algorithms.policy_loss import PolicyLoss
from loopline.checkpoint.state import CheckpointParts
from loopline.config import CriticConfig, DPOConfig, OptimConfig, RewardModelConfig
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.data.preference import PairBatch
from loopline.data.rows import PromptRow
from loopline.envs.base import StepResult
from loopline.rollout.engine import Completion, SamplingParams
from loopline.runtime.scorer import Scores
from loopline.training.critic import RewardStepStats, ScalarModel, ValueBatch, ValueStepStats
from loopline.training.policy import DPOStepStats, PolicyStepStats, SFTStepStats

T = TypeVar("T")


class Actor(Protocol):
    """The policy trainer: updates, log-probs, and the whole model for checkpoints."""

    def replicas_agree(self) -> bool | None:
        """Whether the trainer's replicas (runtime.trainer_replicas) hold bitwise the same state; None: one replica."""
        ...

    def guarded(self, call: Callable[[], T], train: bool = False) -> T:
        """`call()`, which calls the trainer's ranks: with replicas (runtime.trainer_replicas), a rank lost meanwhile
        is healed from a live one and the call run again (a train step the survivors committed is not)."""
        ...

    def start_phase(
        self,
        optim: OptimConfig,
        total_steps: int,
        resume: CheckpointParts | None,
        reference: bool = False,
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        """A new optimizer and LR schedule (restored from the `resume` checkpoint's shards); freeze a reference copy
        if asked: the policy as it is, or the reference saved in the checkpoint (resume.reference, a DCP dir).
        An RL phase hands its policy objective (training.policy.grpo_loss) and micro-batch size here, once."""
        ...

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        """Response log-probs (B, C) under the policy, or under the frozen reference."""
        ...

    def behaviour_logprobs(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Response log-probs (B, C) under the policy from one forward, without gradients: at T=1 (the loss's
        behaviour policy) and at `temperature` (what an engine sampling at it reports)."""
        ...

    def sft_step(self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0) -> SFTStepStats: ...

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        """One optimizer step of the phase's policy objective at this step's KL coefficient."""
        ...

    def policy(self) -> PreTrainedModel:
        """The policy's whole weights in the driver's model (leaves the optimizer alone)."""
        ...

    def sequence_logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        """Summed response log-prob of each row (B,), without gradients: under the policy (in eval mode; a batch
        of any size), or under the frozen reference (a batch that splits evenly over the ranks)."""
        ...

    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        """One optimizer step of dpo.loss; the pairs carry their reference log-probs."""
        ...

    def start_reward(self, cfg: RewardModelConfig, total_steps: int, restore: str | None = None) -> None:
        """A reward model on the ranks: the policy's body as it is now (copied) and a zero scalar head, and its
        optimizer and LR schedule (the policy's own optimizer is left alone); restore: a checkpoint's reward/
        shards to continue from (a resumed rm phase)."""
        ...

    def reward_step(self, pairs: PairBatch) -> RewardStepStats:
        """One optimizer step of the reward model's Bradley-Terry loss."""
        ...

    def reward_scores(self, batch: TokenBatch) -> torch.Tensor:
        """The reward model's score of each row (B,), without gradients (a batch of any size)."""
        ...

    def reward_model(self) -> ScalarModel:
        """The reward model's whole weights, as a ScalarModel in this process."""
        ...

    def state(self) -> tuple[PreTrainedModel, dict]:
        """The whole model in this process (for a checkpoint) and the trainer state ({} before a phase)."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Set the policy's weights (e.g. from a checkpoint)."""
        ...

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        """Every rank writes its model, optimizer and LR-schedule shards to `path` (DCP); with hf_dir also the
        whole weights as hf_dir/model.safetensors; with `reference` the frozen reference's shards there (DCP).
        blocking=False: copied now, written in the background."""
        ...

    def wait_saved(self, timeout_s: float) -> None:
        """Wait until the ranks' save in flight is written (raise its error, or on timeout)."""
        ...

    def load_state(self, path: str) -> None:
        """Read the weights (and, once a phase started, optimizer and LR schedule) of `path` on every rank."""
        ...


class Rollout(Protocol):
    """The generation engines: sample completions, take the actor's new weights (the roles' weight sync)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]: ...

    def update_weights(self, version: int) -> None:
        """Sync the actor's current weights into every engine, as policy `version`."""
        ...

    def rng_states(self) -> list[torch.Tensor | None]:
        """Each engine's sampling generator state (None: the engine samples from this process's RNG)."""
        ...

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        """Restore rng_states(); True when restored exactly, False when they do not fit these engines (then each
        generator is seeded from `reseed` and the engine rank instead)."""
        ...

    def resize(self, engines: int) -> None:
        """Run `engines` engines from now on (between steps); ValueError where the engines cannot change."""
        ...


class Scorer(Protocol):
    """The env (`env.name`): one reward per completion, each scored against the prompt row it answers, or the
    steps of multi-turn episodes."""

    def score(self, texts: list[str], rows: list[PromptRow]) -> Scores:
        """The reward of each text and whether it is correct, in the order of `texts`."""
        ...

    def step(self, rows: list[PromptRow], actions: list[list[str]]) -> list[StepResult]:
        """Multi-turn: each episode (its row and every action so far) stepped to its last action, in order."""
        ...

    def run_agents(self, rows: list[PromptRow], episode_ids: list[str], base_url: str) -> list[float]:
        """env.name=openai_agent: the agent program once per row against the endpoint; each run's reward."""
        ...

    def resize(self, workers: int) -> None:
        """Run `workers` env workers from now on; takes effect within the step that is running (ValueError
        below 1)."""
        ...

    def take_stats(self) -> dict[str, float]:
        """Counts since the last call, for the metrics row: tasks retried, workers replaced ({} if none)."""
        ...


class Critic(Protocol):
    """PPO's value model: values for GAE, clipped value-loss steps, and its part of a checkpoint."""

    started: bool  # start_phase was called: checkpoints hold its part from then on

    def start_phase(
        self,
        policy: PreTrainedModel,
        cfg: CriticConfig,
        total_steps: int,
        saved: dict | None,
        checkpoint: str | None,
    ) -> None:
        """A critic from the policy's body (a copy) with a zero head, a new optimizer and LR schedule; a resumed
        phase restores `saved` (what state() returned) from the checkpoint directory `checkpoint`."""
        ...

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        """Values (B, C) of the response positions, without gradients."""
        ...

    def step(self, batch: ValueBatch) -> ValueStepStats:
        """One optimizer step of the clipped value loss (token mean over the whole batch)."""
        ...

    def state(self) -> dict:
        """What the checkpoint's loop.pt holds of the critic: its whole state, or where its shards are."""
        ...

    def save(self, path: str, blocking: bool) -> None:
        """Write the critic's shards into `path` (sharded ranks); one unsharded rank lives in loop.pt instead."""
        ...

    def wait_saved(self, timeout_s: float) -> None: ...


class WeightSync(Protocol):
    """The actor's weights into the engines, built with the roles: in-process copies, or the planned transfer
    over a sync group of the actor's ranks and the engines."""

    generation: int  # of the transport (a sync group is rebuilt whenever the engines change)

    def open(self) -> None:
        """(Re)connect the actor's ranks and the engines as they are now."""
        ...

    def push(self, version: int, targets: tuple[int, ...]) -> list[int]:
        """Sync the current weights into engines `targets` as `version`; the engines that died meanwhile (the
        others may hold part of the new weights), [] when every one has them. Any other failure raises."""
        ...
