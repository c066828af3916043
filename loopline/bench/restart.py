"""`loopline bench restart`: how soon a run trains again after a restart, and what checkpoints cost the loop.

1. Time to the first train step, fresh vs resumed. `loopline train` is started as a new process, as a
   scheduler restarts a job: fresh, and with --resume from a checkpoint at GRPO step K. Each is timed
   from process start to the end of the first GRPO step it trains (its metrics row is written; the
   LOOPLINE_PAUSE_AT hook marks that moment, then the process is killed). SFT is off so both runs
   train the same kind of step; the fresh run also runs its small step-0 eval. Median of --repeats.
2. Checkpoint save time, blocking vs async, in this process: the policy of each of --models with its
   AdamW state, saved by the Checkpointer as `loopline train` saves (DCP shards + HF weights). Blocking:
   how long save() holds the loop. Async: how long save() holds the loop (copying the state), and how
   long until the checkpoint is whole and `latest`; plus a train step's time alone and while an async
   write runs (on few cores the writer competes with the step for CPU).

3. A trainer rank killed mid-run (ray: 2 trainer ranks, 1 engine, 1 env worker, on a local Ray cluster this
   process starts, or the one it has joined): `loopline train` with runtime.max_restarts=1 runs in a process of
   its own; past GRPO step --kill-step, with its trainer ranks (and spares) built, one trainer rank's process
   gets SIGKILL as soon as the next checkpoint is whole. Timed from the kill to the metrics row of the first step
   trained after the recovery (it carries recover_actor_s; then the run is killed), with
   runtime.restart_scope=role (the trainer group restarts alone; by default warm processes, their imports paid,
   build the new ranks), the same without them (cold: runtime.trainer_warm=false, new processes) and with
   runtime.trainer_standby (spare ranks, built ahead, take the dead ranks' places), restart_scope=all (every role
   restarts from the checkpoint), and healed from a live replica (runtime.trainer_replicas=2: warm processes,
   none, or built spares; no checkpoint loaded, no step trained again), split into: the kill seen (the failure
   printed; for a heal, where it began), restarted and checkpoint loaded ("recovered in") or healed, and the first
   step. Each case also reports whether the trainer ranks' and the engine's processes are new, and whether the
   spares took the ranks' places.

Prints `name: value` lines, ending with the headline ratios: the loop's wait for an async save over a
blocking one, resumed over fresh time to the first train step, then a whole restart's time from a trainer
rank's death to the next step over a per-role restart's with built spares and without warm processes (cold), over
a heal's (built spares, warm processes, cold), and (last) over a per-role restart's as configured by default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from loopline.bench.args import require_positive
from loopline.bench.sync import BENCH_MODELS
from loopline.checkpoint.faults import PAUSE_DIR_ENV, PAUSE_ENV

T = TypeVar("T")
RUN = [
    "sft.steps=0", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=16",
    "grpo.eval_every=0", "grpo.stop_at_accuracy=null", "data.task.num_train=200", "data.task.num_eval=4", "eval.num_prompts=4",
    "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip


def _model_args(name: str) -> list[str]:
    return [f"model.tiny.{k}={v}" for k, v in BENCH_MODELS[name].items()]


def _time_to_step(run: Path, step: int, resume: bool, extra: list[str], timeout_s: float) -> float:
    """Seconds from starting `loopline train` to the end of GRPO step `step` (then the process is killed)."""
    markers = run.parent / f"markers-{run.name}"
    marker = markers / f"step_grpo_{step}.paused"
    marker.unlink(missing_ok=True)
    env = {**os.environ, PAUSE_ENV: f"step:grpo:{step}", PAUSE_DIR_ENV: str(markers)}
    cmd = [sys.executable, "-m", "loopline.cli", "train", *(["--resume"] if resume else []), *RUN, *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, f"out_dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while not marker.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"loopline train ended (rc {proc.returncode}): {proc.stderr.read()[-2000:]!r}"
                )
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"loopline train did not reach GRPO step {step} within {timeout_s:.0f}s")
            time.sleep(0.01)
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()


def bench_restart(
    tmp: Path, model: str, resume_step: int, repeats: int, timeout_s: float
) -> dict[str, float]:
    """Median time to the first train step of a fresh run and of a run resumed at GRPO step resume_step."""
    extra = _model_args(model)
    base = tmp / "base"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopline.cli",
            "train",
            *RUN,
            *extra,
            f"grpo.steps={resume_step}",
            f"out_dir={base}",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )  # the checkpoint to resume from
    if done.returncode != 0:
        raise RuntimeError(f"making the checkpoint failed: {done.stderr[-2000:]}")
    more = [*extra, f"grpo.steps={resume_step + 10}", "checkpoint_every=1000"]  # no save before the mark
    fresh, resumed = [], []
    for i in range(repeats):
        fresh.append(_time_to_step(tmp / f"fresh-{i}", 1, False, more, timeout_s))
        run = tmp / f"resumed-{i}"
        shutil.copytree(base, run)
        resumed.append(_time_to_step(run, resume_step + 1, True, more, timeout_s))
    return {"fresh_s": statistics.median(fresh), "resumed_s": statistics.median(resumed)}


# ---------------------------------------------------------------------------------------------------------
# A trainer rank killed: per-role restart against a whole restart
# ---------------------------------------------------------------------------------------------------------

KILL_RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    # a limit, not a measured time: ranks found dead are seen at once, but on a loaded machine a new rank's import of
    # torch alone can take a minute
    "runtime.call_timeout_s=300", "runtime.max_restarts=1",
]  # fmt: skip
KILL_CASES = {  # how the run recovers: the trainer group alone, the same from spares, every role; healed from a replica
    # the default: warm processes (runtime.trainer_warm) build the new ranks
    "role": ["runtime.restart_scope=role"],
    "cold": ["runtime.restart_scope=role", "runtime.trainer_warm=false"],  # new processes import torch first
    "standby": ["runtime.restart_scope=role", "runtime.trainer_standby=true"],
    "all": ["runtime.restart_scope=all"],
    "heal": ["runtime.trainer_replicas=2"],  # warm processes by default, as "role"
    "heal_cold": ["runtime.trainer_replicas=2", "runtime.trainer_warm=false"],
    "heal_standby": ["runtime.trainer_replicas=2", "runtime.trainer_standby=true"],
}
KILL_PHASES = ("detect_s", "restart_s", "first_step_s", "time_to_next_step_s")
KILL_CHECKS = ("trainer_ranks_replaced", "engine_kept", "spares_promoted", "ledger_exactly_once", "healed")
_RANK_LINE = "trainer ranks restarted in "  # runtime.roles prints where a per-role restart's time went
_ROLES_LINE = "roles stopped in "  # and commands a whole restart's
_HEAL_LINE = "healed the trainer from a live replica in "  # and ActorRole a heal's


def _ray_processes(title: str) -> list[int]:
    """Pids of this process's descendants whose process title (a Ray worker's: ray::ActorWorker is a trainer rank,
    ray::ActorWorker.__init__ one being built) starts with `title`, oldest first, for a Ray this process started."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # the process ended meanwhile
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [os.getpid()]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            with contextlib.suppress(OSError, IndexError, ValueError):
                proc = Path("/proc") / str(child)
                name = (proc / "cmdline").read_bytes().split(b"\0")[0].strip()
                if name.startswith(title.encode()):
                    started = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19])  # clock ticks
                    found.append((started, child))
    return [pid for _, pid in sorted(found)]


def _wait_released(deadline: float) -> None:
    """Wait (until `deadline`) until every CPU of the Ray this process joined is free again: the next run needs
    the bundles a killed run held."""
    import ray

    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources().get("CPU", 0.0):
        if time.monotonic() > deadline:
            raise TimeoutError("the killed run's Ray actors and placement groups were not released")
        time.sleep(0.1)


def _newest(checkpoints: Path) -> str:
    """The name of the newest whole GRPO checkpoint in `checkpoints` ("" if none)."""
    return max((p.name for p in checkpoints.glob("grpo-*")), default="")


def _built(title: str, count: int) -> bool:
    """`count` processes titled `title` (Ray actors of that class), none of them still in its constructor."""
    return len(_ray_processes(title)) == count and not _ray_processes(f"{title}.__init__")


@contextlib.contextmanager
def _ray_address() -> Iterator[str]:
    """The address of the Ray this process has joined, or of a local one-node cluster started here for the bench."""
    import ray

    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    from loopline.distributed.cluster import local_multinode_cluster

    # a CPU each for 2 trainer ranks, 1 engine, 1 env worker
    with local_multinode_cluster([], head_cpus=4, object_store_mb=300) as cluster:
        yield cluster.address


class _Lines:
    """A process's output lines as they arrive, each with its arrival time (time.monotonic)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, text: str, after: float) -> tuple[float, str] | None:
        """(arrival, line) of the first line holding `text` that arrived after `after`."""
        return next(((t, line) for t, line in self.lines if t > after and text in line), None)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])


def _replaced(ranks: list[int], within_s: float = 30.0) -> list[int]:
    """The trainer processes after a recovery; a replaced rank's old process may take a moment to exit on a busy
    machine, so it is waited for (at most `within_s`) before the ranks are compared."""
    deadline = time.monotonic() + within_s
    while True:
        now = _ray_processes("ray::ActorWorker")
        if not set(ranks) & set(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def _recovered_row(run: Path) -> dict[str, Any] | None:
    """The metrics row of the first step trained after the restart (it carries recover_actor_s), or of the step
    a heal let go on (heal_actor_s), once written."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # a line half-written
            row = json.loads(line)
            if "recover_actor_s" in row or "heal_actor_s" in row:
                return row
    return None


def _exactly_once(run: Path, step: int) -> bool:
    """The ledger of a run killed after GRPO step `step`: steps 1..step (or one more), no sample trained twice."""
    from loopline.checkpoint.ledger import LEDGER_FILE, repeats

    lines = (run / LEDGER_FILE).read_text().splitlines()
    if lines and not lines[-1].endswith("}"):
        lines.pop()  # half-written when the run was killed
    ledger = [json.loads(line) for line in lines if line.strip()]
    steps = [r["step"] for r in ledger if r["phase"] == "grpo"]
    return steps in (list(range(1, step + 1)), list(range(1, step + 2))) and not repeats(ledger)


def _kill_a_trainer_rank(
    run: Path, case: str, address: str, kill_step: int, extra: list[str], timeout_s: float
) -> dict[str, float]:
    """One `loopline train` run on ray, a trainer rank SIGKILLed right after the first checkpoint past GRPO step
    `kill_step` and its spares' start, restarted as KILL_CASES[case] says: seconds from the kill to each mark,
    and which processes are new."""
    checkpoints = run / "checkpoints"
    cmd = [
        sys.executable, "-m", "loopline.cli", "train", *RUN, *extra, *KILL_RAY, *KILL_CASES[case],
        f"grpo.steps={kill_step + 100}", "checkpoint_every=1", f"runtime.cluster.address={address}", f"out_dir={run}",
    ]  # fmt: skip
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = _Lines(proc.stdout)
    deadline = time.monotonic() + timeout_s

    def wait_for(what: str, ready: Callable[[], Any]) -> Any:
        while not (value := ready()):
            if proc.poll() is not None:
                time.sleep(0.2)  # the reader thread takes the last lines
                raise RuntimeError(f"loopline train ended (rc {proc.returncode}) {what}:\n{out.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"loopline train: not {what} within {timeout_s:.0f}s:\n{out.tail()}")
            time.sleep(0.01)
        return value

    try:
        wait_for(
            f"at the checkpoint of GRPO step {kill_step}", (checkpoints / f"grpo-{kill_step:06d}").is_dir
        )
        # ranks and spares (built or warm processes); the spares start after the ranks
        actors = 4 if _has_spares(case) else 2
        wait_for("with its trainer ranks (and spares) built", lambda: _built("ray::ActorWorker", actors))
        saved = _newest(checkpoints)
        wait_for("at a new checkpoint", lambda: _newest(checkpoints) != saved)  # kill just after it
        trainers = _ray_processes("ray::ActorWorker")
        ranks, spares = trainers[:2], trainers[2:]
        engines = _ray_processes("ray::EngineWorker")
        os.kill(ranks[-1], signal.SIGKILL)
        killed = time.monotonic()
        row = wait_for("trained after the restart", lambda: _recovered_row(run))
        stepped = time.monotonic()
        new_ranks, new_engines = _replaced(ranks), _ray_processes("ray::EngineWorker")
    finally:
        proc.kill()  # done with it: Ray stops its actors and placement groups (its job ended)
        proc.wait(30)
        _wait_released(time.monotonic() + 60)
    seen, recovered = out.first("role 'actor' rank", killed), out.first("recovered in ", killed)
    healed = out.first(_HEAL_LINE, killed)
    if (
        healed is not None
    ):  # no failure printed: it is seen where the heal, which it printed the time of, began
        recovered = healed
        seen = (healed[0] - float(row["heal_actor_s"]), healed[1])
    if seen is None or recovered is None:
        raise RuntimeError(f"loopline train did not print the failure and the recovery:\n{out.tail()}")
    result = {
        "detect_s": seen[0] - killed,
        "restart_s": recovered[0] - seen[0],
        "first_step_s": stepped - recovered[0],
        "time_to_next_step_s": stepped - killed,
        # as the run logged it: caught -> checkpoint loaded, or the heal's time
        "recover_actor_s": float(row.get("recover_actor_s", row.get("heal_actor_s", 0.0))),
        "healed": float(healed is not None),
        "trainer_ranks_replaced": float(len(ranks) == 2 and not set(ranks) & set(new_ranks)),
        "engine_kept": float(bool(engines) and new_engines == engines),
        "spares_promoted": float(len(spares) == 2 and new_ranks[:2] == spares),
        "ledger_exactly_once": float(_exactly_once(run, int(row["step"]))),
    }
    for text, names in (
        (_RANK_LINE, ("trainer_restart_s", "new_actors_s", "world_joined_s", "sync_reopened_s")),
        (_ROLES_LINE, ("roles_stopped_s", "roles_started_s")),
    ):
        found = out.first(text, killed)  # "... in 2.10s (new actors 1.50s, world joined 0.40s, ...)"
        if found is not None:
            seconds = [float(w.rstrip("s,)")) for w in found[1].replace("(", " ").split() if w[0].isdigit()]
            result.update(zip(names, seconds))
    return result


def _has_spares(case: str) -> bool:
    """Whether a run of `case` gives its trainer ranks spares (built or warm processes), as its config resolves."""
    from loopline.config import load_config

    runtime = load_config(overrides=[*KILL_RAY, *KILL_CASES[case]]).runtime
    return runtime.trainer_standby or runtime.warm_processes()


def bench_kill(
    tmp: Path, model: str, kill_step: int, repeats: int, timeout_s: float, cases: list[str]
) -> dict[str, dict[str, list[float]]]:
    """Per repeat, one run per case of KILL_CASES (in `cases`' order), each with a trainer rank killed: timings."""
    out: dict[str, dict[str, list[float]]] = {case: {} for case in cases}
    with _ray_address() as address:
        for i in range(repeats):
            for case in out:
                got = _kill_a_trainer_rank(
                    tmp / f"kill-{case}-{i}", case, address, kill_step, _model_args(model), timeout_s
                )
                for k, v in got.items():
                    out[case].setdefault(k, []).append(v)
    return out


def bench_save(tmp: Path, model_name: str, repeats: int) -> dict[str, float]:
    """Blocking and async checkpoint saves of `model_name` with its AdamW state, as the train loop saves."""
    from loopline.checkpoint.config import CheckpointConfig
    from loopline.checkpoint.state import Checkpointer, RunState
    from loopline.data.batches import collate
    from loopline.models.config import TinyModelConfig
    from loopline.models.load import build_tiny_model
    from loopline.models.tokenizer import build_byte_tokenizer
    from loopline.runtime.actor import local_actor
    from loopline.training.config import OptimConfig

    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(TinyModelConfig(**BENCH_MODELS[model_name]), tokenizer, seed=0)
    actor = local_actor(model)
    actor.start_phase(OptimConfig(lr=1e-4, warmup_steps=0), 1000, None)
    g = torch.Generator().manual_seed(0)
    batch = collate(
        [torch.randint(3, 259, (16,), generator=g).tolist() for _ in range(16)],
        [torch.randint(3, 259, (8,), generator=g).tolist() for _ in range(16)],
        tokenizer.pad_token_id,
    )

    def step() -> float:
        t0 = time.perf_counter()
        actor.sft_step(batch, micro_batch_size=16)
        return time.perf_counter() - t0

    step()  # AdamW state exists from here on: the checkpoint holds it
    out: dict[str, list[float]] = {
        k: [] for k in ("blocking", "async_blocked", "async_total", "step", "step_async")
    }
    for mode in ("blocking", "async"):
        checkpoints = Checkpointer(
            tmp / f"save-{model_name}-{mode}",
            CheckpointConfig(async_save=mode == "async", keep_last=1),
            actor,
            model,
            tokenizer,
        )
        for i in range(repeats):
            t0 = time.perf_counter()
            checkpoints.save(RunState("grpo", i + 1))
            blocked = time.perf_counter() - t0
            if mode == "blocking":
                out["blocking"].append(blocked)
                out["step"].append(step())
            else:
                out["async_blocked"].append(blocked)
                out["step_async"].append(step())  # while the write runs (it may be done already)
                checkpoints.wait()
                out["async_total"].append(time.perf_counter() - t0)
    size = _dir_bytes(tmp / f"save-{model_name}-blocking" / "checkpoints")
    result = {k: statistics.median(v) for k, v in out.items()}
    result["params"] = float(sum(p.numel() for p in model.parameters()))
    result["checkpoint_bytes"] = float(size)
    return result


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".t"))


def _timed(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    result = fn()
    print(f"{label}.bench_wall_s: {time.perf_counter() - t0:.1f}", flush=True)
    return result


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The bench's options, checked, and the kill cases asked."""
    parser = argparse.ArgumentParser(prog="loopline bench restart", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--models", default="builtin", help=f"save bench models, comma list of {sorted(BENCH_MODELS)}"
    )
    parser.add_argument("--restart-model", default="builtin", help="model of the restarted runs")
    parser.add_argument("--resume-step", type=int, default=2, help="GRPO step of the checkpoint resumed from")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs/saves per case (median reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is given up")
    parser.add_argument("--skip-restart", action="store_true", help="only the save bench")
    parser.add_argument(
        "--kill-only", action="store_true", help="only the killed trainer rank (per-role vs whole restart)"
    )
    parser.add_argument(
        "--kill-step", type=int, default=1, help="kill after a checkpoint past this GRPO step"
    )
    parser.add_argument(
        "--kill-cases",
        default=",".join(KILL_CASES),
        help=f"comma list of {list(KILL_CASES)}: how runs restart",
    )
    args = parser.parse_args(argv)
    require_positive(parser, args, "resume_step", "repeats", "timeout", "kill_step")
    unknown = [
        m
        for m in (args.models.split(",") + [args.restart_model])
        if m.strip() and m.strip() not in BENCH_MODELS
    ]
    if unknown:
        parser.error(f"--models / --restart-model: unknown {unknown}; accepted: {sorted(BENCH_MODELS)}")
    cases = [c.strip() for c in args.kill_cases.split(",") if c.strip()]
    if not cases or set(cases) - set(KILL_CASES):
        parser.error(f"--kill-cases: give some of {list(KILL_CASES)}, got {args.kill_cases!r}")
    if args.kill_only and args.skip_restart:
        parser.error("--kill-only and --skip-restart leave nothing to run")
    if args.kill_only:
        args.models = ""
    return args, cases


def main(argv: list[str]) -> int:
    args, cases = _args(argv)
    torch.set_num_threads(1)  # as the runs (threads=1): the writer thread and the step share the cores
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="loopline-bench-restart-") as tmp_dir:
        tmp = Path(tmp_dir)
        saves = {}
        for name in models:
            r = _timed(f"save.{name}", lambda name=name: bench_save(tmp, name, args.repeats))
            saves[name] = r
            print(f"save.{name}.params: {int(r['params'])}")
            print(f"save.{name}.checkpoint_bytes: {int(r['checkpoint_bytes'])}")
            print(f"save.{name}.blocking.loop_blocked_s: {r['blocking']:.4f}")
            print(f"save.{name}.async.loop_blocked_s: {r['async_blocked']:.4f}")
            print(f"save.{name}.async.until_latest_s: {r['async_total']:.4f}")
            print(f"save.{name}.train_step_s: {r['step']:.4f}")
            print(f"save.{name}.train_step_during_async_write_s: {r['step_async']:.4f}")
        restart, kill = None, None
        if not args.skip_restart and not args.kill_only:
            restart = _timed(
                "restart",
                lambda: bench_restart(tmp, args.restart_model, args.resume_step, args.repeats, args.timeout),
            )
            print(f"restart.model: {args.restart_model}")
            print(f"restart.fresh.time_to_first_step_s: {restart['fresh_s']:.2f}")
            print(f"restart.resumed.time_to_first_step_s: {restart['resumed_s']:.2f}")
        if not args.skip_restart:
            kill = _timed(
                "kill",
                lambda: bench_kill(
                    tmp, args.restart_model, args.kill_step, args.repeats, args.timeout, cases
                ),
            )
            print(f"kill.model: {args.restart_model}")
            for case, got in kill.items():
                for name, values in got.items():
                    if name in KILL_PHASES:
                        runs = ",".join(f"{v:.2f}" for v in values)
                        print(f"kill.{case}.{name}: {statistics.median(values):.2f}  (runs {runs})")
                    elif name in KILL_CHECKS:
                        print(f"kill.{case}.{name}: {int(min(values))}")  # 1: in every run
                    else:
                        print(f"kill.{case}.{name}: {statistics.median(values):.2f}")
    last = saves[models[-1]] if models else None
    if last is not None:
        print(f"headline.model: {models[-1]}")
        print(f"headline.async_over_blocking_loop_blocked: {last['async_blocked'] / last['blocking']:.3f}")
    if restart is not None:
        print(
            f"headline.resumed_over_fresh_time_to_first_step: {restart['resumed_s'] / restart['fresh_s']:.3f}"
        )
    if kill is not None and "all" in kill:
        to_step = {case: statistics.median(got["time_to_next_step_s"]) for case, got in kill.items()}
        for case in ("standby", "cold"):
            if case in to_step:
                print(f"headline.whole_over_{case}_restart: {to_step['all'] / to_step[case]:.3f}")
        for case in ("heal_standby", "heal", "heal_cold"):
            if case in to_step:
                print(f"headline.whole_restart_over_{case}: {to_step['all'] / to_step[case]:.3f}")
        if "role" in to_step:
            print(f"headline.whole_over_per_role_restart: {to_step['all'] / to_step['role']:.3f}")
    return 0
