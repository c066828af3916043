"""A run that learns nothing says so: GRPO steps whose rewards carry no learning signal, and their likeliest causes.

A step has no signal when every group's completions got the same reward (with the estimators that subtract a
group baseline: grpo, dr_grpo, rloo, reinforce_pp_baseline), or every completion of the batch did (the others):
every advantage is then 0, the policy-gradient loss is 0 and the update changes nothing (every reward 0 is the
usual case: a policy that never answers right). `grpo.no_signal_steps` such steps in a row (all of a shorter
run's) make a warning line when it first happens and, at the end, a report with the likeliest causes: SFT too
short to write well-formed answers, answers cut at max_new_tokens, a reward that never matches.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from loopline.algorithms.dapo import informative_groups
from loopline.config import RunConfig

GROUP_BASELINE = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp_baseline",
)  # advantages relative to the group's mean


@dataclass(frozen=True)
class Sample:
    """One completion of a step without signal, with the answer it was scored against."""

    completion: str
    answer: str
    reward: float


@dataclass
class NoSignalWatch:
    """Counts GRPO steps without signal in a row; warns once when `needed` are reached; `report()` at the end."""

    needed: int  # steps in a row that make a finding (0: never)
    group_size: int
    group_baseline: bool  # the estimator subtracts the group's mean (else the batch's)
    streak: list[int] = field(default_factory=list)  # the steps of the current run of steps without signal
    found: list[int] = field(default_factory=list)  # the steps of the longest such run that reached `needed`
    all_zero: bool = True  # every reward of every step in `found` was 0
    all_full: bool = True  # every completion of every step in `found` was correct: nothing left to learn
    truncated: list[float] = field(
        default_factory=list
    )  # the share of cut completions of each step in `found`
    sample: Sample | None = None  # a completion of the first step in `found`
    # per step of the current run: (every reward 0, every completion correct, share cut), and its first sample
    _streak_stats: list[tuple[bool, bool, float]] = field(default_factory=list)
    _streak_sample: Sample | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig) -> NoSignalWatch:
        """The watch of a run's GRPO phase: grpo.no_signal_steps, or every step when the run has fewer."""
        grpo = cfg.grpo
        needed = min(grpo.no_signal_steps, grpo.steps)
        return cls(needed, grpo.group_size, grpo.advantage in GROUP_BASELINE)

    def flat(self, rewards: torch.Tensor) -> bool:
        """Whether rewards (B,) give every advantage 0: equal within every group, or over the whole batch."""
        if self.group_baseline:
            return not bool(informative_groups(rewards, self.group_size).any())
        return bool((rewards == rewards[0]).all())

    def update(
        self, step: int, rewards: torch.Tensor, correct: torch.Tensor, truncated: float, sample: Sample
    ) -> str | None:
        """Record GRPO step `step` (its rewards (B,), which completions were correct (B,), its share of cut
        completions, one completion); the warning line when this step makes `needed` in a row for the first time,
        else None."""
        # a step trained again after a restart (resumed from an earlier checkpoint) replaces its first try
        kept = sum(s < step for s in self.streak)
        self.streak, self._streak_stats = self.streak[:kept], self._streak_stats[:kept]
        if not self.needed or not self.flat(rewards):
            self.streak, self._streak_stats, self._streak_sample = [], [], None
            return None
        if not self.streak:
            self._streak_sample = sample
        self.streak.append(step)
        self._streak_stats.append((bool((rewards == 0).all()), bool(correct.all()), truncated))
        if len(self.streak) < self.needed or len(self.streak) <= len(self.found):
            return None
        first = not self.found
        self.found = list(self.streak)
        self.all_zero = all(zero for zero, _, _ in self._streak_stats)
        self.all_full = all(full for _, full, _ in self._streak_stats)
        self.truncated = [t for _, _, t in self._streak_stats]
        self.sample = self._streak_sample
        if not first:
            return None
        what = "every reward was 0" if self.all_zero else "every group's rewards were equal"
        return (
            f"loopline: warning: no learning signal in GRPO steps {self.found[0]}-{self.found[-1]}: {what}, so every "
            "advantage is 0 and RL changes nothing; the end-of-run report says why it likely is"
        )

    def report(self, cfg: RunConfig, sft_accuracy: float | None) -> list[str]:
        """The end-of-run report's lines ([] when no `needed` steps in a row lacked signal): what happened and
        its likeliest causes. sft_accuracy: held-out accuracy as RL started (after SFT), None when unknown."""
        if not self.found:
            return []
        steps = (
            f"GRPO steps {self.found[0]}-{self.found[-1]}"
            if len(self.found) > 1
            else f"GRPO step {self.found[0]}"
        )
        if self.all_full:
            what = "every completion was correct"
        elif self.all_zero:
            what = "every reward was 0"
        else:
            what = "every group's completions got equal rewards"
        lines = [
            f"no learning signal: in {steps} ({len(self.found)} in a row) {what}, so every advantage was 0 and RL "
            "learned nothing there. Likeliest causes:"
        ]
        if self.all_full:
            lines.append("  - nothing left to learn on these prompts: every answer is already right")
            return lines
        sft = cfg.sft
        reached = "unknown" if sft_accuracy is None else f"{100 * sft_accuracy:.1f}%"
        lines.append(
            f"  - SFT too short for the model to write well-formed answers: {sft.steps} SFT steps reached {reached} "
            "held-out accuracy; RL needs some right answers among each group's samples (raise sft.steps, or set "
            "sft.stop_at_accuracy)"
        )
        cut = sum(self.truncated) / len(self.truncated)
        lines.append(
            f"  - answers cut short: {100 * cut:.1f}% of these steps' completions hit "
            f"grpo.sampling.max_new_tokens={cfg.grpo.sampling.max_new_tokens}"
            + (" (raise it)" if cut > 0 else "")
        )
        if self.sample is not None:
            lines.append(
                f"  - the reward never matching (env.name={cfg.env.name}): the completion "
                f"{_short(self.sample.completion)} got {self.sample.reward:g} against the answer "
                f"{_short(self.sample.answer)}"
            )
        if not self.all_zero:
            lines.append(
                "  - samples too alike to differ in reward: grpo.sampling.temperature="
                f"{cfg.grpo.sampling.temperature:g}, grpo.group_size={cfg.grpo.group_size}"
            )
        return lines


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def warn(line: str | None) -> None:
    """Print the watch's warning line (stderr), if any."""
    if line:
        print(line, file=sys.stderr, flush=True)
