"""`loopline bench memory` end to end on a toy shape: loopline's run and TRL's side by side, the length trials in
processes of their own, the plan's estimate beside every measured peak, and the plan refusing a trial before it
starts."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from loopline.bench.memory import TINY, length_ladder, prompts_of, write_model_dir
from loopline.cli import main
from tests.conftest import need_module


def _value(out: str, key: str) -> str:
    match = re.search(rf"^{key}: (.*)$", out, re.MULTILINE)
    assert match, f"no {key} line in:\n{out}"
    return match.group(1)


@pytest.mark.heavy
@pytest.mark.e2e  # whole runs (loopline's and TRL's) in processes of their own
def test_quick_bench_prints_peaks_beside_the_plan(capsys):
    need_module("trl", "the bench runs TRL beside loopline (pip install loopline[parity])")
    argv = ["bench", "memory", "--quick", "--steps", "1", "--backends", "local", "--prompt-tokens", "8",
            "--new-tokens", "4", "--rows", "2", "--lengths", "16", "--mixed-precision"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    for who in ("local", "trl"):
        peak = _value(out, f"{who}_peak_rss_gib")
        assert float(peak.split()[0]) > 0.1, peak  # torch alone is ~0.3 GiB
        assert float(_value(out, f"{who}_step_s").split()[0]) > 0
    local = _value(out, "local_peak_rss_gib")
    measured, plan = float(local.split()[0]), float(re.search(r"\(plan ([\d.]+)", local).group(1))
    assert 0.5 < plan / measured < 2.0, local  # the estimate beside the peak, of the same size
    for switches in ("off", "on", "mixed"):
        trial = _value(out, f"trial_{switches}_16")
        assert re.match(r"ok [\d.]+ s, peak_rss [\d.]+ GiB \(plan [\d.]+\), vm_peak [\d.]+ GiB", trial), trial
        assert _value(out, f"length_limit_{switches}").startswith("16 ")
    assert _value(out, "length_ratio_on_over_off") == "1.00"
    assert _value(out, "length_ratio_mixed_over_off") == "1.00"
    assert "training.mixed_precision=bf16)" in _value(out, "length_limit_mixed")
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"memory_ratio_vs_trl: [\d.]+", last), last
    ratio = float(last.split()[1])
    trl = float(_value(out, "trl_peak_rss_gib").split()[0])
    # Each peak is printed to 0.01 GiB: the ratio lies within what those roundings allow (and its own).
    low, high = (measured - 0.005) / (trl + 0.005), (measured + 0.005) / (trl - 0.005)
    assert low - 0.005 <= ratio <= high + 0.005, (ratio, measured, trl)


@pytest.mark.unit
def test_the_plan_refuses_a_trial_before_it_starts(tmp_path, capsys):
    tokenizer = write_model_dir(tmp_path / "model", TINY)
    prompts = prompts_of(tokenizer, 2, 8)
    assert [len(tokenizer(p)["input_ids"]) for p in prompts] == [8, 8] and prompts[0] != prompts[1]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    a = argparse.Namespace(prompt_tokens=8, steps=1, rows=2, lengths=[16, 32], limit_gib=0.1)
    assert length_ladder(a, tmp_path, tmp_path / "model", data, "off", []) == 0
    out = capsys.readouterr().out
    assert re.search(r"trial_off_16: refused by the plan \([\d.]+ GiB > limit 0.1\)", out), out
    assert "length_limit_off: 0 " in out and not list(tmp_path.glob("trial-*.log"))  # no trial process ran
