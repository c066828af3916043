"""A run that learns nothing says so: GRPO steps whose rewards carry (next to) no learning signal, and why.

Only a group whose completions got different rewards has nonzero advantages (with the estimators that subtract a
group baseline: grpo, dr_grpo, rloo, reinforce_pp_baseline; with the others, the whole batch is one group). A
step lacks signal when at most `grpo.no_signal_share` of its groups are such (0: none, every advantage 0 and the
update changes nothing; the usual case is every reward 0, a policy that never answers right). `grpo.no_signal_steps`
such steps in a row (all of a shorter run's) make a warning line when it first happens and, at the end, a report
with the likeliest causes: SFT too short to write well-formed answers, answers cut at max_new_tokens, a reward
that never matches, samples too alike.
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


@dataclass(frozen=True)
class StepSignal:
    """What one GRPO step's rewards gave to learn from."""

    step: int
    informative: int  # groups whose rewards differ (nonzero advantages)
    groups: int
    reward_mean: float
    all_zero: bool  # every reward 0
    all_correct: bool  # every completion correct: nothing left to learn
    truncated: float  # share of completions cut at max_new_tokens


@dataclass
class NoSignalWatch:
    """Counts GRPO steps without signal in a row; warns once when `needed` are reached; `report()` at the end."""

    needed: int  # steps in a row that make a finding (0: never)
    share: float  # a step with at most this share of informative groups lacks signal
    group_size: int
    group_baseline: bool  # the estimator subtracts the group's mean (else the batch's)
    streak: list[StepSignal] = field(default_factory=list)  # the current run of steps without signal
    found: list[StepSignal] = field(default_factory=list)  # the longest such run that reached `needed`
    sample: Sample | None = None  # a completion of the first step of `found`
    _streak_sample: Sample | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig) -> NoSignalWatch:
        """The watch of a run's GRPO phase: grpo.no_signal_steps, or every step when the run has fewer."""
        grpo = cfg.grpo
        needed = min(grpo.no_signal_steps, grpo.steps)
        return cls(needed, grpo.no_signal_share, grpo.group_size, grpo.advantage in GROUP_BASELINE)

    def informative(self, rewards: torch.Tensor) -> tuple[int, int]:
        """(groups whose rewards differ, groups) of rewards (B,): the prompts' groups, or the batch as one group."""
        if self.group_baseline:
            differ = informative_groups(rewards, self.group_size)  # (G,)
            return int(differ.sum()), len(differ)
        return int(bool((rewards != rewards[0]).any())), 1

    def update(
        self, step: int, rewards: torch.Tensor, correct: torch.Tensor, truncated: float, sample: Sample
    ) -> str | None:
        """Record GRPO step `step` (its rewards (B,), which completions were correct (B,), its share of cut
        completions, one completion); the warning line when this step makes `needed` in a row for the first time,
        else None."""
        # a step trained again after a restart (resumed from an earlier checkpoint) replaces its first try
        self.streak = [s for s in self.streak if s.step < step]
        informative, groups = self.informative(rewards)
        if not self.needed or informative > self.share * groups:
            self.streak, self._streak_sample = [], None
            return None
        if not self.streak:
            self._streak_sample = sample
        zero, full = bool((rewards == 0).all()), bool(correct.all())
        mean = float(rewards.mean())
        self.streak.append(StepSignal(step, informative, groups, mean, zero, full, truncated))
        if len(self.streak) < self.needed or len(self.streak) <= len(self.found):
            return None
        first = not self.found
        self.found, self.sample = list(self.streak), self._streak_sample
        if not first:
            return None
        return (
            f"loopline: warning: no learning signal in {self._steps()}: {self._what()}, so RL changes (next to) "
            "nothing; the end-of-run report says why it likely is"
        )

    def _steps(self) -> str:
        first, last = self.found[0].step, self.found[-1].step
        return f"GRPO steps {first}-{last}" if last > first else f"GRPO step {first}"

    def _what(self) -> str:
        if all(s.all_correct for s in self.found):
            return "every completion was correct"
        if all(s.all_zero for s in self.found):
            return "every reward was 0"
        if all(s.informative == 0 for s in self.found):
            return "every group's completions got equal rewards (every advantage 0)"
        most = max(s.informative for s in self.found)
        return f"at most {most} of {self.found[0].groups} groups a step got rewards that differed"

    def report(self, cfg: RunConfig, sft_accuracy: float | None) -> list[str]:
        """The end-of-run report's lines ([] when no `needed` steps in a row lacked signal): what happened and
        its likeliest causes. sft_accuracy: held-out accuracy as RL started (after SFT), None when unknown."""
        if not self.found:
            return []
        mean = sum(s.reward_mean for s in self.found) / len(self.found)
        lines = [
            f"no learning signal: in {self._steps()} ({len(self.found)} in a row, mean reward {mean:.4g}) "
            f"{self._what()}: RL learned (next to) nothing there. Likeliest causes:"
        ]
        if all(s.all_correct for s in self.found):
            lines.append("  - nothing left to learn on these prompts: every answer is already right")
            return lines
        sft, sampling = cfg.sft, cfg.grpo.sampling
        reached = "unknown" if sft_accuracy is None else f"{100 * sft_accuracy:.1f}%"
        lines.append(
            f"  - SFT too short for the model to write well-formed answers: {sft.steps} SFT steps reached {reached} "
            "held-out accuracy; RL needs right and wrong answers among each group's samples (raise sft.steps, or "
            "set sft.stop_at_accuracy)"
        )
        cut = sum(s.truncated for s in self.found) / len(self.found)
        lines.append(
            f"  - answers cut short: {100 * cut:.1f}% of these steps' completions hit "
            f"grpo.sampling.max_new_tokens={sampling.max_new_tokens}" + (" (raise it)" if cut > 0 else "")
        )
        if self.sample is not None:
            lines.append(
                f"  - the reward never matching (env.name={cfg.env.name}): the completion "
                f"{_short(self.sample.completion)} got {self.sample.reward:g} against the answer "
                f"{_short(self.sample.answer)}"
            )
        if not any(s.all_zero or s.informative for s in self.found):  # rewards, but equal within each group
            lines.append(
                f"  - samples too alike to differ in reward: grpo.sampling.temperature={sampling.temperature:g}, "
                f"grpo.group_size={cfg.grpo.group_size}"
            )
        return lines


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def warn(line: str | None) -> None:
    """Print the watch's warning line (stderr), if any."""
    if line:
        print(line, file=sys.stderr, flush=True)
