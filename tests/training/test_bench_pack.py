"""`loopline bench pack` times the padded, shared-prompt and packed policy steps on one batch and prints comparable
figures."""

from __future__ import annotations

import re

import pytest

from loopline.bench.pack import main


def test_bench_pack_checks_the_logprobs_and_ends_with_the_long_tail_ratio(capsys):
    argv = ["--prompts", "4", "--samples", "4", "--mean-length", "6", "--max-new", "40", "--micro-batch", "8"]
    assert main([*argv, "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    for case in ("default_shape", "long_tail"):
        assert float(values[f"{case}_logprob_max_abs_diff"]) < 1e-4
        assert float(values[f"{case}_shared_logprob_max_abs_diff"]) < 1e-4
        assert float(values[f"{case}_shared_over_padded_tokens_per_s"]) > 0
        assert int(values[f"{case}_real_tokens"]) < int(values[f"{case}_padded_tokens"])
        assert int(values[f"{case}_response_tokens"]) < int(values[f"{case}_real_tokens"])
        for who in ("padded", "shared", "packed"):
            assert float(values[f"{case}_{who}_tokens_per_s"]) > 0
    assert re.fullmatch(r"packed_over_padded_tokens_per_s: [0-9.]+", lines[-1])
    assert lines[-1].split(": ")[1] == values["long_tail_packed_over_padded_tokens_per_s"]


def test_bench_pack_refuses_an_empty_batch():
    with pytest.raises(SystemExit):
        main(["--samples", "0"])
