"""The environment protocol: `reset(sample) -> observation`, `step(action) -> StepResult`.

An env is one episode's state (make one per trajectory). Both methods are async so that the rollout
driver can step many envs at once while each waits on a tool, a sandbox or a remote service; an env
that does blocking work runs it in a thread (`asyncio.to_thread`). Limits on turns and tokens belong
to the driver (envs.multiturn.MultiTurnConfig), not to the env.

A single-turn verifier task is the one-step case: `VerifierEnv` shows the prompt, scores the one
response and ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loopline.data.datasets import PromptRow
from loopline.data.tasks import exact_match


@dataclass(frozen=True)
class StepResult:
    """What the env answers to one action."""

    observation: str  # text shown to the model next ("" when done)
    reward: float  # reward for this turn
    done: bool  # the episode is over
    # Numeric entries are summed over the episode's steps by the driver and averaged into metrics
    # (e.g. tool calls, errors per kind); other entries are kept as the last value seen.
    info: dict[str, float | int | str] = field(default_factory=dict)


class Env(Protocol):
    """One episode of a task: reset with a sample, then step with each model action until done."""

    async def reset(self, sample: PromptRow) -> str:
        """Start an episode on `sample`; returns the first observation (the prompt text)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the model's action text (one turn, decoded); returns the next observation and reward."""
        ...


Verifier = Callable[[str, str], float]  # (response text, reference answer) -> reward


class VerifierEnv:
    """A single-turn task as an Env: the prompt is the observation, one response is scored and ends it."""

    def __init__(self, verify: Verifier = exact_match) -> None:
        self.verify = verify
        self._answer: str | None = None

    async def reset(self, sample: PromptRow) -> str:
        """Remember the reference answer; the observation is the prompt."""
        self._answer = sample.answer
        return sample.prompt

    async def step(self, action: str) -> StepResult:
        """Score the response against the answer; the episode ends."""
        if self._answer is None:
            raise RuntimeError("step() before reset()")
        reward = float(self.verify(action, self._answer))
        return StepResult(observation="", reward=reward, done=True, info={"correct": float(reward > 0)})
