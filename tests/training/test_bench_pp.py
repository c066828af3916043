"""`loopline bench pp` runs a pipelined and an FSDP2 world on the same batches, checks they end at the same
weights, and prints comparable figures; its bubble fraction is the schedule's; bad sizes are refused."""

from __future__ import annotations

import pytest

from loopline.bench.pp import bubble_fraction, main


def test_bubble_fraction_of_the_schedules():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)  # GPipe / 1F1B: (p - 1) / (m + p - 1)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(2, 4, virtual=2) == pytest.approx(1 / 9)  # interleaved: v m in place of m
    assert bubble_fraction(1, 4) == 0.0


@pytest.mark.gloo  # two spawned worlds of ranks (the rest of this module: unit)
def test_bench_pp_runs_both_worlds_to_the_same_weights(capsys):
    argv = ["--hidden", "32", "--layers", "2", "--heads", "2", "--prompts", "2", "--samples", "4"]
    assert main([*argv, "--micro-batch", "2", "--max-new", "4", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    values = dict(line.split(": ", 1) for line in lines)
    assert float(values["weights_max_abs_diff"]) < 1e-5  # the same update: the bench compares equal work
    assert values["pp_micro_batches"] == "4"
    assert float(values["pp_bubble_fraction"]) == pytest.approx(1 / 5, abs=1e-3)
    for mode in ("fsdp", "pp"):
        assert float(values[f"{mode}_step_ms"]) > 0
        peaks = values[f"{mode}_peak_mib_per_rank"].split()
        assert len(peaks) == 2 and all(float(p) >= 0 for p in peaks)
    ratio = float(values["pp_step_ms"]) / float(values["fsdp_step_ms"])
    assert lines[-1].startswith("pp_over_fsdp_step_time: ")
    assert abs(float(lines[-1].split(": ")[1]) - ratio) <= 0.011  # from the printed (rounded) step times


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "3"], "do not divide"),
        (["--prompts", "3", "--samples", "1", "--micro-batch", "2"], "must split into"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--schedule", "zigzag"], "invalid choice"),
    ],
)
def test_bench_pp_refuses_sizes_that_do_not_fit(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
