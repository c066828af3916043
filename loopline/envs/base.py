"""The environment protocol: `reset(sample) -> observation`, `step(action) -> StepResult`.

An env is one episode's state (make one per trajectory). Both methods are async so that the rollout
driver can step many envs at once while each waits on a tool, a sandbox or a remote service; an env
that does blocking work runs it in a thread (`asyncio.to_thread`). Limits on turns and tokens belong
to the driver (envs.multiturn.MultiTurnConfig), not to the env.

A single-turn verifier task is the one-step case: `VerifierEnv` shows the prompt, scores the one
response and ends.

What "correct" means (held-out accuracy, the stopping rules, `accuracy` in the metrics): an episode the env ended
is correct when the env says so, with a `correct` entry in the last StepResult's info (nonzero: correct), and
otherwise when its return reaches the env's maximum reward: its `max_reward` attribute, MAX_REWARD (1.0) without
one. So a partial-credit env (examples/my_env.py: 1 for the right sum, less for a near one) counts only full
marks, and the mean reward is reported beside accuracy. An episode the env did not end (a turn or token limit)
is not correct. `counts_correct` is that rule, applied on the env workers where the env lives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loopline.data.datasets import PromptRow
from loopline.data.tasks import exact_match


@dataclass(frozen=True)
class StepResult:
    """What the env answers to one action.

    observation: the text the model sees next (tokenized and masked out of the loss; "" when done).
    reward: this turn's reward, a finite number; an episode's return is the sum of its turns' rewards
    (env.returns=final: the last one's).
    done: whether the episode is over; a single-turn env is done after its one step.
    info: numbers to average into the metrics (`episode_<key>` in RL, `eval_<key>` in eval), summed over the
    episode's steps; `info["correct"]` (nonzero: correct) on the last step is the env's own verdict for accuracy.
    """

    observation: str  # text shown to the model next ("" when done)
    reward: float  # reward for this turn
    done: bool  # the episode is over
    # Numeric entries are summed over the episode's steps by the driver and averaged into metrics
    # (e.g. tool calls, errors per kind); other entries are kept as the last value seen.
    info: dict[str, float | int | str] = field(default_factory=dict)


class Env(Protocol):
    """One episode of a task: reset with a sample, then step with each model action until done.

    Write a class with these two methods (no base class needed) and a factory that returns a fresh one:
    `env.name=python:FILE.py:FACTORY`. The loop calls the factory once per episode on an env worker, never in the
    controller, and replays a multi-turn episode's actions on a fresh env every turn: the same actions must get
    the same answers (no clock, no chance). Optional: a `max_reward` attribute, the full marks an episode must
    reach to count as correct (1.0 without one; `max_reward()`, `counts_correct()`).
    """

    async def reset(self, sample: PromptRow) -> str:
        """Start an episode on `sample` (its prompt, answer and the fields the env reads: `sample.get(name)`);
        returns the first observation, which the model is prompted with."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the model's action text (one turn, decoded, ended by a stop string or EOS); returns the next
        observation, the turn's reward and whether the episode is over."""
        ...


Verifier = Callable[
    [str, str], float
]  # (response text, reference answer) -> reward: answer_match, exact_match
MAX_REWARD = 1.0  # full marks: the return an episode must reach to be correct, unless its env says otherwise


def max_reward(env: object) -> float:
    """The env's full marks: its `max_reward` attribute, else MAX_REWARD."""
    return float(getattr(env, "max_reward", MAX_REWARD))


def counts_correct(result: StepResult, episode_return: float, full_marks: float = MAX_REWARD) -> bool:
    """Whether an episode the env ended (`result` its last step) counts as correct: the env's own
    info['correct'] where it sets one, else whether its return reaches `full_marks` (the env's max_reward)."""
    if "correct" in result.info:
        return float(result.info["correct"]) > 0
    return episode_return >= full_marks


class VerifierEnv:
    """A single-turn task as an Env: the prompt is the observation, one response is scored and ends it."""

    max_reward = MAX_REWARD  # a verifier pays at most 1 (full marks: correct)

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
        return StepResult(
            observation="", reward=reward, done=True, info={"correct": float(reward >= self.max_reward)}
        )
