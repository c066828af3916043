"""The env role's task: score completions with the task verifier, on a CPU worker of the env pool.

Kept apart from the scorer role (runtime.scorer) so that an env worker process imports neither torch nor transformers:
it starts in about a second instead of ten.
"""

from __future__ import annotations

from loopline.data.tasks import exact_match


def score_texts(texts: list[str], answers: list[str]) -> list[float]:
    """Exact-match reward of each completion text against its answer."""
    return [exact_match(t, a) for t, a in zip(texts, answers, strict=True)]


def score_chunk(chunk: tuple[list[str], list[str]]) -> list[float]:
    """One env pool task: the rewards of a (texts, answers) chunk of a step's completions."""
    texts, answers = chunk
    return score_texts(texts, answers)
