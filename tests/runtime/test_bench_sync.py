"""`loopline bench sync` through the real CLI entry point, on the smallest world (2 colocated ranks)."""

from __future__ import annotations

import pytest

from loopline.cli import main


@pytest.mark.slow
def test_bench_sync_prints_numbers_and_headline(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "sync", "--colocated", "--models", "builtin", "--repeats", "1", "--timeout", "120"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    values = dict(line.split(": ", 1) for line in lines)  # every line is `name: value`
    assert len(values) == len(lines)
    assert values["world"] == "2"
    assert values["plan_70b.exact_once"] == "true"
    assert values["plan_70b.bytes_moved"] == values["plan_70b.lower_bound"]
    assert values["builtin.planned_equals_naive_bitwise"] == "true"
    assert int(values["builtin.planned.bytes_local"]) > 0  # colocated: part of the sync never leaves the rank
    # The baseline stages a whole second model on rank 0; the planned sync at most this small model's half.
    assert int(values["builtin.naive.peak_buffer_bytes_max_rank"]) >= int(values["builtin.param_bytes"])
    assert int(values["builtin.planned.peak_buffer_bytes_max_rank"]) < int(values["builtin.param_bytes"]) // 2
    assert [line.split(":")[0] for line in lines[-4:]] == [
        "headline.model",
        "headline.time_planned_over_naive",
        "headline.peak_buffer_planned_over_naive",
        "headline.peak_rss_planned_over_naive",
    ]
