"""A seeded, resumable sampler over dataset indices, exact across epoch boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleRef:
    """Where a drawn prompt came from: its index and the epoch it was drawn in."""

    index: int
    epoch: int


class Sampler:
    """Draws batches of prompt indices: a fresh permutation per epoch, derived from (seed, epoch).

    State is just (epoch, position): a sampler restored from state_dict() draws exactly what the
    original would have drawn next.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size <= 0:
            raise ValueError("cannot sample from an empty dataset")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_batch(self, n: int) -> list[SampleRef]:
        """The next n prompts; a batch that crosses an epoch boundary continues into the next epoch."""
        out: list[SampleRef] = []
        while len(out) < n:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), self.size - self.position)
            out.extend(SampleRef(i, self.epoch) for i in self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != self.size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for a dataset of {state['size']} rows with seed {state['seed']}, "
                f"this one has {self.size} rows with seed {self.seed}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
