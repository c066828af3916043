"""metrics.jsonl rows, truncation for resumed runs, TensorBoard, and the curves plot."""

from __future__ import annotations

import json

import pytest

from loopline.errors import UserError
from loopline.metrics.logger import MetricsLogger, read_metrics
from loopline.metrics.plot import plot_run
from tests.conftest import need_module


def _fill(logger: MetricsLogger) -> None:
    logger.log({"phase": "sft", "step": 0, "eval_accuracy": 0.0})
    for step in (1, 2, 3):
        logger.log({"phase": "sft", "step": step, "loss": 3.0 / step})
    logger.log({"phase": "grpo", "step": 0, "eval_accuracy": 0.1})
    for step in (1, 2, 3, 4):
        logger.log(
            {"phase": "grpo", "step": step, "reward_mean": step / 10, "entropy": 1.0, "response_len_mean": 5}
        )


def test_rows_round_trip_and_non_finite_become_null(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(
        {"phase": "grpo", "step": 1, "loss": float("nan"), "grad_norm": float("inf"), "n": 3, "ok": True}
    )
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    json.loads(line)  # strict JSON: no NaN / Infinity literals
    assert "NaN" not in line and "Infinity" not in line
    assert read_metrics(tmp_path) == [
        {"phase": "grpo", "step": 1, "loss": None, "grad_norm": None, "n": 3, "ok": True}
    ]


def test_noted_fields_go_on_the_next_row_only_and_summed_ones_add_up(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.note({"skipped": 2})
    logger.note_sum({"heal_s": 1.5, "heals": 1})
    logger.note_sum({"heal_s": 2.0, "heals": 1})  # two heals in one step
    logger.log({"phase": "grpo", "step": 1})
    logger.note_sum({"heals": 1})
    logger.log({"phase": "grpo", "step": 2})
    logger.log({"phase": "grpo", "step": 3})
    logger.close()
    assert read_metrics(tmp_path) == [
        {"phase": "grpo", "step": 1, "skipped": 2, "heal_s": 3.5, "heals": 2},
        {"phase": "grpo", "step": 2, "heals": 1},
        {"phase": "grpo", "step": 3},
    ]


def test_a_last_line_cut_short_is_left_out_and_any_other_bad_line_is_named(tmp_path, caplog):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    _fill(logger)
    path = tmp_path / "metrics.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"phase": "grpo", "step": 5, "rew')  # a crash in the middle of a write
    assert read_metrics(tmp_path) == read_metrics_of(whole, tmp_path / "whole")
    assert "line 10 was cut short" in caplog.text
    path.write_text(whole + '{"phase": "grpo", "step": 5, "rew\n')  # a whole line, not JSON: not a crash's
    with pytest.raises(UserError, match=r"metrics.jsonl line 10 is not a metrics row: Unterminated string"):
        read_metrics(tmp_path)
    lines = whole.splitlines()
    path.write_text("\n".join([*lines[:3], "[1, 2]", *lines[3:]]) + "\n")
    with pytest.raises(UserError, match="line 4 is not a metrics row: a JSON list, not an object"):
        read_metrics(tmp_path)


def read_metrics_of(text: str, run_dir):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(text)
    return read_metrics(run_dir)


def test_clear_starts_a_new_file(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    _fill(logger)
    logger.clear()
    logger.clear()  # also fine when there is nothing to clear
    logger.log({"phase": "sft", "step": 0})
    assert read_metrics(tmp_path) == [{"phase": "sft", "step": 0}]


def test_read_metrics_without_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        read_metrics(tmp_path)


def test_tensorboard_events_are_written(tmp_path):
    need_module("tensorboard", "tensorboard is not installed (pip install loopline[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    _fill(logger)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("grpo/reward_mean")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert "sft/loss" in acc.Tags()["scalars"]


@pytest.mark.parametrize("with_sft", [True, False])
def test_plot_writes_curves_png(tmp_path, with_sft):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    if with_sft:
        _fill(logger)
    else:
        logger.log({"phase": "grpo", "step": 0, "eval_accuracy": 0.1})
        logger.log({"phase": "grpo", "step": 1, "reward_mean": 0.5})
    (path,) = plot_run(tmp_path)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
