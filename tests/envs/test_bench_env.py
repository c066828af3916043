"""`loopline bench env`, run for real on a small batch: sandboxed code checks on env workers vs in-process."""

from __future__ import annotations

import pytest

from loopline.bench.env import batch, main, tool_episodes
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import score_chunk, step_chunk


def rewards(verdicts: list) -> list[float]:
    return [v.reward for v in verdicts]


def test_the_batch_has_a_quarter_of_its_completions_wrong() -> None:
    texts, rows = batch(8)
    assert rewards(score_chunk(EnvConfig(name="code"), (texts, rows))) == [1.0, 1.0, 1.0, 0.0] * 2


def test_the_tool_episodes_call_the_calculator_and_answer_right() -> None:
    episodes = tool_episodes(4)
    results = step_chunk(EnvConfig(name="calculator"), episodes)
    assert [r.reward for r in results] == [1.0] * 4 and all(r.done for r in results)
    assert all('"name":"calculator"' in actions[0] for actions in episodes.actions)


def test_bench_prints_name_value_lines_ending_with_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--completions", "8", "--episodes", "8", "--rounds", "1", "--workers", "1", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    assert len(values) == len(lines)  # every line is `name: value`
    assert values["completions"] == "8" and values["inprocess.reward_mean"] == "0.7500"
    assert values["workers_1.same_rewards"] == values["workers_2.same_rewards"] == "1"
    assert values["inprocess.tool_reward_mean"] == "1.0000" and values["episodes"] == "8"
    assert values["workers_1.same_tool_rewards"] == values["workers_2.same_tool_rewards"] == "1"
    for way in ("inprocess", "workers_1", "workers_2"):
        assert float(values[f"{way}.checks_per_s"]) > 0 and float(values[f"{way}.tool_calls_per_s"]) > 0
    assert lines[-1].startswith("workers_2_over_inprocess.checks_per_s: ")
    assert float(lines[-1].split(": ")[1]) == pytest.approx(
        float(values["workers_2.checks_per_s"]) / float(values["inprocess.checks_per_s"]), rel=0.02
    )


@pytest.mark.parametrize(
    "argv", [["--workers", "0"], ["--completions", "0"], ["--episodes", "0"], ["--rounds", "x"]]
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "loopline bench env" in capsys.readouterr().err
