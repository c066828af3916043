"""`loopline bench restart` end to end on the built-in model, save part only (the restart part starts
several `loopline train` processes; tests/loops/test_resume_exact.py covers those runs). Every wait in
the save bench is bounded by checkpoint.save_timeout_s."""

from __future__ import annotations

import re

import pytest

from loopline.cli import main


def test_bench_restart_save_part_prints_its_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "restart", "--skip-restart", "--models", "builtin", "--repeats", "1"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    for key in ("blocking.loop_blocked_s", "async.loop_blocked_s", "async.until_latest_s", "train_step_s"):
        assert float(lines[f"save.builtin.{key}"]) > 0, key
    assert int(lines["save.builtin.checkpoint_bytes"]) > 0
    assert list(lines)[-1] == "headline.async_over_blocking_loop_blocked"
    assert float(lines["headline.async_over_blocking_loop_blocked"]) > 0


@pytest.mark.heavy
@pytest.mark.slow
def test_bench_restart_kill_part_heals_the_trainer_from_a_replica_with_spares_or_restarts_every_role(
    ray_cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run per case on the session's Ray, a trainer rank SIGKILLed in each: healed from its replica (2 replicas,
    spares built ahead) the trainer ranks are replaced by the spares, the engine's process is kept and no checkpoint
    is loaded; a whole restart replaces the engine too; every run trains each sample once. (Per-role restarts, with
    and without spares: tests/runtime/test_fault_ray.py.)"""
    from loopline.bench.restart import KILL_PHASES

    assert (
        main(["bench", "restart", "--kill-only", "--kill-cases", "heal_standby,all", "--repeats", "1"]) == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    lines = dict(line.split(": ", 1) for line in out if re.match(r"[\w.]+: ", line))  # the bench's, not Ray's
    for case in ("heal_standby", "all"):
        times = {p: float(lines[f"kill.{case}.{p}"].split()[0]) for p in KILL_PHASES}
        assert all(t > 0 for t in times.values()), (case, times)
        assert times["time_to_next_step_s"] > times["restart_s"], (case, times)
        assert lines[f"kill.{case}.trainer_ranks_replaced"] == "1", case
        assert lines[f"kill.{case}.ledger_exactly_once"] == "1", case
    assert lines["kill.heal_standby.healed"] == "1" and lines["kill.all.healed"] == "0"
    assert lines["kill.heal_standby.engine_kept"] == "1" and lines["kill.all.engine_kept"] == "0"
    assert lines["kill.heal_standby.spares_promoted"] == "1" and lines["kill.all.spares_promoted"] == "0"
    # promoting built spares starts no process: the heal is the new world, the weight sync and the state's copy
    assert float(lines["kill.heal_standby.new_actors_s"]) < 1.0
    assert list(lines)[-1] == "headline.whole_restart_over_heal_standby"
    assert float(lines["headline.whole_restart_over_heal_standby"]) > 0
