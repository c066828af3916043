"""TokenBatch dtypes and collate's checks, pinned (the layout itself is in test_batches.py)."""

from __future__ import annotations

import pytest
import torch

from loopline.data.batches import TokenBatch, collate, split_rows


def test_collate_dtypes_and_widths():
    batch = collate([[7], [1, 2, 3]], [[4, 5], []], pad_id=9)
    assert batch.input_ids.dtype == torch.long and batch.attention_mask.dtype == torch.long
    assert batch.response_mask.dtype == torch.float32
    assert batch.input_ids.tolist() == [[9, 9, 7, 4, 5], [1, 2, 3, 9, 9]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert batch.prompt_len == 3 and len(batch) == 2


def test_collate_rejects_unpaired_lists():
    with pytest.raises(ValueError, match="^prompts and responses differ in length$"):
        collate([[1], [2]], [[3]], pad_id=0)


def test_split_rows_keeps_order_sizes_and_the_batch_type():
    batch = collate([[1]] * 5, [[2, 3]] * 3 + [[4]] * 2, pad_id=0)
    for size in (1, 2, 3, 5, 8):
        parts = split_rows(batch, size)
        assert [len(p) for p in parts] == [min(size, 5 - s) for s in range(0, 5, size)]
        assert all(type(p) is TokenBatch for p in parts)
        torch.testing.assert_close(torch.cat([p.input_ids for p in parts]), batch.input_ids)
        torch.testing.assert_close(torch.cat([p.response_mask for p in parts]), batch.response_mask)
