"""The prompt row every dataset yields: its own module, so the built-in task and the file readers both build
rows without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptRow:
    """One prompt with its reference answer; `completion` is the SFT target when known."""

    index: int  # position in its split: the stable id of the prompt
    prompt: str
    answer: str = ""
    completion: str = ""
    messages: tuple[dict[str, str], ...] = ()
    extra: tuple[
        tuple[str, str], ...
    ] = ()  # more fields of the file's row that the env reads (data.extra_fields)

    def get(self, name: str, default: str = "") -> str:
        """The row's extra field `name` (e.g. the code env's 'test'), or `default`."""
        return dict(self.extra).get(name, default)
