"""env.name=openai_agent: an agent program written against the real `openai` client, unaware of loopline, drives
the RL loop's rollouts. Each episode runs it on an env worker with OPENAI_BASE_URL and OPENAI_API_KEY (the
episode's id) in its environment; the OpenAI-compatible endpoint on the engines records every call's tokens and
log-probs, and GRPO trains on them. An agent that fails, hangs or never calls the model stops the run with one
line naming the prompt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.cli import main
from loopline.metrics.logger import read_metrics

pytestmark = pytest.mark.slow

# Two chat calls (the second continues the first), then the answer as the last line printed; the process that
# started it noted in a file (its parent: the env worker, or the shell the worker started).
AGENT = """
import json, os, sys
from pathlib import Path

from openai import OpenAI

task = json.loads(sys.stdin.read())
Path("MARKS", f"{os.getpid()}-{os.getppid()}").touch()
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": task["prompt"]}]
first = client.chat.completions.create(model="any", messages=messages, max_tokens=3, temperature=1.0)
messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ok?"}]
second = client.chat.completions.create(model="any", messages=messages, max_tokens=3, temperature=1.0)
print("thinking...")
print((second.choices[0].message.content or "").split(chr(10))[0])
"""

ARGS = [
    "sft.steps=0", "grpo.steps=1", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=4",
    "grpo.eval_every=0", "data.task.num_train=16", "data.task.num_eval=1", "eval.num_prompts=1",
    "runtime.env_workers=2", "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip


def _agent(tmp_path: Path, body: str = AGENT) -> str:
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    (tmp_path / "agent.py").write_text(body.replace("MARKS", str(marks)))
    return f"env.command={sys.executable} {tmp_path / 'agent.py'}"


def test_an_openai_client_agent_drives_grpo_and_its_calls_are_trained(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main(["train", "env.name=openai_agent", _agent(tmp_path), *ARGS, f"out_dir={run}"]) == 0
    rows = [r for r in read_metrics(run) if r["phase"] == "grpo" and "reward_mean" in r]
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        # every episode made its two calls, recorded and joined into the sequence that was trained
        assert r["episode_model_calls"] == 2 and 1 <= r["episode_sequences"] <= 2
        # the last call's tokens (up to 3, fewer if it sampled EOS) were trained
        assert r["response_len_mean"] >= 1
    ledger = read_ledger(run)
    assert [r["step"] for r in ledger] == [1] and not repeats(ledger)
    assert all(len(r["samples"]) == 4 for r in ledger)
    # 4 training episodes and a held-out one at each of 3 evals (before SFT, before RL, after): each a process
    # of its own, none started by this process (the env workers start them)
    marks = [tuple(map(int, p.name.split("-"))) for p in (tmp_path / "marks").iterdir()]
    assert len(marks) == 7 and len({pid for pid, _ in marks}) == 7
    assert os.getpid() not in {parent for _, parent in marks}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "import sys\nsys.stderr.write('agent crashed: no tools')\nsys.exit(3)\n",
            "exited with status 3: agent crashed",
        ),
        ("print('42')\n", "made no call to the model"),
    ],
    ids=["crashes", "never-calls"],
)
def test_a_bad_agent_stops_the_run_naming_the_prompt(tmp_path: Path, body: str, message: str, capsys) -> None:
    code = main(
        ["train", "env.name=openai_agent", _agent(tmp_path, body), *ARGS, f"out_dir={tmp_path / 'run'}"]
    )
    err = capsys.readouterr().err
    assert code != 0 and message in err and "on prompt" in err, err[-2000:]


def test_an_agent_env_needs_its_command(capsys) -> None:
    assert main(["train", "env.name=openai_agent"]) == 2
    assert "set env.command" in capsys.readouterr().err
