"""Preference pairs: built-in wrong sums, pairs from policy samples, jsonl rows in text and chat formats, bad rows, micro-batches."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loopline.config import PreferenceDataConfig, TaskConfig
from loopline.data.batches import collate
from loopline.data.datasets import DataError, PromptRow
from loopline.data.preference import PairBatch, builtin_pairs, load_pairs, policy_pairs, wrong_sum
from loopline.data.tasks import arithmetic_splits


def test_wrong_sums_are_wrong_same_width_digits():
    rng = random.Random(0)
    for answer in ["0000", "0427", "1998", "0009", "10"]:
        for _ in range(50):
            wrong = wrong_sum(answer, rng)
            assert wrong != answer and len(wrong) == len(answer) and wrong.isdigit()


def test_builtin_pairs_chosen_is_the_true_sum_and_rejected_differs():
    # the SFT teacher drops carries in some targets (the default): the chosen side is still the true sum
    train, _ = arithmetic_splits(TaskConfig(num_train=50, num_eval=5, teacher_drops_carries=1.0), seed=0)
    assert sum(r.completion != r.answer + "\n" for r in train[:20]) >= 5
    pairs = builtin_pairs(train, seed=0, limit=20)
    assert len(pairs) == 20 and [p.index for p in pairs] == list(range(20))
    for p, row in zip(pairs, train):
        assert p.prompt == row.prompt and p.chosen == row.answer + "\n"  # "0427\n"
        assert p.rejected.endswith("\n") and p.rejected != p.chosen and len(p.rejected) == len(p.chosen)
    assert builtin_pairs(train, seed=0, limit=20) == pairs  # deterministic


def test_policy_pairs_reject_each_distinct_wrong_sample():
    rows = [PromptRow(0, "12+30=", "042", "042\n"), PromptRow(1, "01+01=", "002", "002\n")]
    samples = [["042\n", "041\n", "1\x05", "041\n"], ["002\n", "002\n"]]
    correct = [[True, False, False, False], [True, True]]
    pairs = policy_pairs(rows, samples, correct, seed=0)
    # row 0: its two distinct wrong samples, malformed one included, in order; row 1 (all right): one synthetic
    assert [(p.index, p.prompt, p.chosen, p.rejected) for p in pairs[:2]] == [
        (0, "12+30=", "042\n", "041\n"),
        (1, "12+30=", "042\n", "1\x05"),
    ]
    assert len(pairs) == 3 and pairs[2].index == 2 and pairs[2].chosen == "002\n"
    assert pairs[2].rejected != "002\n" and pairs[2].rejected.endswith("\n") and len(pairs[2].rejected) == 4
    with pytest.raises(ValueError, match="one sample list per row"):
        policy_pairs(rows, samples[:1], correct, seed=0)
    with pytest.raises(ValueError, match="row 1: 2 samples but 1 verdicts"):
        policy_pairs(rows, samples, [correct[0], [True]], seed=0)


def _write(tmp_path, rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_text_and_chat_rows(tmp_path):
    user = {"role": "user", "content": "2+2="}
    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.5},
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
        {"chosen": [user, {"role": "assistant", "content": "4"}], "rejected": [user, {"role": "assistant", "content": "22"}]},
    ]  # fmt: skip
    pairs = load_pairs(_write(tmp_path, rows), PreferenceDataConfig())
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected, pairs[0].margin) == ("1+1=", "2", "3", 1.5)
    assert pairs[1].messages == (user,) and (pairs[1].chosen, pairs[1].rejected) == ("4", "5")
    assert pairs[2].messages == (user,) and (pairs[2].chosen, pairs[2].rejected) == ("4", "22")
    assert pairs[2].margin == 0.0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "chosen": "a"}, "missing field 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "no prompt"),
        ({"prompt": "x", "chosen": 3, "rejected": "b"}, "field 'chosen' must be"),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": "b"},
            "last message must be the assistant",
        ),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, row, message):
    path = _write(tmp_path, [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError, match=rf"pairs\.jsonl: row 2: .*{message}"):
        load_pairs(path, PreferenceDataConfig())


def test_micro_batches_slice_every_field():
    prompts, responses = [[1, 2]] * 5, [[3], [3, 4], [5], [6, 7, 8], [9]]
    batch = PairBatch(
        collate(prompts, responses, 0), collate(prompts, responses[::-1], 0), torch.arange(5.0),
        ref_chosen=torch.arange(5.0) + 10, ref_rejected=None,
    )  # fmt: skip
    parts = batch.micro_batches(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.margin for p in parts]), batch.margin)
    assert torch.equal(torch.cat([p.ref_chosen for p in parts]), batch.ref_chosen)
    assert all(p.ref_rejected is None for p in parts)
    assert torch.equal(torch.cat([p.rejected.input_ids for p in parts]), batch.rejected.input_ids)


def test_select_and_to_reach_both_token_batches():
    prompts, responses = [[1, 2]] * 3, [[3], [3, 4], [5]]
    batch = PairBatch(collate(prompts, responses, 0), collate(prompts, responses[::-1], 0), torch.arange(3.0))
    picked = batch.select(torch.tensor([2, 1]))
    assert picked.margin.tolist() == [2.0, 1.0] and picked.ref_chosen is None
    assert torch.equal(picked.rejected.input_ids, batch.rejected.input_ids[[2, 1]])
    moved = batch.to(torch.device("meta"))
    assert moved.chosen.input_ids.device.type == "meta" and moved.rejected.response_mask.device.type == "meta"
