"""A reward function as an env, with no Env class to write: `reward(prompt, completion, **row_fields) -> float`.

`env.name=python:MODULE:NAME` names either a factory (no arguments; returns a fresh envs.base.Env per episode) or a
reward function (it takes the prompt and the completion). A reward function is wrapped in `RewardFnEnv`: a
single-turn episode that shows the prompt and scores the one response with it. It runs where every env runs, on
the env workers (clean processes on the local backend, Ray actors on ray), imported there by name (a module-level
function of a module or .py file) or unpickled from the .pkl loopline.api wrote (a function sent by value).

Row fields passed as keyword arguments: `answer` and the row's extra fields (env.fields, and those the env
reads, e.g. the code task's `test`); a function with `**kwargs` gets them all, one without gets those it names.
A response counts as correct (eval accuracy) when its reward reaches full marks, 1.0 (envs.base.counts_correct);
partial credit shows in the mean reward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from loopline.data.rows import PromptRow
from loopline.envs.base import StepResult

RewardFn = Callable[..., float]


def is_reward_fn(obj: object) -> bool:
    """Whether `obj` is called as a reward function (it needs the prompt and the completion), not as an env
    factory (callable with no arguments)."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: taken for a factory, as before
        return False
    try:
        signature.bind()
        return False
    except TypeError:
        pass
    try:
        signature.bind_partial("prompt", "completion")  # the row's fields come by keyword
    except TypeError:
        return False
    return True


def _keywords(fn: RewardFn) -> tuple[set[str] | None, set[str]]:
    """The row fields `fn` takes by name (None when it takes any: **kwargs), and those of them without a default."""
    params = list(inspect.signature(fn).parameters.values())[2:]  # after prompt and completion
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = {p.name for p in named if p.default is p.empty}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, required
    return {p.name for p in named}, required


class RewardFnEnv:
    """One single-turn episode scored by a plain function: the prompt is the observation, the one response ends it."""

    def __init__(self, fn: RewardFn) -> None:
        self.fn = fn
        self._takes, self._required = _keywords(fn)
        self._row: PromptRow | None = None

    async def reset(self, sample: PromptRow) -> str:
        """Remember the row; the observation is the prompt (a chat row's last message)."""
        self._row = sample
        return sample.prompt or (sample.messages[-1]["content"] if sample.messages else "")

    async def step(self, action: str) -> StepResult:
        """Score the response with the function; the episode ends."""
        row = self._row
        if row is None:
            raise RuntimeError("step() before reset()")
        fields = {"answer": row.answer, **dict(row.extra)}
        missing = sorted(self._required - fields.keys())
        if missing:
            raise TypeError(
                f"the reward function takes {', '.join(missing)}, which the rows do not carry (they have: "
                f"{', '.join(sorted(fields))}); add the field to env.fields, or give the argument a default"
            )
        if self._takes is not None:
            fields = {k: v for k, v in fields.items() if k in self._takes}
        prompt = row.prompt or (row.messages[-1]["content"] if row.messages else "")
        reward = self.fn(prompt, action, **fields)
        if isinstance(reward, bool):
            reward = float(reward)
        if not isinstance(reward, int | float):
            raise TypeError(f"the reward function returned {type(reward).__name__} {reward!r}, not a number")
        return StepResult(observation="", reward=float(reward), done=True)
