"""`loopline export` writes a model card (README.md) beside the weights: base model, data, the algorithm and its key
settings, the final metrics as of the exported checkpoint (not rows logged after it), and the loopline version and
commit the run started with and that exported it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from loopline.cli import main
from loopline.metrics.logger import read_metrics
from loopline.version import version

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # the CLI's entry point, whole runs

TINY = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=2", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4",
    "grpo.micro_batch_size=8", "grpo.eval_every=1", "grpo.kl_coef=0.02",
    "data.task.num_train=200", "data.task.num_eval=8", "eval.num_prompts=8", "eval.batch_size=8",
    "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("card") / "run"
    assert main(["train", *TINY, f"out_dir={out}"]) == 0
    return out


def _card(run: Path, source: Path, out: Path) -> str:
    assert main(["export", str(source), str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    return (out / "README.md").read_text()


def test_the_card_says_what_the_model_is_and_how_it_was_made(run: Path, tmp_path: Path) -> None:
    card = _card(run, run, tmp_path / "my-model")
    assert card.startswith("# my-model\n")
    assert "exported from checkpoint `grpo-000002` (phase grpo, step 2)" in card
    assert f"- trained with loopline {version()}" in card and f"- exported by loopline {version()}" in card
    assert re.search(r"loopline 0\.1\.0 \(commit ([0-9a-f]{40}(\+dirty)?|unknown)\)", card)
    assert "built-in tiny model" in card and "hidden_size 128, 4 layers" in card
    assert "- `data.source`: builtin (the task env.name=addition generates)" in card
    assert "- phases: supervised fine-tuning (SFT) then RL (the GRPO family, PPO)" in card
    assert "group_size=4" in card and "kl_coef=0.02" in card and "advantage='grpo'" in card
    last = [r for r in read_metrics(run) if r["phase"] == "grpo" and "reward_mean" in r][-1]
    assert f"| grpo | 2 | reward_mean | {last['reward_mean']:.4g} |" in card
    eval_after = [r for r in read_metrics(run) if r["phase"] == "grpo" and "eval_accuracy" in r][-1]
    assert f"| grpo | 2 | eval_accuracy | {eval_after['eval_accuracy']:.4g} |" in card
    assert "```yaml\nout_dir: " in card  # the whole config, to run it again
    sft = [r for r in read_metrics(run) if r["phase"] == "sft" and "eval_accuracy" in r][-1]
    assert (
        f"| sft | {sft['step']} | eval_accuracy | {sft['eval_accuracy']:.4g} |" in card
    )  # the step it was measured at


def test_an_earlier_checkpoint_gets_the_metrics_of_its_own_step(run: Path, tmp_path: Path) -> None:
    card = _card(run, run / "checkpoints" / "grpo-000001", tmp_path / "early")
    assert "(phase grpo, step 1)" in card
    assert "| grpo | 1 | reward_mean |" in card and "| grpo | 2 |" not in card


def test_a_checkpoint_without_its_run_says_unknown(run: Path, tmp_path: Path) -> None:
    alone = tmp_path / "alone" / "grpo-000002"
    shutil.copytree(run / "checkpoints" / "grpo-000002", alone)
    card = _card(run, alone, tmp_path / "out")
    assert "- trained with loopline unknown" in card
    assert "unknown: the run's metrics.jsonl was not found beside the checkpoint" in card
    assert "group_size=4" in card  # the checkpoint's own copy of the config still says how it was trained


def test_the_card_s_loading_code_gives_the_tokenizer_the_run_trained_with(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The card's Python block, run as written beside the export, loads the model and the tokenizer the run
    encoded with: the model's vocabulary size and the same ids (AutoTokenizer would rebuild a Qwen2Tokenizer
    from the built-in byte tokenizer's vocabulary, one token larger)."""
    from loopline.models.tokenizer import load_tokenizer

    card = _card(run, run, tmp_path / "exported")
    code = re.search(r"## Load it\n\n```python\n(.*?)```", card, re.DOTALL)
    assert code is not None, card
    assert "AutoTokenizer" not in code.group(1) and "AutoTokenizer" not in card.replace(
        "not with `AutoTokenizer.from_pretrained`", ""
    )
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(code.group(1), scope)
    tokenizer, model = scope["tokenizer"], scope["model"]
    assert len(tokenizer) == model.config.vocab_size == 259
    trained = load_tokenizer(run / "checkpoints" / "grpo-000002" / "model")
    text = "12+345=357 and some text"
    assert tokenizer.encode(text) == trained.encode(text)
