"""`loopline bench generate` runs both engines on one batch and prints comparable figures."""

from __future__ import annotations

import re

import pytest

from loopline.bench.generate import main


def test_bench_generate_prints_both_engines_and_ends_with_the_long_tail_ratio(capsys):
    assert (
        main(["--prompts", "4", "--samples", "2", "--max-new", "24", "--max-rows", "4", "--repeats", "1"])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    for case in ("equal_length", "long_tail"):
        for who in ("builtin", "hf"):
            assert float(values[f"{case}_{who}_tokens_per_s"]) > 0
    # equal length: every sample of both engines runs to --max-new; the long tail stops most of them early
    assert values["equal_length_builtin_mean_length"] == values["equal_length_hf_mean_length"] == "24.0"
    assert (
        float(values["long_tail_builtin_mean_length"]) < 24 and float(values["long_tail_hf_mean_length"]) < 24
    )
    # capped: the continuous engine and both static batchers return every sample
    for who in ("builtin", "builtin_static", "hf"):
        assert float(values[f"long_tail_capped_{who}_tokens_per_s"]) > 0
        assert float(values[f"long_tail_capped_{who}_mean_length"]) < 24
    assert float(values["long_tail_capped_builtin_over_builtin_static_tokens_per_s"]) > 0
    assert re.fullmatch(r"builtin_over_hf_tokens_per_s: [0-9.]+", lines[-1])
    assert lines[-1].split(": ")[1] == values["long_tail_builtin_over_hf_tokens_per_s"]


def test_bench_generate_refuses_a_batch_of_nothing():
    with pytest.raises(SystemExit):
        main(["--prompts", "0"])
    with pytest.raises(SystemExit):
        main(["--samples", "8", "--max-rows", "4"])  # not even one prompt's group fits
