"""A user's own script, reward and env code as first-class as the built-ins: a script without
`if __name__ == "__main__":` runs (its env workers never import it again), its reward goes to the workers by value,
what cannot be pickled is refused in one line, a run is never started (nor a run directory deleted) from an env
worker or by a process that does not own the run, an error in the user's code names their file and line, and
Ctrl-C before the run's first step is a clean exit 130. Real runs, real env worker processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import loopline
from loopline.checkpoint.run_dir import LOCK_FILE, owning
from loopline.cli import main
from loopline.errors import ENV_WORKER_VAR

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "sft": {"steps": 2, "batch_size": 8, "micro_batch_size": 8, "eval_every": 0},
    "grpo": {
        "steps": 2, "stop_at_accuracy": None, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8,
        "eval_every": 0,
    },
    "data": {"task": {"num_train": 200, "num_eval": 8}},
    "eval": {"num_prompts": 8, "batch_size": 8},
    "checkpoint_every": 0, "progress": False, "tensorboard": False, "threads": 1,
}  # fmt: skip
TINY_WORDS = [
    "sft.steps=1", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "grpo.steps=1",
    "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    "grpo.eval_every=0", "data.task.num_train=50", "data.task.num_eval=4", "eval.num_prompts=4",
    "eval.batch_size=4", "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip

# The guard-less script: its run at module level, overwrite=True, overrides None. Its reward is a module-level
# function of the script that reads a closure made by the script; every import of the script (as __main__ here,
# or by a worker) leaves a file named by its pid in MARKS.
NO_GUARD = """
import os
from pathlib import Path

import loopline

Path(MARKS, str(os.getpid())).touch()


def make_scale(value):
    return lambda: value


scale = make_scale(0.375)


def reward(prompt, completion, answer, **row):
    return scale()


result = loopline.train(CONFIG, None, reward_fn=reward, overwrite=True)
print("RESULT", result.config.env.name, result.metrics["reward_mean"], result.metrics["step"])
"""

# A reward function that raises two calls deep in the user's file (line 5: `return TABLE[key]`).
RAISES = """TABLE = {"1": 1}


def lookup(key):
    return TABLE[key]


def reward(prompt, completion, answer, **row):
    return float(lookup(answer))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_script_without_the_guard_runs_and_its_run_survives(tmp_path: Path) -> None:
    run, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    run.mkdir()  # an old run there: overwrite deletes it, once, from the script's own process
    (run / "config.yaml").write_text("out_dir: old\n")
    (run / "metrics.jsonl").write_text('{"phase": "old", "step": 7}\n')
    config = {**TINY, "out_dir": str(run), "seed": 1}
    script = tmp_path / "train_mine.py"
    script.write_text(NO_GUARD.replace("MARKS", repr(str(marks))).replace("CONFIG", repr(config)))
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("--overwrite: deleted the run") == 1, out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    _, name, reward_mean, step = line.split()
    # by value: pickled into the run directory (the closure with it), never loaded from the script
    assert name.startswith(f"python:{run}/reward_fn-") and name.endswith(".pkl:reward")
    assert float(reward_mean) == 0.375 and int(step) == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows if r["phase"] == "grpo" and "reward_mean" in r] == [0.375, 0.375]
    assert not any(r["phase"] == "old" for r in rows)
    assert (run / "checkpoints" / "grpo-000002").is_dir()
    # only the script's own process imported it: no env worker ran it again
    assert len(list(marks.iterdir())) == 1


@pytest.mark.unit
def test_an_unpicklable_reward_is_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    lock = threading.Lock()

    def locked_reward(prompt: str, completion: str) -> float:
        with lock:
            return 1.0

    with pytest.raises(ValueError) as raised:
        loopline.train({"out_dir": str(tmp_path / "run")}, None, reward_fn=locked_reward)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("reward_fn test_an_unpicklable_reward_is_refused_in_one_line")
    assert f"locked_reward ({__file__}:" in message and "cannot be sent to the env workers" in message
    assert "lock" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
def test_overrides_none_is_none_and_one_string_is_refused(tmp_path: Path) -> None:
    from loopline.api import _words

    assert _words(None) == [] and _words(("a=1",)) == ["a=1"]
    with pytest.raises(ValueError, match=r"overrides: a list of key=value words, not one string"):
        loopline.train({"out_dir": str(tmp_path / "run")}, "grpo.steps=3")
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_no_run_starts_inside_an_env_worker(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("out_dir: x\n")
    monkeypatch.setenv(ENV_WORKER_VAR, "4242")
    with pytest.raises(ValueError, match=r"inside an env worker .*working for pid 4242.*__name__ == "):
        loopline.train({"out_dir": str(tmp_path / "run")}, None, overwrite=True)
    assert main(["train", "--overwrite", f"out_dir={tmp_path / 'run'}"]) == 2
    assert "`loopline train` was called inside an env worker" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.yaml").is_file()  # nothing deleted


@pytest.mark.e2e
def test_only_the_process_that_owns_a_run_may_overwrite_it(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    holder = subprocess.Popen(  # another process owns the run while it goes
        [
            sys.executable, "-c",
            "import sys, time; from loopline.checkpoint.run_dir import owning\n"
            f"with owning({str(run)!r}):\n    print('held', flush=True); time.sleep(120)",
        ],
        env=_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(["train", "--overwrite", f"out_dir={run}", *TINY_WORDS]) == 2
        err = capsys.readouterr().err
        assert f"out_dir {run} belongs to a run that is still going (pid {holder.pid})" in err
        assert (run / "metrics.jsonl").read_text() == "{}\n"  # not deleted
    finally:
        holder.kill()
        holder.wait()
    with owning(run), owning(run):  # the owner gone, this process owns it (re-entrant here)
        assert (run / LOCK_FILE).read_text().split() == [str(os.getpid()), socket.gethostname()]


@pytest.mark.e2e
@pytest.mark.slow
def test_an_error_in_the_users_reward_names_their_file_and_line(tmp_path: Path, capsys) -> None:
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(RAISES)
    words = ["train", f"out_dir={tmp_path / 'run'}", f"env.name=python:{rewards}:reward", *TINY_WORDS]
    assert main(words) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("loopline: completions 0.."))
    first, block = lines[at], lines[at + 1 :]
    assert "raised KeyError" in first
    assert block == [
        "  in your code (most recent call last):",
        f'    File "{rewards}", line 9, in reward',
        "      return float(lookup(answer))",
        f'    File "{rewards}", line 5, in lookup',
        "      return TABLE[key]",
    ]
    assert main(["--debug", *words, "--overwrite"]) == 2
    err = capsys.readouterr().err
    # the worker's whole traceback (loopline's frames too), then the run's, then the same short message
    assert "in the env worker:" in err and err.count("Traceback (most recent call last)") >= 3
    assert f'File "{rewards}", line 5, in lookup' in err and "loopline/envs/episodes.py" in err
    assert err.strip().splitlines()[-1] == "      return TABLE[key]"


BROKEN_ENV = """from loopline.envs.base import StepResult


class Broken:
    async def reset(self, row):
        return row.prompt

    async def step(self, action):
        raise RuntimeError("the tool is down")
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_an_env_class_from_a_script_goes_by_value_and_its_error_names_its_line(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    config = {**TINY, "out_dir": str(tmp_path / "run")}
    run = f"""
try:
    loopline.train({config!r}, reward_fn=Broken)
except ValueError as e:
    print("REFUSED", e)
"""
    script.write_text("import loopline\n" + BROKEN_ENV + run)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    refused = out.stdout[out.stdout.index("REFUSED") :]
    assert "raised RuntimeError at turn 1: the tool is down" in refused
    assert (
        f'File "{script}", line 10, in step' in refused
        and 'raise RuntimeError("the tool is down")' in refused
    )


def _loading_torch(pid: int) -> bool:
    """Whether process `pid` has begun to load torch (its library is mapped): the command is running, past the
    interpreter's start and the CLI's own import, in the first seconds of a run."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.e2e
@pytest.mark.parametrize("after_s", [0.0, 2.0])
def test_ctrl_c_early_in_a_run_exits_130_without_a_traceback(tmp_path: Path, after_s: float) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", f"out_dir={tmp_path / 'run'}", *TINY_WORDS],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _loading_torch(process.pid):
        assert process.poll() is None and time.monotonic() < deadline, "the run never began to load torch"
        time.sleep(0.01)
    time.sleep(after_s)  # while torch loads, and a little later (the config read, the roles starting)
    process.send_signal(signal.SIGINT)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert "loopline: SIGINT" in out
    if after_s == 0.0:  # torch still loading: the CLI's own stop, before the run's handler is on
        assert "loopline: SIGINT: stopped (before the run's first step" in out
