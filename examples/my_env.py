"""Your own environment in about 30 lines: train on it with

    loopline train env.name=python:examples/my_env.py:make_env

(or env.name=python:my_pkg.my_env:make_env once it is importable). The loop calls make_env() once per
episode, on an env worker (a process of its own, or a Ray actor), never in the controller.

This one rewards the built-in addition task by closeness instead of exact match: full marks for the right
sum, partial credit for a sum that is off by a little, nothing for text that is not a number. Accuracy counts
full marks only (a reward of max_reward; or set info["correct"] on the StepResult to say it yourself), and the
mean reward is reported beside it.
"""

from loopline.data.rows import PromptRow
from loopline.envs.base import StepResult


class CloseEnoughEnv:
    """One episode: show the prompt, score the one response, end."""

    max_reward = 1.0  # full marks: a response counts as correct (accuracy) when its reward reaches this

    async def reset(self, sample: PromptRow) -> str:
        self.answer = int(sample.answer)
        return sample.prompt

    async def step(self, action: str) -> StepResult:
        first_line = action.split("\n", 1)[0].strip()
        if not first_line.isdigit():
            return StepResult(observation="", reward=0.0, done=True, info={"parsed": 0})
        error = abs(int(first_line) - self.answer)
        reward = 1.0 if error == 0 else max(0.0, 0.5 - error / 100)
        return StepResult(observation="", reward=reward, done=True, info={"parsed": 1})


def make_env() -> CloseEnoughEnv:
    return CloseEnoughEnv()
