"""TokenBatch layout: prompts left-padded, responses right-padded, responses start at one column."""

from __future__ import annotations

import torch

from loopline.data.batches import RolloutBatch, collate, split_rows


def test_collate_layout():
    batch = collate([[1, 10, 11], [1, 20]], [[30], [40, 41, 42]], pad_id=0)
    # P = 3 prompt columns (left-padded), C = 3 response columns (right-padded)
    assert batch.input_ids.tolist() == [[1, 10, 11, 30, 0, 0], [0, 1, 20, 40, 41, 42]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch.prompt_len == 3 and len(batch) == 2


def test_collate_empty_responses_keep_one_masked_column():
    batch = collate([[1, 5]], [[]], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 0]]
    assert batch.response_mask.tolist() == [[0.0]]
    assert batch.attention_mask.tolist() == [[1, 1, 0]]


def test_split_rows_slices_every_tensor_field():
    tokens = collate([[1, 2]] * 5, [[3]] * 5, pad_id=0)
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=None, ref_logprobs=torch.arange(5.0)[:, None], advantages=torch.arange(5.0),
        rewards=torch.arange(5.0) * 10,
    )  # fmt: skip
    parts = split_rows(batch, 2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert all(isinstance(p, RolloutBatch) and p.old_logprobs is None for p in parts)
    assert torch.cat([p.advantages for p in parts]).tolist() == [0, 1, 2, 3, 4]
    assert parts[2].rewards.tolist() == [40.0] and parts[2].ref_logprobs.tolist() == [[4.0]]


def test_select_and_to_keep_the_type_and_none_fields():
    tokens = collate([[1, 2], [3], [4, 5]], [[6], [7, 8], [9]], pad_id=0)
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=None, ref_logprobs=None, advantages=torch.tensor([0.5, -1.0, 2.0]),
        rewards=torch.tensor([1.0, 0.0, 1.0]),
    )  # fmt: skip
    picked = batch.select(torch.tensor([2, 0]))
    assert isinstance(picked, RolloutBatch) and picked.old_logprobs is None and picked.is_weights is None
    assert picked.input_ids.tolist() == [tokens.input_ids[2].tolist(), tokens.input_ids[0].tolist()]
    assert picked.advantages.tolist() == [2.0, 0.5] and picked.rewards.tolist() == [1.0, 1.0]
    moved = batch.to(torch.device("meta"))
    assert isinstance(moved, RolloutBatch) and moved.old_logprobs is None
    assert moved.advantages.device.type == "meta" and moved.input_ids.device.type == "meta"
