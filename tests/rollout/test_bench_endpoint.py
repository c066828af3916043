"""`loopline bench endpoint`, run for real with tiny settings: concurrent openai clients against the server."""

from __future__ import annotations

import pytest
import torch

from loopline.bench.endpoint import Agent, ask, check, main
from loopline.rollout.openai_server import ServedCompletion
from tests.conftest import need_module


def test_bench_prints_name_value_lines_ending_with_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    need_module("openai", "the openai client is not installed (pip install loopline[dev])")
    threads = torch.get_num_threads()
    assert main(["--clients", "1", "6", "--requests", "2", "--max-tokens", "3"]) == 0
    assert torch.get_num_threads() == threads  # the bench's own setting is undone
    lines = capsys.readouterr().out.splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    assert len(values) == len(lines)  # every line is `name: value`
    assert values["requests_per_client"] == "2" and values["max_tokens"] == "3"
    for n in (1, 6):
        assert values[f"concurrent_{n}.requests"] == str(2 * n)
        assert values[f"concurrent_{n}.errors"] == values[f"concurrent_{n}.lost"] == "0"
        assert values[f"concurrent_{n}.crossed"] == "0"
        assert float(values[f"concurrent_{n}.max_logprob_diff"]) < 1e-3
        assert float(values[f"concurrent_{n}.requests_per_s"]) > 0
        assert 0 < float(values[f"concurrent_{n}.p50_ms"]) <= float(values[f"concurrent_{n}.p99_ms"])
    assert lines[-1].startswith("concurrent_6_over_1.requests_per_s: ")
    assert float(lines[-1].split(": ")[1]) == pytest.approx(
        float(values["concurrent_6.requests_per_s"]) / float(values["concurrent_1.requests_per_s"]), rel=0.05
    )


def _served(trajectory: str, prompt: str, text: str, logprob: float = -1.0) -> ServedCompletion:
    ids = list(prompt.encode()), list(text.encode())
    return ServedCompletion(trajectory, "r", 0, ids[0], ids[1], [logprob] * len(ids[1]), text, "length", 0)


def decode(ids: list[int]) -> str:
    return bytes(ids).decode()  # a stand-in tokenizer: one byte per token


def model(served: list[ServedCompletion]) -> list[list[float]]:
    return [[-1.0] * len(r.completion_ids) for r in served]  # a stand-in model: every token at -1


def test_check_counts_lost_and_crossed_turns() -> None:
    agents = [Agent("a", [(0, "x"), (1, "y")], [0.1, 0.1], []), Agent("b", [(0, "z")], [0.1], [])]
    right = {
        "a": [_served("a", ask("a", 0), "x"), _served("a", ask("a", 1), "y", logprob=-1.0005)],
        "b": [_served("b", ask("b", 0), "z")],
    }
    assert check(agents, right, decode, model) == (0, 0, pytest.approx(5e-4))  # within LOGPROB_TOL
    assert check(agents, {"a": right["a"][:1], "b": right["b"]}, decode, model)[:2] == (1, 0)  # a turn lost
    swapped = {"a": [right["a"][0], _served("a", ask("a", 1), "z")], "b": [_served("b", ask("b", 0), "y")]}
    assert check(agents, swapped, decode, model)[:2] == (0, 2)  # texts crossed between a and b
    wrong_prompt = {"a": right["a"], "b": [_served("b", ask("a", 0), "z")]}
    assert check(agents, wrong_prompt, decode, model)[:2] == (0, 1)
    # the right text, but sampled after another prompt: its log-probs give it away
    wrong_logprobs = {"a": right["a"], "b": [_served("b", ask("b", 0), "z", logprob=-2.0)]}
    assert check(agents, wrong_logprobs, decode, model) == (0, 1, 1.0)
    assert check(agents, {**right, "c": right["b"]}, decode, model)[:2] == (0, 1)  # nobody asked for c


@pytest.mark.parametrize("argv", [["--clients", "0"], ["--requests", "0"], ["--max-tokens", "x"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "loopline bench endpoint" in capsys.readouterr().err
