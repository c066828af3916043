"""The ray backend's scorer: an elastic pool of env worker actors in the env pool's bundles.

The session's Ray (tests/conftest.py) with an env node {CPU: 1, env_node: 2} added for this file;
each test places an env pool of {env_node: 1} bundles (workers ask for no CPU, so only placement keeps them
off the head). Failures are real SIGKILLs of a worker's process and real hangs; the scores are compared
with the env's rewards computed in the test process.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import ray
import ray.cloudpickle

from loopline.data.rows import PromptRow
from loopline.distributed.placement import PlacementConfig, Pool, PoolConfig, place_pools, remove_pools
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import Verdict, chunk_time_limit, score_chunk
from loopline.envs.pool import EnvPoolConfig, RayBundles, WorkerInfo, WorkerPool
from loopline.envs.sandbox import SandboxConfig
from loopline.runtime.scorer import ScorerRole, ScoringError

# ---------------------------------------------------------------------------------------------------------
# Chunk scorers run in the workers (pickled by value: workers cannot import this file)
# ---------------------------------------------------------------------------------------------------------


def held_score_chunk(hold: str, chunk: tuple[list[str], list[PromptRow]]) -> list[Verdict]:
    """The exact_match env, once the file `hold` is gone (at most 60 s)."""
    deadline = time.monotonic() + 60
    while os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.02)
    return score_chunk("exact_match", chunk)


def hang_once_chunk(chunk: tuple[list[str], list[PromptRow]]) -> list[Verdict]:
    """Hangs on a text 'hang:PATH' the first time (PATH does not exist yet), or always on 'hang:always'."""
    for text in chunk[0]:
        if text == "hang:always":
            time.sleep(600)
        if text.startswith("hang:") and not os.path.exists(text[5:]):
            Path(text[5:]).touch()
            time.sleep(600)
    return [Verdict(0.5, False) for _ in chunk[0]]


def on_node_chunk(meet: str, chunk: tuple[list[str], list[PromptRow]]) -> list[Verdict]:
    """1.0 for each text that is the id of the node this worker runs on.

    While the file `meet`/need names a count n, a chunk first checks in (a file `n-<pid>` in `meet`) and waits
    until n workers have (at most 30 s, well inside the task timeout): so each of n workers scores one chunk.
    """
    need = Path(meet, "need")
    if need.exists():
        n = int(need.read_text())
        Path(meet, f"{n}-{os.getpid()}").touch()
        deadline = time.monotonic() + 30
        while len(list(Path(meet).glob(f"{n}-*"))) < n and time.monotonic() < deadline:
            time.sleep(0.02)
    node = ray.get_runtime_context().get_node_id()
    return [Verdict(float(text == node), text == node) for text in chunk[0]]


# ---------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env_node(add_ray_nodes) -> str:
    """An env node added to the session's Ray (tests/conftest.py) for this file; its id."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return add_ray_nodes([{"CPU": 1, "env_node": 2}])[0]


@pytest.fixture
def env_pool(env_node: str) -> Iterator[Pool]:
    """Two {env_node: 1} bundles for the env role."""
    cfg = PlacementConfig(
        pools=[PoolConfig(name="env", bundles=2, resources={"env_node": 1})], roles={"env": "env"}
    )
    pools = place_pools(cfg)
    yield pools["env"]
    remove_pools(pools)


def _rows(answers: list[str]) -> list[PromptRow]:
    return [PromptRow(index=i, prompt=f"{i}?", answer=a) for i, a in enumerate(answers)]


def _batch(n: int) -> tuple[list[str], list[PromptRow]]:
    """n completions, about a third of them right."""
    texts = [f"{i % 7}" for i in range(n)]
    return texts, _rows([str(i % 3) for i in range(n)])


def _in_this_process(texts: list[str], rows: list[PromptRow]) -> list[float]:
    """The exact_match env's rewards, computed here: what the workers must return."""
    return [v.reward for v in score_chunk("exact_match", (texts, rows))]


def _ready(scorer: ScorerRole, n: int, timeout_s: float = 40.0) -> list[WorkerInfo]:
    """Wait until the pool has n workers, all started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = scorer.pool.workers()
        if len(workers) == n and all(w.pid is not None for w in workers):
            return workers
        scorer.score(["0"], _rows(["0"]))  # the pool starts and watches its workers while it scores
    raise AssertionError(f"{n} env workers did not start within {timeout_s:g}s: {scorer.pool.workers()}")


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def test_sigkilled_worker_mid_batch_every_score_once_as_the_local_scorer(
    env_pool: Pool, tmp_path: Path
) -> None:
    texts, rows = _batch(48)
    hold = tmp_path / "hold"
    scorer = ScorerRole(
        pool=env_pool, workers=2, fn=partial(held_score_chunk, str(hold)), chunks_per_worker=3
    )
    try:
        before = {w.pid for w in _ready(scorer, 2)}
        scorer.take_stats()
        killed: list[int] = []
        hold.touch()  # every chunk waits: a worker is busy until the kill

        def kill_a_busy_worker() -> None:
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:
                busy = [w for w in scorer.pool.workers() if w.busy_with is not None and w.pid is not None]
                if busy:
                    os.kill(busy[0].pid, signal.SIGKILL)
                    killed.append(busy[0].pid)
                time.sleep(0.01)
            hold.unlink()

        killer = threading.Thread(target=kill_a_busy_worker)
        killer.start()
        scores = scorer.score(texts, rows).rewards
        killer.join()
        stats = scorer.take_stats()
        after = {w.pid for w in _ready(scorer, 2)}
    finally:
        scorer.close()
    assert len(killed) == 1 and killed[0] in before
    # one score per completion, in order, the same as in this process: the lost chunk was scored again
    assert scores.tolist() == _in_this_process(texts, rows)
    assert sum(scores.tolist()) == 9  # i % 7 == i % 3 for i < 48: 0, 1, 2, 21, 22, 23, 42, 43, 44
    recovered = stats.pop("recover_env_s")  # from the worker's death to its chunk scored on another
    assert 0 < recovered < 60, recovered
    assert stats == {"score_retries": 1.0, "env_workers_replaced": 1.0, "env_workers": 2.0}
    assert killed[0] not in after and len(after - before) == 1  # the dead worker was replaced


def test_hung_chunk_is_retried_on_another_worker_or_fails_naming_the_completions(
    env_pool: Pool, tmp_path: Path
) -> None:
    scorer = ScorerRole(pool=env_pool, workers=2, task_timeout_s=3.0, max_attempts=2, fn=hang_once_chunk)
    try:
        _ready(scorer, 2)
        scorer.take_stats()
        scores = scorer.score(["a", f"hang:{tmp_path / 'hung'}", "b", "c"], _rows([""] * 4)).rewards
        assert scores.tolist() == [0.5] * 4
        assert scorer.take_stats()["score_retries"] == 1.0
        with pytest.raises(
            ScoringError, match=r"role 'env' score\(\): completions 2..3 got no score: .*timed out"
        ):
            scorer.score(["a", "b", "hang:always", "c"], _rows([""] * 4))
    finally:
        scorer.close()


def test_resize_2_to_3_to_1_while_scoring(env_pool: Pool, tmp_path: Path) -> None:
    texts, rows = _batch(60)
    hold = tmp_path / "hold"
    scorer = ScorerRole(
        pool=env_pool, workers=2, fn=partial(held_score_chunk, str(hold)), chunks_per_worker=10
    )
    try:
        first = {w.name for w in _ready(scorer, 2)}
        hold.touch()  # the workers' chunks wait: the step is still running when the third worker is up
        seen: set[str] = set()  # workers seen scoring a chunk

        def resize() -> None:  # from another thread, as `loopline scale` would
            scorer.resize(3)
            deadline = time.monotonic() + 50
            while not seen - first and time.monotonic() < deadline:
                seen.update(w.name for w in scorer.pool.workers() if w.busy_with is not None)
                time.sleep(0.01)
            scorer.resize(1)  # all three are busy: two retire once their chunk is done
            hold.unlink()

        resizer = threading.Thread(target=resize)
        resizer.start()
        scores = scorer.score(texts, rows).rewards  # 20 chunks of 3
        resizer.join()
        assert seen - first, "the added worker never took a chunk"
        assert scores.tolist() == _in_this_process(texts, rows)
        assert scorer.pool.num_workers == 1 and len(scorer.pool.workers()) == 1
        assert scorer.score(texts[:5], rows[:5]).rewards.tolist() == _in_this_process(texts[:5], rows[:5])
        assert scorer.take_stats() == {"score_retries": 0.0, "env_workers_replaced": 0.0, "env_workers": 1.0}
    finally:
        scorer.close()


def test_workers_beyond_the_bundles_still_run_on_the_env_node(
    env_pool: Pool, env_node: str, tmp_path: Path
) -> None:
    need = tmp_path / "need"  # while it exists, each chunk waits until that many workers hold one
    # 3 workers in 2 bundles
    scorer = ScorerRole(pool=env_pool, workers=3, fn=partial(on_node_chunk, str(tmp_path)))
    try:
        workers = _ready(scorer, 3)
        need.write_text("3")
        assert scorer.score([env_node] * 3, _rows([""] * 3)).rewards.tolist() == [
            1.0,
            1.0,
            1.0,
        ]  # 3 chunks, one per worker
        assert {int(p.name[2:]) for p in tmp_path.glob("3-*")} == {w.pid for w in workers}
        need.unlink()
        scorer.resize(4)
        workers = _ready(scorer, 4)
        need.write_text("4")
        assert scorer.score([env_node] * 8, _rows([""] * 8)).rewards.tolist() == [1.0] * 8  # 4 chunks of 2
        assert {int(p.name[2:]) for p in tmp_path.glob("4-*")} == {w.pid for w in workers}
    finally:
        scorer.close()


def test_the_code_env_runs_each_rows_tests_in_a_sandbox_on_the_env_actors(env_pool: Pool) -> None:
    """env.name=code on Ray: the row's tests run in the sandbox of the env worker actor that took the chunk, and
    env.code_reward=fraction counts the tests passed (the same scores as in this process)."""
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"
    rows = [
        PromptRow(index=i, prompt="def inc(x):\n", extra=(("entry_point", "inc"), ("test", test)))
        for i in range(4)
    ]
    texts = ["    return x + 1\n", "    return abs(x) + 1\n", "    return x +\n", "    return 0\n"]
    for reward, want in (("all", [1.0, 0.0, 0.0, 0.0]), ("fraction", [1.0, 0.5, 0.0, 0.5])):
        env = EnvConfig(name="code", code_reward=reward)
        scorer = ScorerRole(env, pool=env_pool, workers=2)
        try:
            assert (
                scorer.score(texts, rows).rewards.tolist()
                == want
                == [v.reward for v in score_chunk(env, (texts, rows))]
            )
        finally:
            scorer.close()


def test_completions_that_loop_until_the_sandbox_kills_them_are_not_a_hung_worker() -> None:
    """30 completions that never return, on one env worker (local): the sandbox kills each after its 0.5 s, a few at
    a time, so the chunk takes seconds, past runtime.env_task_timeout_s (1 s here); its limit is that plus
    what the sandbox allows its episodes (envs.episodes.chunk_time_limit), so the worker is not taken for hung and
    nothing is retried. (Before: killed at 60 s three times over, and the step failed, with 40 such completions of
    the default 10 s sandbox on a worker.)"""
    env = EnvConfig(name="code", sandbox=SandboxConfig(timeout_s=0.5))
    test = "def check(candidate):\n    assert candidate() == 1\n"
    rows = [
        PromptRow(index=i, prompt="def f():\n", extra=(("entry_point", "f"), ("test", test)))
        for i in range(30)
    ]
    scorer = ScorerRole(env, workers=1, task_timeout_s=1.0, max_attempts=1)
    try:
        start = time.monotonic()
        scores = scorer.score(["    while True:\n        pass\n"] * 30, rows).rewards
        took = time.monotonic() - start
        assert scores.tolist() == [0.0] * 30 and scorer.take_stats()["score_retries"] == 0
        assert 1.0 < took < 1.0 + chunk_time_limit(env, 30)  # past the base limit, within the derived one
    finally:
        scorer.close()


def test_bad_arguments_are_named() -> None:
    scorer = ScorerRole(workers=1)  # the local backend: env worker processes
    try:
        with pytest.raises(ValueError, match="env workers must be >= 1"):
            scorer.resize(0)
        with pytest.raises(ValueError, match="2 texts but 1 rows"):
            scorer.score(["a", "b"], _rows(["a"]))
    finally:
        scorer.close()
    with pytest.raises(ValueError, match="backend 'ray'"):
        WorkerPool(partial(score_chunk, "exact_match"), EnvPoolConfig(backend="local"), RayBundles(None, 1))
