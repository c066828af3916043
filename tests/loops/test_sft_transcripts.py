"""Multi-turn SFT from transcripts, end to end: `loopline sft` on examples/unit_env.py's demonstrations (rows with
`messages`: the call, the tool's real result, the answer) teaches the tiny model to call the tool, read its result
and copy it into its answer, on held-out problems run as real multi-turn episodes on the env workers.

The copy is learnt late and suddenly: the loss sits near 0.09 (the call and the tags learnt, the three digits
guessed) until step ~200-350, then falls to ~0 by step ~350-550. After 600 steps the held-out accuracy was 1.0 for
seeds 0, 1 and 2 (at 500 steps: 0.81 and 1.0 for seeds 0 and 1; at 800, 1.0 for seeds 0 and 2, one run each on an
AMD EPYC); the test runs 800 steps, a margin for CPUs where the drop comes later, and asserts at least 0.75 on seed 0.
What did not get there: lr 5e-3 (after 800 steps 0.69, 1.0, 0.94; the copy learnt only at step ~350-700), lr 1e-2
(0% after 600 steps, seed 2), and the default tiny model (128 wide, 4 layers: 0% after 500 steps at lr 3e-3).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest

from loopline.cli import main
from loopline.metrics.logger import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.heavy
def test_sft_on_transcripts_teaches_a_tool_env_to_answer_from_the_observation(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "examples/unit_env.py"), str(tmp_path / "data")], check=True)
    out = tmp_path / "run"
    args = [
        "sft", f"env.name=python:{ROOT / 'examples/unit_env.py'}:make_env", "env.max_turns=3",
        "env.stop=[</tool_call>,</answer>]", "data.source=jsonl", f"data.train_path={tmp_path / 'data/train.jsonl'}",
        f"data.eval_path={tmp_path / 'data/eval.jsonl'}", "sft.steps=800", "sft.batch_size=16",
        "sft.micro_batch_size=16", "sft.optim.lr=3e-3", "sft.optim.warmup_steps=0", "sft.optim.schedule=constant",
        "sft.eval_every=0", "sft.stop_at_accuracy=null", "eval.num_prompts=16", "eval.sampling.max_new_tokens=64",
        "runtime.env_workers=1", "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128",
        "model.tiny.num_layers=2", "seed=0", "progress=false", "tensorboard=false", f"out_dir={out}",
    ]  # fmt: skip
    assert main(args) == 0
    rows = read_metrics(out)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 800 and losses[-1] < losses[0] / 100
    final = [r for r in rows if "eval_accuracy" in r][-1]
    # every held-out episode: a well-formed call that ran, its result read, then an answer that ended the episode
    assert final["eval_tool_calls_ok"] == 1.0 and final["eval_turns_mean"] == 2.0, final
    assert final["eval_answered"] == 1.0 and final["eval_finish_done"] == 1.0, final
    # and the answer is the tool's result: the prompt alone does not give it (0 of 16 before the copy is learnt)
    assert final["eval_accuracy"] >= 0.75, final
