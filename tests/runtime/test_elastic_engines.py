"""Rollout engines that die are replaced, and engines join or leave a running ray GRPO job.

The session's Ray (tests/conftest.py) runs short GRPO jobs in this process: 1 FSDP2 trainer rank,
engines, env workers. The engine actors are killed for real (SIGKILL of their process, found among this
process's descendants by its Ray process title), at points the loop reaches deterministically: one in
step 1 after generate (the death surfaces in the weight sync), one after step 2's row (it surfaces in
step 3's generate). The run must finish every step with nothing lost or duplicated and without
restarting the trainer, and every engine must then hold the trainer's weights, bitwise. Resizing goes
through the real `loopline scale` command, written while a step runs and applied before the next; the same
run does both (each ray run's actors take ~10 s apiece to start here).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.checkpoint.state import RunState
from loopline.cli import main
from loopline.config import load_config
from loopline.distributed.placement import PlacementError
from loopline.loops.context import RunContext, build_context, sync_engine
from loopline.loops.grpo import train_grpo
from loopline.metrics.logger import read_metrics

ARGS = [
    "grpo.stop_at_accuracy=null", "grpo.steps=3", "grpo.prompts_per_step=3", "grpo.group_size=2", "grpo.micro_batch_size=6",
    "grpo.entropy_coef=0.01", "grpo.eval_every=0", "grpo.sampling.max_new_tokens=8",
    "data.task.num_train=20", "data.task.num_eval=2", "eval.num_prompts=2", "checkpoint_every=0",
    "progress=false", "tensorboard=false", "threads=1",
    "runtime.backend=ray", "runtime.trainer_ranks=1", "runtime.env_workers=1", "runtime.call_timeout_s=180",
]  # fmt: skip


def _engine_pids() -> list[int]:
    """Pids of the live engine actors under this process (Ray titles them ray::EngineWorker[.method])."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            try:
                if (Path("/proc") / str(child) / "cmdline").read_bytes().startswith(b"ray::EngineWorker"):
                    found.append(child)
            except OSError:
                pass
    return sorted(found)


def _kill_an_engine() -> None:
    pids = _engine_pids()
    assert pids, "no engine actor process found"
    os.kill(pids[-1], signal.SIGKILL)


class Hooked:
    """Delegates to a role, running hooks[n] before its n-th call of `method` (1-based): a test's seam into
    the loop at a point it reaches deterministically (the role itself does the real work)."""

    def __init__(self, role: object, method: str, hooks: dict) -> None:
        self._role, self._method, self._hooks, self._calls = role, method, hooks, 0

    def __getattr__(self, name: str):
        attr = getattr(self._role, name)
        if name != self._method:
            return attr

        def call(*args, **kwargs):
            self._calls += 1
            if self._calls in self._hooks:
                self._hooks[self._calls]()
            return attr(*args, **kwargs)

        return call


def _grpo(ctx: RunContext) -> RunState:
    ctx.logger.clear()
    ctx.ledger.clear()
    sync_engine(ctx, version=0)
    return train_grpo(ctx, RunState(phase="grpo", step=0), None)


def _assert_engines_hold_the_trainers_weights(ctx: RunContext) -> None:
    model, _ = ctx.actor.state()  # the trainer's whole weights, gathered from its shards
    want = model.state_dict()
    for rank, held in enumerate(ctx.rollout.group.call("weights")):
        assert held.keys() == want.keys()
        for k in want:
            assert torch.equal(held[k].view(torch.uint8), want[k].view(torch.uint8)), (rank, k)


def _assert_every_sample_trained_once(ctx: RunContext, steps: int) -> None:
    ledger = read_ledger(ctx.run_dir)
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    assert not repeats(ledger)
    size = ctx.cfg.grpo.prompts_per_step * ctx.cfg.grpo.group_size
    assert all(len(r["samples"]) == size for r in ledger)  # each step trained all its completions


@pytest.mark.heavy
def test_killed_engines_are_replaced_then_engines_join_and_leave_through_loopline_scale(
    ray_cluster, tmp_path: Path, capsys
) -> None:
    """One ray run of 5 steps: an engine dies in step 1 (after generating, before the weight sync) and another
    after step 2's row (before step 3 generates); `loopline scale` asks for 3 engines and 2 env workers while
    step 3 scores and for 1 engine while step 4 scores, applied before steps 4 and 5."""
    run = tmp_path / "run"
    cfg = load_config(overrides=[*ARGS, "grpo.steps=5", "runtime.engines=2", f"out_dir={run}"])
    ctx = build_context(cfg)
    try:
        # the cluster's 5 CPUs hold 1 trainer rank, 2 engines, 1 env worker and 1 more engine, not 7
        with pytest.raises(PlacementError, match=r"8 rollout engines \(6 more\).* room for only 1 more"):
            ctx.rollout.resize(8)
        assert ctx.rollout.engines == 2
        ctx.scorer = Hooked(
            ctx.scorer,
            "score",
            {
                1: _kill_an_engine,
                3: lambda: main(["scale", str(run), "engines=3", "env_workers=2"]),
                4: lambda: main(["scale", str(run), "engines=1"]),
            },
        )
        ctx.logger = Hooked(ctx.logger, "log", {2: _kill_an_engine})  # its rows: grpo 1, 2, ...
        state = _grpo(ctx)
        assert state.step == 5
        out = capsys.readouterr().out
        assert "died in receive_weights(): replaced in" in out, out
        assert "died in generate(): replaced in" in out, out
        print("\n".join(line for line in out.splitlines() if "replaced in" in line or "scaled to" in line))
        assert ctx.rollout.replacements == 2
        rows = {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}
        assert sorted(rows) == [1, 2, 3, 4, 5]
        assert not {"engines"} & (
            rows[1].keys() | rows[2].keys() | rows[3].keys()
        )  # replacements are not scaling
        assert rows[4]["engines"] == 3 and rows[5]["engines"] == 1 and rows[4]["scale_s"] > 0
        assert rows[3]["env_workers"] == 1 and rows[4]["env_workers"] == rows[5]["env_workers"] == 2
        assert ctx.rollout.engines == 1 and not (run / "scale_request.json").exists()
        _assert_every_sample_trained_once(ctx, 5)
        _assert_engines_hold_the_trainers_weights(ctx)
    finally:
        ctx.close()


def test_scale_refuses_a_local_runs_engines_and_bad_counts(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert main(["scale", str(run), "engines=2"]) == 2  # no config.yaml: not a run directory
    from loopline.config import save_config

    save_config(load_config(overrides=[f"out_dir={run}"]), run / "config.yaml")
    assert main(["scale", str(run), "engines=2", "env_workers=2"]) == 2  # a local run's engine cannot change
    assert "runtime.backend=local: its one engine" in capsys.readouterr().err
    assert not (run / "scale_request.json").exists()
    save_config(load_config(overrides=[f"out_dir={run}", "runtime.backend=ray"]), run / "config.yaml")
    assert main(["scale", str(run), "engines=0"]) == 2
    assert main(["scale", str(run), "trainers=2"]) == 2
    assert not (run / "scale_request.json").exists()
    assert main(["scale", str(run), "engines=3", "env_workers=2"]) == 0
    assert (run / "scale_request.json").exists()


def test_a_local_runs_env_workers_scale_through_loopline_scale(tmp_path: Path) -> None:
    """The local backend's env workers are processes of a pool that grows and shrinks between steps too."""
    run = tmp_path / "run"
    local = [a for a in ARGS if not a.startswith("runtime.")] + ["runtime.env_workers=1", "grpo.steps=3"]
    ctx = build_context(load_config(overrides=[*local, f"out_dir={run}"]))
    try:
        ctx.scorer = Hooked(
            ctx.scorer,
            "score",
            {
                1: lambda: main(["scale", str(run), "env_workers=3"]),
                2: lambda: main(["scale", str(run), "env_workers=2"]),
            },
        )
        _grpo(ctx)
        rows = {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}
        assert [rows[s]["env_workers"] for s in (1, 2, 3)] == [1, 3, 2]
        assert "engines" not in rows[2] and rows[2]["scale_s"] > 0
        _assert_every_sample_trained_once(ctx, 3)
    finally:
        ctx.close()


@pytest.mark.parametrize("partial", ["recompute_kv"])  # "none" too when changing this path (24 s more)
def test_engines_killed_during_an_async_run_are_replaced_and_the_bound_holds(
    ray_cluster, tmp_path: Path, capsys, partial: str
) -> None:
    """grpo.max_staleness=1: batches are collected on the driver's producer thread while the trainer trains. An
    engine dies as batch 1 is scored (its next call, a sync or a generate, finds it dead) and another after step
    2's row; both are replaced once (with partial rollouts the trainer's sync and the producer's generate may both
    find a death), every sample is trained once, none more than one version old."""
    run = tmp_path / "run"
    cfg = load_config(
        overrides=[
            *ARGS, "grpo.steps=4", "runtime.engines=2", "grpo.max_staleness=1", "grpo.behaviour_correction=tis",
            f"grpo.partial_rollouts={partial}", f"out_dir={run}",
        ]
    )  # fmt: skip
    ctx = build_context(cfg)
    try:
        ctx.scorer = Hooked(ctx.scorer, "score", {2: _kill_an_engine})
        ctx.logger = Hooked(ctx.logger, "log", {2: _kill_an_engine})
        assert _grpo(ctx).step == 4
        assert "replaced in" in capsys.readouterr().out
        assert ctx.rollout.replacements == 2
        rows = [r for r in read_metrics(run) if r["phase"] == "grpo"]
        if partial == "none":
            assert [r["staleness_max"] for r in rows] == [0, 1, 1, 1]
        else:
            assert rows[0]["staleness_max"] == 0 and all(r["staleness_max"] <= 1 for r in rows)
        _assert_every_sample_trained_once(ctx, 4)
        _assert_engines_hold_the_trainers_weights(ctx)
    finally:
        ctx.close()
