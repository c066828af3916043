"""The env role's worker: scores completions with the task verifier on a CPU worker.

Kept apart from roles.py so that an env worker process imports neither torch nor transformers:
it starts in about a second instead of ten.
"""

from __future__ import annotations

from loopline.data.tasks import exact_match


def score_texts(texts: list[str], answers: list[str]) -> list[float]:
    """Exact-match reward of each completion text against its answer."""
    return [exact_match(t, a) for t, a in zip(texts, answers, strict=True)]


class ScorerWorker:
    """A CPU env worker: scores its share of a step's completions."""

    def score(self, texts: list[str], answers: list[str]) -> list[float]:
        return score_texts(texts, answers)
