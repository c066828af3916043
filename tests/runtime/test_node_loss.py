"""A whole trainer node lost mid-GRPO (its raylet and every process on it gone at once, as a preempted VM), on a
3-node Ray on this machine: the session's head (the engine, the env worker) and two trainer nodes added here.

`loopline train` runs in a process of its own that joins the session's Ray (tests/conftest.py) by address, with 2
trainer ranks that are 2 replicas (runtime.trainer_replicas=2), one bundle {trainer_node: 1} per rank spread over
the two trainer nodes. (The trainer nodes carry no CPUs, so that nothing but the trainer ranks lands there: the
engine's and env worker's {CPU: 1} bundles go to the head. threads=1 makes a rank's CPU share moot.) Once GRPO step 1
is logged, the test removes the node of trainer bundle 1 with `remove_node(node, allow_graceful=False)`:
(a) SPREAD, room left on the other node: Ray places the lost bundle there, the trainer heals from the live replica
    and the run ends bitwise as the uninterrupted one;
(b) STRICT_SPREAD (one bundle per node), no room: the run waits for capacity, says so, and heals once a node is added
    back ~20 s later, ending bitwise as the uninterrupted one;
(d) the same with no node added: the run exits 75 within runtime.capacity_wait_s + 30 s, with one line naming the
    lost node and how to continue.
None waits silently: every wait longer than a few seconds prints what it waits for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.metrics.logger import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ARGS = [
    "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=0",
    "grpo.stop_at_accuracy=null", "grpo.steps=5", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=2",
    "grpo.entropy_coef=0.01", "grpo.eval_every=0", "data.task.num_train=20", "data.task.num_eval=4",
    "eval.num_prompts=4", "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1",
    "deterministic=true",
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_replicas=2", "runtime.engines=1",
    "runtime.env_workers=1", "runtime.call_timeout_s=60", "runtime.max_restarts=1", "checkpoint.async_save=true",
]  # fmt: skip
RUN_TIMEOUT_S = 400
FINAL = "checkpoints/grpo-000005/model/model.safetensors"
TRAINER_NODE = {"trainer_node": 2}


def _placement(strategy: str) -> dict:
    return {
        "runtime": {
            "placement": {
                "pools": [
                    {"name": "trainer", "bundles": 2, "resources": {"trainer_node": 1}, "strategy": strategy},
                    {"name": "rollout", "bundles": 1, "resources": {"CPU": 1}},
                    {"name": "env", "bundles": 1, "resources": {"CPU": 1}},
                ],
                "roles": {"actor": "trainer", "rollout": "rollout", "env": "env"},
            }
        }
    }


@pytest.fixture(scope="module")
def trainer_nodes(ray_cluster):
    """`add(n)` adds n trainer nodes ({trainer_node: 2}, no CPU) to the session's Ray and returns them; `nodes` holds
    those still there; every one left is removed after the module."""
    from loopline.distributed.cluster import _loopback

    class Nodes:
        def __init__(self) -> None:
            self.nodes: list = []

        def add(self, n: int) -> list:
            new = []
            with _loopback():
                for _ in range(n):
                    new.append(
                        ray_cluster.add_node(
                            num_cpus=0,
                            resources=dict(TRAINER_NODE),
                            object_store_memory=100 * 2**20,
                            node_ip_address="127.0.0.1",
                        )
                    )
                ray_cluster.wait_for_nodes()
            self.nodes += new
            return new

        def lose(self, node_id: str) -> float:
            """Remove the node without grace (its raylet and processes killed at once); when (time.monotonic)."""
            node = next(n for n in self.nodes if n.node_id == node_id)
            self.nodes.remove(node)
            ray_cluster.remove_node(node, allow_graceful=False)
            return time.monotonic()

    nodes = Nodes()
    yield nodes
    for node in nodes.nodes:
        ray_cluster.remove_node(node)


# The placement groups that existed before the run under test started: an earlier run's group may still be listed
# as CREATED for a while after its driver exited, and removing its node would lose nothing of this run.
_EARLIER: set[str] = set()


def _trainer_bundles() -> list[str]:
    """The node of each bundle of the running run's trainer pool (its placement group asks for trainer_node)."""
    import ray.util

    for pid, group in ray.util.placement_group_table().items():
        if pid not in _EARLIER and group["state"] == "CREATED" and "trainer_node" in group["bundles"][0]:
            return [group["bundles_to_node_id"][i] for i in range(len(group["bundles"]))]
    return []


def _grpo_steps(run: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(run) if r.get("phase") == "grpo"]
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
        return []


def _train(
    run: Path, strategy: str, extra: list[str], act: Callable[[subprocess.Popen], None] | None = None
) -> tuple[int, str, str]:
    """The tests' job on the session's Ray with the trainer pool spread by `strategy`; `act` is called once GRPO
    step 1 is logged; then it is waited for: (exit status, stdout, stderr)."""
    import ray.util

    run.parent.mkdir(parents=True, exist_ok=True)
    config = run.parent / f"{run.name}.yaml"
    config.write_text(yaml.safe_dump(_placement(strategy)))
    address = ray.get_runtime_context().gcs_address
    _EARLIER.clear()
    _EARLIER.update(ray.util.placement_group_table())
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", str(config), *ARGS, f"runtime.cluster.address={address}",
         *extra, f"out_dir={run}"],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while act is not None and 1 not in _grpo_steps(run):
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(
                    f"run exited {proc.returncode} before GRPO step 1:\n{out[-2000:]}{err[-3000:]}"
                )
            assert time.monotonic() < deadline, "run did not reach GRPO step 1"
            time.sleep(0.05)
        if act is not None:
            act(proc)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return proc.returncode, out, err


def _same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    want, got = load_file(a / FINAL), load_file(b / FINAL)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.fixture(scope="module")
def uninterrupted(trainer_nodes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job on two trainer nodes, never interrupted (the nodes stay for the next test)."""
    trainer_nodes.add(2)
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    status, out, err = _train(run, "SPREAD", [])
    assert status == 0, out[-3000:] + err[-3000:]
    return run


def _lose_bundle_1(trainer_nodes, seen: dict) -> Callable[[subprocess.Popen], None]:
    """An act for _train: remove the node of trainer bundle 1 (the two bundles on two nodes); `seen` gets when and
    which node."""

    def act(_: subprocess.Popen) -> None:
        bundles = _trainer_bundles()
        assert len(set(bundles)) == 2, bundles  # a rank on each trainer node
        seen["node"] = bundles[1]
        seen["at"] = trainer_nodes.lose(bundles[1])

    return act


def _healed_bitwise(run: Path, out: str, err: str, uninterrupted: Path) -> None:
    assert "Traceback" not in err, err[-3000:]
    healed = [line for line in out.splitlines() if "healed the trainer from a live replica" in line]
    assert len(healed) == 1 and "no checkpoint loaded, no step trained again" in healed[0], out[-3000:]
    assert "resuming from the last checkpoint" not in out
    assert _grpo_steps(run) == list(range(6))  # each step once
    assert not repeats(read_ledger(run))  # each sample once
    assert _same_weights(run, uninterrupted)


def test_a_trainer_node_lost_with_room_on_the_other_heals_there_and_ends_bitwise(
    uninterrupted: Path, trainer_nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(a) SPREAD: the other trainer node has room for both bundles; Ray places the lost one there, and the trainer
    heals from its live replica without waiting for capacity (beyond Ray declaring the node dead)."""
    trainer_nodes.add(2 - len(trainer_nodes.nodes))  # (d) may have run first (pytest-randomly) and lost one
    seen: dict = {}
    run = tmp_path / "healed"
    status, out, err = _train(run, "SPREAD", [], _lose_bundle_1(trainer_nodes, seen))
    assert status == 0, out[-3000:] + err[-3000:]
    _healed_bitwise(run, out, err, uninterrupted)
    with capsys.disabled():
        print(next(line for line in out.splitlines() if "healed the trainer" in line))


def test_a_trainer_node_lost_without_room_waits_for_a_node_added_back_then_heals_bitwise(
    uninterrupted: Path, trainer_nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(b) STRICT_SPREAD (one bundle per node), the lost node's bundle has nowhere to go: the run waits for capacity
    and says what for; a node added back 20 s after the loss takes the bundle, the trainer heals from its live
    replica and the run ends bitwise as the uninterrupted one."""
    trainer_nodes.add(2 - len(trainer_nodes.nodes))  # (a) lost one
    seen: dict = {}
    lose = _lose_bundle_1(trainer_nodes, seen)

    def lose_then_add_back(proc: subprocess.Popen) -> None:
        lose(proc)
        while time.monotonic() - seen["at"] < 20.0:
            assert proc.poll() is None, "the run ended while it should wait for capacity"
            time.sleep(0.2)
        trainer_nodes.add(1)

    run = tmp_path / "waited"
    status, out, err = _train(run, "STRICT_SPREAD", [], lose_then_add_back)
    assert status == 0, out[-3000:] + err[-3000:]
    waits = [line for line in out.splitlines() if line.startswith("waiting for capacity: ")]
    assert waits and f"role 'actor' lost node {seen['node'][:8]} (ranks [1])" in waits[0], out[-3000:]
    assert (
        "1 x {trainer_node: 1} of pool 'trainer'" in waits[0] and "runtime.capacity_wait_s=300s" in waits[0]
    )
    _healed_bitwise(run, out, err, uninterrupted)
    with capsys.disabled():
        print(waits[0], next(line for line in out.splitlines() if "healed the trainer" in line), sep="\n")


def test_a_trainer_node_lost_without_room_past_the_capacity_wait_exits_75_in_one_line(
    ray_cluster, trainer_nodes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(d) STRICT_SPREAD, no node added back: past runtime.capacity_wait_s the run exits 75 (EX_TEMPFAIL) with one
    line naming the lost node, its rank and how to continue, within capacity_wait_s + 30 s of the loss."""
    trainer_nodes.add(2 - len(trainer_nodes.nodes))
    seen: dict = {}
    run = tmp_path / "lost"
    status, out, err = _train(
        run, "STRICT_SPREAD", ["runtime.capacity_wait_s=15"], _lose_bundle_1(trainer_nodes, seen)
    )
    took = time.monotonic() - seen["at"]
    assert status == 75, out[-3000:] + err[-3000:]
    assert took < 15 + 30, took
    lines = [line for line in err.splitlines() if line.startswith("loopline: ")]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(
        f"loopline: role 'actor' lost node {seen['node'][:8]} (ranks [1]), and no node"
    ), lines
    assert (
        "runtime.capacity_wait_s=15s; exiting 75 (EX_TEMPFAIL): continue with `loopline train --resume"
        in lines[0]
    )
    assert "waiting for capacity: role 'actor' lost node" in out
    with capsys.disabled():  # what a user sees, with -s
        print(
            *(line for line in out.splitlines() if "waiting for capacity" in line),
            lines[0],
            f"{took:.1f}s",
            sep="\n",
        )
