"""Property-based tests (Hypothesis) of the resumable sampler: a resume at any point equals an unbroken run."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from loopline.data.sampler import Sampler

SETTINGS = settings(max_examples=50, deadline=None)
BATCHES = st.lists(st.integers(1, 23), min_size=1, max_size=8)


@SETTINGS
@given(
    size=st.integers(1, 17),
    seed=st.integers(0, 2**20),
    shuffle=st.booleans(),
    before=BATCHES,
    after=BATCHES,
)
def test_resume_anywhere_equals_the_unbroken_run(size, seed, shuffle, before, after):
    unbroken = Sampler(size, seed, shuffle)
    expected = [unbroken.next_batch(n) for n in before + after]

    first = Sampler(size, seed, shuffle)
    got = [first.next_batch(n) for n in before]
    state = dict(first.state_dict())  # as a checkpoint stores it
    resumed = Sampler(size, seed, shuffle)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(n) for n in after]

    assert got == expected
    assert resumed.state_dict() == unbroken.state_dict()


@SETTINGS
@given(size=st.integers(1, 17), seed=st.integers(0, 2**20), batches=BATCHES)
def test_every_epoch_draws_each_index_once(size, seed, batches):
    sampler = Sampler(size, seed)
    drawn = [ref for n in batches for ref in sampler.next_batch(n)]
    assert [len(b) for b in [drawn]] == [sum(batches)]
    per_epoch = Counter(ref.epoch for ref in drawn)
    epochs = sorted(per_epoch)
    assert epochs == list(range(len(epochs)))  # epochs in order, none skipped
    for epoch in epochs:
        indices = [ref.index for ref in drawn if ref.epoch == epoch]
        assert len(set(indices)) == len(indices)  # no index twice in an epoch
        if epoch < epochs[-1]:
            assert sorted(indices) == list(range(size))  # a finished epoch drew every index
    # epochs advance only at the end of the data: the position counts the draws of the current epoch
    assert sampler.state_dict()["position"] == per_epoch[epochs[-1]]
    assert sampler.state_dict()["epoch"] == epochs[-1]
