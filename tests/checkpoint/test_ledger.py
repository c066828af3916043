"""The sample ledger: one JSON line per step, read back in order; repeats counted per phase."""

from __future__ import annotations

import json

from loopline.checkpoint.ledger import LEDGER_FILE, Ledger, read_ledger, repeats


def test_record_appends_one_line_per_step_and_reads_back(tmp_path):
    ledger = Ledger(tmp_path)
    assert ledger.path == tmp_path / LEDGER_FILE == tmp_path / "ledger.jsonl"
    ledger.record("sft", 1, [(0, 3, 0), (0, 4, 0)])
    ledger.record("grpo", 1, [])
    ledger.record("grpo", 2, [(1, 7, 2)])
    lines = (tmp_path / "ledger.jsonl").read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 4  # every line ends with a newline, nothing else in between
    assert json.loads(lines[0]) == {"phase": "sft", "step": 1, "samples": [[0, 3, 0], [0, 4, 0]]}
    assert read_ledger(tmp_path) == [
        {"phase": "sft", "step": 1, "samples": [[0, 3, 0], [0, 4, 0]]},
        {"phase": "grpo", "step": 1, "samples": []},
        {"phase": "grpo", "step": 2, "samples": [[1, 7, 2]]},
    ]


def test_read_ledger_skips_blank_lines(tmp_path):
    (tmp_path / LEDGER_FILE).write_text('{"phase": "sft", "step": 1, "samples": []}\n\n  \n')
    assert read_ledger(tmp_path) == [{"phase": "sft", "step": 1, "samples": []}]


def test_clear_starts_afresh_and_is_safe_without_a_file(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.clear()  # no file yet: nothing to remove
    ledger.record("sft", 1, [(0, 1, 0)])
    ledger.clear()
    assert not ledger.path.exists()
    ledger.record("sft", 1, [(0, 2, 0)])
    assert read_ledger(tmp_path) == [{"phase": "sft", "step": 1, "samples": [[0, 2, 0]]}]


def test_repeats_counts_samples_trained_twice_within_a_phase(tmp_path):
    rows = [
        {"phase": "grpo", "step": 1, "samples": [[0, 1, 0], [0, 1, 1]]},
        {"phase": "grpo", "step": 2, "samples": [[0, 1, 0], [1, 1, 0], [0, 1, 1]]},  # two seen again
        {"phase": "grpo", "step": 3, "samples": [[0, 1, 0]]},  # and (0, 1, 0) a third time
        {"phase": "sft", "step": 1, "samples": [[0, 1, 1]]},  # another phase: not a repeat
    ]
    assert repeats(rows) == {("grpo", 0, 1, 0): 3, ("grpo", 0, 1, 1): 2}
    assert repeats(rows[:1] + rows[3:]) == {}
