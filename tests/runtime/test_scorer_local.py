"""The local scorer (env workers as processes of this machine): one score per completion, in order, when a
chunk's worker is killed and the chunk is scored again after a later one. (Ray's scorer: test_scorer.py.)"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from loopline.data.rows import PromptRow
from loopline.runtime.scorer import ScorerRole
from tests.runs import die_once_chunk


def test_scores_come_back_in_order_after_a_killed_chunk_is_scored_again(tmp_path: Path) -> None:
    n = 12  # 2 workers x 2 chunks each: chunks of 3 at offsets 0, 3, 6, 9
    texts = [str(i) for i in range(n)]
    rows = [PromptRow(index=i, prompt=f"{i}?", answer="") for i in range(n)]
    scorer = ScorerRole(workers=2, chunks_per_worker=2, fn=partial(die_once_chunk, str(tmp_path)))
    try:
        scores = scorer.score(texts, rows)
        stats = scorer.take_stats()
    finally:
        scorer.close()
    assert (tmp_path / "0-died").exists()  # chunk 0's first worker was SIGKILLed, after chunk 3 was scored
    assert scores.rewards.tolist() == [float(i) for i in range(n)]
    assert scores.correct.tolist() == [i % 2 == 0 for i in range(n)]
    assert (stats["score_retries"], stats["env_workers_replaced"]) == (1.0, 1.0)
