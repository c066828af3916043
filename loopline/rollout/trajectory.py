"""One episode as one token sequence: the record that rollouts produce and trainers consume.

    prompt ids | model turn 1 | observation 1 | model turn 2 | ... | model turn k
                 mask 1         mask 0          mask 1               mask 1

Model tokens are kept exactly as sampled, with the engine's log-probs; observation tokens (tool
results, env text, the next chat prompt) are masked. Built by the multi-turn driver
(envs.multiturn) and by the chat-completions server (rollout.openai_server).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from transformers import PreTrainedTokenizerBase

from loopline.data.datasets import PromptRow

Finish = Literal["done", "max_turns", "max_tokens", "env_error"]


@dataclass
class Trajectory:
    """One episode as one token sequence: the prompt, then model and observation tokens with a mask."""

    sample: PromptRow
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    mask: list[int] = field(default_factory=list)  # 1 on model-sampled tokens, 0 on observation tokens
    logprobs: list[float] = field(default_factory=list)  # engine log-prob of model tokens; 0.0 elsewhere
    rewards: list[float] = field(default_factory=list)  # one per model turn that the env stepped
    turns: int = 0
    finish: Finish | None = None  # None while running
    info: dict[str, float | int | str] = field(default_factory=dict)  # numeric entries summed over steps
    policy_version: int = 0  # the oldest engine version that sampled any of its turns
    partial: bool = False  # its model tokens come from more than one engine version (partial rollouts)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def add_model_turn(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.tokens += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.turns += 1

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.tokens += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def record(self, reward: float, info: Mapping[str, object]) -> None:
        """One env step's reward, and its info: numeric entries summed over steps, others replaced."""
        self.rewards.append(float(reward))
        for key, value in info.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.info[key] = self.info.get(key, 0) + value  # type: ignore[operator]
            else:
                self.info[key] = value

    def total_return(self, mode: Literal["sum", "final"] = "sum") -> float:
        """Sum of the per-turn rewards, or the last one (0.0 when no turn was scored)."""
        if not self.rewards:
            return 0.0
        return sum(self.rewards) if mode == "sum" else self.rewards[-1]

    def response_text(self, tokenizer: PreTrainedTokenizerBase) -> str:
        """The whole response decoded (model and observation tokens), for logs."""
        return tokenizer.decode(self.tokens, skip_special_tokens=True)
