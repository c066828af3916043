"""`loopline bench moe` at a small size: the expert-parallel and FSDP2 steps start from the same loss, replayed
routes are the engine's (0 differ), the replay-off mismatch is counted the same two ways, both syncs are bitwise,
and the output ends with the headline ratio; bad sizes are refused naming the flag."""

from __future__ import annotations

import re

import pytest

from loopline.cli import main

pytestmark = pytest.mark.gloo


def _value(out: str, key: str) -> float:
    match = re.search(rf"^{key}: (\S+)$", out, re.MULTILINE)
    assert match, f"no {key} line in:\n{out}"
    return (
        float(match.group(1)) if match.group(1) not in ("true", "false") else float(match.group(1) == "true")
    )


def test_quick_bench_moe(capsys):
    argv = ["bench", "moe", "--rows", "16", "--group", "4", "--micro", "8", "--repeats", "1", "--response", "6",
            "--lr", "1e-3"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _value(out, "ep_first_loss") == pytest.approx(_value(out, "fsdp_first_loss"), abs=1e-5)
    assert _value(out, "route_mismatch_stale_on_used") == 0.0  # replay: exactly the engine's experts
    off = _value(out, "route_mismatch_stale_off")
    assert 0 < off <= 1 and _value(out, "route_mismatch_stale_off_used") == pytest.approx(off)
    assert _value(out, "sync_moe_bitwise") == 1.0 and _value(out, "sync_dense_bitwise") == 1.0
    assert _value(out, "sync_moe_params") > 5 * _value(out, "sync_dense_params")  # 128 experts, 8 active
    assert 0 < _value(out, "ep_all_to_all_share") < 1
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"ep_step_speedup: [\d.]+", last), last


def test_bad_sizes_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", "moe", "--rows", "12", "--group", "4"])
    assert (
        err.value.code == 2 and "--rows 12 must split into 2 ranks of whole groups" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["bench", "moe", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err
