"""A run that learns nothing says so (issue 39: the README's short example went 0.4% -> 0.1%, every reward and every
GRPO loss 0, without a word): grpo.no_signal_steps steps in a row whose advantages are all 0 make a warning and an
end-of-run report with the likeliest causes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopline.cli import main
from loopline.config import load_config
from loopline.loops.no_signal import NoSignalWatch, Sample

SAMPLE = Sample("1+1=\nabc", "2", 0.0)
WRONG, RIGHT = torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)  # no completion correct, all


def _watch(*overrides: str) -> NoSignalWatch:
    return NoSignalWatch.for_run(load_config(overrides=["grpo.group_size=2", *overrides]))


def test_only_groups_whose_rewards_differ_carry_signal_for_group_baselines() -> None:
    grouped = torch.tensor([1.0, 1.0, 0.0, 0.0])  # each group equal, the batch not
    assert _watch().informative(grouped) == (0, 2) and _watch().informative(torch.zeros(4)) == (0, 2)
    assert _watch().informative(torch.tensor([1.0, 0.0, 0.0, 0.0])) == (1, 2)
    # reinforce_pp whitens over the batch: equal groups still differ from each other
    assert _watch("grpo.advantage=reinforce_pp").informative(grouped) == (1, 1)
    assert _watch("grpo.advantage=reinforce_pp").informative(torch.full((4,), 0.5)) == (0, 1)


def test_a_step_lacks_signal_up_to_no_signal_share_of_informative_groups() -> None:
    def rewards(informative: int) -> torch.Tensor:  # 20 groups of 2, the first `informative` mixed
        return torch.tensor([1.0, 0.0] * informative + [0.0, 0.0] * (20 - informative))

    wrong = torch.zeros(40, dtype=torch.bool)
    watch = _watch("grpo.no_signal_steps=2", "grpo.no_signal_share=0.1", "grpo.steps=10")
    assert watch.update(1, rewards(2), wrong, 0.0, SAMPLE) is None  # 2 of 20: at most 10%
    warning = watch.update(2, rewards(1), wrong, 0.0, SAMPLE)
    assert warning is not None and "at most 2 of 20 groups a step got rewards that differed" in warning
    strict = _watch("grpo.no_signal_steps=1", "grpo.no_signal_share=0", "grpo.steps=10")
    assert (
        strict.update(1, rewards(1), wrong, 0.0, SAMPLE) is None
    )  # share 0: one informative group is signal
    assert strict.update(2, rewards(0), wrong, 0.0, SAMPLE) is not None
    assert _watch("grpo.no_signal_steps=1").update(1, rewards(3), wrong, 0.0, SAMPLE) is None  # 15%: signal


def test_the_warning_comes_once_at_the_nth_step_in_a_row_and_a_step_with_signal_resets_the_count() -> None:
    watch = _watch("grpo.no_signal_steps=3", "grpo.steps=10")
    zeros, mixed = torch.zeros(4), torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert watch.update(1, zeros, WRONG, 0.0, SAMPLE) is None
    assert watch.update(2, zeros, WRONG, 0.0, SAMPLE) is None
    assert watch.update(3, mixed, WRONG, 0.0, SAMPLE) is None  # signal: the count starts again
    assert [watch.update(s, zeros, WRONG, 0.5, SAMPLE) for s in (4, 5)] == [None, None]
    warning = watch.update(6, zeros, WRONG, 0.0, SAMPLE)
    assert warning is not None and "GRPO steps 4-6" in warning and "every reward was 0" in warning
    assert watch.update(7, zeros, WRONG, 0.0, SAMPLE) is None  # said once
    assert [s.step for s in watch.found] == [4, 5, 6, 7]
    assert [s.truncated for s in watch.found] == [0.5, 0.5, 0.0, 0.0]


def test_a_run_shorter_than_no_signal_steps_needs_all_of_its_steps() -> None:
    watch = _watch("grpo.no_signal_steps=5", "grpo.steps=2")
    assert watch.update(1, torch.zeros(4), WRONG, 0.0, SAMPLE) is None
    assert watch.update(2, torch.zeros(4), WRONG, 0.0, SAMPLE) is not None
    assert not _watch("grpo.no_signal_steps=0").update(1, torch.zeros(4), WRONG, 0.0, SAMPLE)  # 0: never


def test_a_step_trained_again_after_a_restart_is_counted_once() -> None:
    watch = _watch("grpo.no_signal_steps=3", "grpo.steps=10")
    for step in (1, 2, 2, 3):  # step 2 again: the run resumed from the checkpoint of step 1
        warning = watch.update(step, torch.zeros(4), WRONG, 0.0, SAMPLE)
    assert warning is not None and [s.step for s in watch.found] == [1, 2, 3]


def test_the_report_names_the_causes_with_the_run_s_numbers() -> None:
    cfg = load_config(overrides=["grpo.group_size=2", "grpo.steps=2", "sft.steps=7"])
    watch = NoSignalWatch.for_run(cfg)
    assert watch.report(cfg, 0.004) == []  # nothing found, nothing said
    for step in (1, 2):
        watch.update(step, torch.zeros(4), WRONG, 0.25, SAMPLE)
    text = "\n".join(watch.report(cfg, 0.004))
    assert "no learning signal: in GRPO steps 1-2 (2 in a row, mean reward 0) every reward was 0" in text
    assert "7 SFT steps reached 0.4% held-out accuracy" in text
    assert (
        f"25.0% of these steps' completions hit grpo.sampling.max_new_tokens={cfg.grpo.sampling.max_new_tokens}"
        in text
    )
    assert "the completion '1+1=\\nabc' got 0 against the answer '2'" in text

    assert "samples too alike" not in text  # every reward 0: not a matter of sampling
    alike = NoSignalWatch.for_run(cfg)
    for step in (1, 2):
        alike.update(step, torch.tensor([0.5, 0.5, 0.0, 0.0]), WRONG, 0.0, SAMPLE)
    assert "samples too alike to differ in reward: grpo.sampling.temperature=1" in "\n".join(
        alike.report(cfg, 0.0)
    )

    perfect = NoSignalWatch.for_run(cfg)
    for step in (1, 2):
        perfect.update(step, torch.ones(4), RIGHT, 0.0, SAMPLE)
    assert "every answer is already right" in "\n".join(perfect.report(cfg, 1.0))


@pytest.mark.slow
def test_a_run_too_short_to_learn_says_so_and_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the default task after 2 SFT steps: the policy never writes a right sum, every reward is 0
    tiny = [
        "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
        "grpo.steps=2", "grpo.stop_at_accuracy=null", "grpo.prompts_per_step=4", "grpo.group_size=4",
        "grpo.eval_every=0", "data.task.num_train=200", "data.task.num_eval=20", "eval.num_prompts=20",
        "checkpoint_every=0", "progress=false", "tensorboard=false", "threads=1", f"out_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    assert main(["train", *tiny]) == 0
    out, err = capsys.readouterr()
    assert "loopline: warning: no learning signal in GRPO steps 1-2: every reward was 0" in err
    assert "no learning signal: in GRPO steps 1-2 (2 in a row, mean reward 0) every reward was 0" in out
    assert "2 SFT steps reached 0.0% held-out accuracy" in out
    assert "grpo.sampling.max_new_tokens=" in out and "against the answer" in out
    assert "mean reward 0.000" in out  # beside the accuracy
