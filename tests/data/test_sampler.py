"""Sampler: every epoch a permutation, and a restored sampler draws exactly what the original would."""

from __future__ import annotations

import pytest

from loopline.data.sampler import Sampler


def _draws(sampler: Sampler, sizes: list[int]) -> list[list[tuple[int, int]]]:
    return [[(r.index, r.epoch) for r in sampler.next_batch(n)] for n in sizes]


def test_each_epoch_is_a_permutation():
    s = Sampler(10, seed=3)
    refs = [r for n in (3, 4, 7, 5, 6, 5) for r in s.next_batch(n)]  # 30 draws, batches cross epochs
    assert [r.epoch for r in refs] == [0] * 10 + [1] * 10 + [2] * 10
    orders = [[r.index for r in refs if r.epoch == e] for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(10))
    assert len({tuple(o) for o in orders}) == 3  # reshuffled every epoch


def test_seed_decides_the_order():
    assert _draws(Sampler(50, seed=1), [50]) == _draws(Sampler(50, seed=1), [50])
    assert _draws(Sampler(50, seed=1), [50]) != _draws(Sampler(50, seed=2), [50])
    assert [i for i, _ in _draws(Sampler(5, seed=1, shuffle=False), [7])[0]] == [0, 1, 2, 3, 4, 0, 1]


@pytest.mark.parametrize(
    "before",
    [
        [3],  # mid-epoch
        [4, 6],  # exactly at the end of epoch 0: position == size
        [4, 6, 10],  # exactly at the end of epoch 1
        [7, 7],  # just past a boundary crossed inside a batch
    ],
)
def test_restored_sampler_continues_exactly(before):
    after = [4, 9, 3, 10, 8]  # crosses several more epoch boundaries
    uninterrupted = Sampler(10, seed=5)
    expected = _draws(uninterrupted, before + after)[len(before) :]

    original = Sampler(10, seed=5)
    _draws(original, before)
    state = dict(original.state_dict())  # as it goes through state.json
    restored = Sampler(10, seed=5)
    restored.load_state_dict(state)
    assert _draws(restored, after) == expected


def test_boundary_state_and_mismatch():
    s = Sampler(10, seed=5)
    s.next_batch(10)
    assert s.state_dict() == {"epoch": 0, "position": 10, "size": 10, "seed": 5}
    with pytest.raises(ValueError, match="dataset of 10 rows with seed 5"):
        Sampler(11, seed=5).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed 6"):
        Sampler(10, seed=6).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="empty"):
        Sampler(0, seed=0)
