"""Prompt datasets: the built-in task, jsonl, parquet and Hugging Face datasets saved on disk."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopline.config import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRow:
    """One prompt with its reference answer; `completion` is the SFT target when known."""

    index: int  # position in its split: the stable id of the prompt
    prompt: str
    answer: str = ""
    completion: str = ""
    messages: tuple[dict[str, str], ...] = ()


class DataError(ValueError):
    """A dataset row or file is malformed; the message names the file and row."""


def _iter_raw(path: Path, source: str) -> Iterator[tuple[int, Any]]:
    """Yield (row number, raw row) from a file; row numbers are 1-based lines for jsonl."""
    if source == "jsonl":
        with path.open() as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    yield lineno, DataError(f"{path}: row {lineno}: not valid JSON ({e.msg})")
    elif source == "parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row
    elif source == "hf_disk":
        from datasets import load_from_disk

        ds = load_from_disk(str(path))
        if hasattr(ds, "keys"):  # a DatasetDict: take its only split, or 'train'
            keys = list(ds.keys())
            ds = ds["train"] if "train" in keys else ds[keys[0]]
        for i, row in enumerate(ds):
            yield i, row
    else:
        raise DataError(f"unknown data source {source!r}")


def _to_row(raw: Any, index: int, cfg: DataConfig, where: str, need_answer: bool) -> PromptRow:
    if isinstance(raw, DataError):
        raise raw
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object, got {type(raw).__name__}")
    messages = raw.get(cfg.messages_field)
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise DataError(
                f"{where}: field '{cfg.messages_field}' must be a list of {{role, content}} strings"
            )
        # a chat row may carry a reference answer too (RL on chat prompts): keep it
        answer = raw.get(cfg.answer_field, "")
        if not isinstance(answer, str | int | float):
            raise DataError(f"{where}: field '{cfg.answer_field}' must be a string or number")
        return PromptRow(index=index, prompt="", answer=str(answer), messages=tuple(messages))
    prompt = raw.get(cfg.prompt_field)
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: missing or empty string field '{cfg.prompt_field}'")
    answer = raw.get(cfg.answer_field, "")
    completion = raw.get(cfg.completion_field, "")
    if need_answer and not isinstance(answer, str | int | float):
        raise DataError(f"{where}: field '{cfg.answer_field}' must be a string or number")
    if need_answer and answer == "":
        raise DataError(f"{where}: missing field '{cfg.answer_field}'")
    if not isinstance(completion, str):
        raise DataError(f"{where}: field '{cfg.completion_field}' must be a string")
    return PromptRow(index=index, prompt=prompt, answer=str(answer), completion=completion)


def load_rows(path: str | Path, cfg: DataConfig, need_answer: bool = True) -> tuple[list[PromptRow], int]:
    """Read prompt rows from a file; returns (rows, number skipped). Bad rows raise DataError
    naming file and row, or are skipped and counted when cfg.skip_bad_rows is set."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset '{p}' does not exist")
    rows: list[PromptRow] = []
    skipped = 0
    for rownum, raw in _iter_raw(p, cfg.source):
        try:
            rows.append(_to_row(raw, len(rows), cfg, f"{p}: row {rownum}", need_answer))
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise DataError(f"{e} (set data.skip_bad_rows=true to skip such rows)") from None
            skipped += 1
            log.warning("skipping bad row: %s", e)
    if not rows:
        raise DataError(f"dataset '{p}' has no usable rows ({skipped} skipped)")
    return rows, skipped


def load_splits(
    cfg: DataConfig, seed: int, need_answer: bool = True
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Train and held-out rows for a run: the built-in task or files named in the config."""
    if cfg.source == "builtin":
        from loopline.data.tasks import arithmetic_splits

        return arithmetic_splits(cfg.task, seed)
    if not cfg.train_path:
        raise DataError(f"data.train_path is required when data.source is '{cfg.source}'")
    train, _ = load_rows(cfg.train_path, cfg, need_answer)
    held_out = load_rows(cfg.eval_path, cfg, need_answer)[0] if cfg.eval_path else []
    return train, held_out
