"""Prompt datasets: the built-in task, jsonl, parquet and Hugging Face datasets saved on disk."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopline.data.config import DataConfig
from loopline.data.rows import PromptRow
from loopline.data.transcripts import first_user, transcript_problem
from loopline.errors import UserError


class DataError(UserError):
    """A dataset row or file is malformed; the message names the file and row."""


@dataclass(frozen=True)
class LengthLimits:
    """The longest rows a run takes, in tokens, and how to count a row's tokens."""

    count: Callable[[PromptRow], tuple[int, int]]  # row -> (prompt tokens, prompt + SFT target tokens)
    max_prompt_tokens: int
    max_seq_len: int
    overlong: str = "error"  # 'error' names file and row; 'skip' drops the row and counts it


# Why a row was skipped (the keys of the counts load_rows returns, and of the metrics' data_skipped_* fields).
SKIP_REASONS = {
    "encoding": "not valid UTF-8",
    "json": "not valid JSON",
    "fields": "malformed",
    "no_answer": "without an answer",
    "too_long": "too long",
}


class _BadRow(DataError):
    """A row that data.skip_bad_rows (or data.overlong=skip) may skip; `reason` is a key of SKIP_REASONS.
    `hint`: the fix when it is not skipping (a field named otherwise in the file: the setting that reads it)."""

    def __init__(self, message: str, reason: str = "fields", hint: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.hint = hint


# Names files give the prompt and the answer under, checked in this order when the configured field is missing:
# a row with one of them gets the setting that reads it as its hint, not data.skip_bad_rows (every row would go).
PROMPT_NAMES = ("question", "problem", "input", "instruction", "query", "text", "prompt")
ANSWER_NAMES = ("solution", "target", "output", "label", "ground_truth", "final_answer", "result", "answer")


def _field_hint(setting: str, names: tuple[str, ...], have: list[str] | dict[str, Any]) -> str:
    """'set data.prompt_field=question ...' when the row or table has a field that likely holds it, else ''."""
    found = next((n for n in names if n in have), "")
    return f"set {setting}={found} if that field holds it" if found else ""


def _columns_check(path: Path, columns: list[str], cfg: DataConfig, need_answer: bool) -> None:
    """A table whose columns cannot make prompt rows fails at once, listing the columns it has."""
    has = ", ".join(columns) or "none"
    if cfg.prompt_field not in columns and cfg.messages_field not in columns:
        hint = _field_hint("data.prompt_field", PROMPT_NAMES, columns)
        raise DataError(
            f"{path}: no column '{cfg.prompt_field}' (data.prompt_field) or '{cfg.messages_field}' "
            f"(data.messages_field); its columns: {has}" + (f" ({hint})" if hint else "")
        )
    if need_answer and cfg.answer_field not in columns:
        hint = _field_hint("data.answer_field", ANSWER_NAMES, columns)
        raise DataError(
            f"{path}: no column '{cfg.answer_field}' (data.answer_field); its columns: {has}"
            + (f" ({hint})" if hint else "")
        )


def _iter_raw(path: Path, cfg: DataConfig, need_answer: bool) -> Iterator[tuple[int, Any]]:
    """Yield (row number, raw row) from a file; row numbers are 1-based (lines for jsonl). A row that cannot
    be read (bad bytes, bad JSON) comes as a _BadRow in place of the row."""
    if cfg.source == "jsonl":
        with path.open("rb") as f:  # bytes, decoded per row: a bad byte names its row and can be skipped
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad = f"byte 0x{line[e.start]:02x} at column {e.start + 1}"
                    yield lineno, _BadRow(f"{path}: row {lineno}: not valid UTF-8 ({bad})", "encoding")
                    continue
                try:
                    yield lineno, json.loads(text)
                except json.JSONDecodeError as e:
                    yield lineno, _BadRow(f"{path}: row {lineno}: not valid JSON ({e.msg})", "json")
    elif cfg.source == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
        _columns_check(path, table.column_names, cfg, need_answer)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
    elif cfg.source == "hf_disk":
        from datasets import load_from_disk

        try:
            ds = load_from_disk(str(path))
        except Exception as e:  # FileNotFoundError and others for a directory that is no saved dataset
            raise DataError(
                f"{path}: not a dataset saved with save_to_disk ({type(e).__name__}: {e})"
            ) from None
        if hasattr(ds, "keys"):  # a DatasetDict: take its only split, or 'train'
            keys = list(ds.keys())
            ds = ds["train"] if "train" in keys else ds[keys[0]]
        _columns_check(path, list(ds.column_names), cfg, need_answer)
        for i, row in enumerate(ds, start=1):
            yield i, row
    else:
        raise DataError(f"unknown data source {cfg.source!r}")


def _extra(
    raw: dict[str, Any], fields: tuple[str, ...], where: str, has: str, optional: tuple[str, ...] = ()
) -> tuple[tuple[str, str], ...]:
    """The row's `fields` that the env reads, as strings (numbers converted, a list of strings as JSON text); each
    must be there. `optional` fields are read alike when the row has them (missing, null, "" or [] leave them out)."""
    extra = []
    present = [f for f in optional if raw.get(f) not in (None, "", [])]
    for name in (*fields, *present):
        value = raw.get(name)
        if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
            extra.append((name, json.dumps(value)))
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float) or str(value) == "":
            what = "missing" if value is None else "not a non-empty string (or list of strings)"
            raise _BadRow(f"{where}: field '{name}' is {what}; the env reads it {has}")
        extra.append((name, str(value)))
    return tuple(extra)


def _to_row(
    raw: Any,
    index: int,
    cfg: DataConfig,
    where: str,
    need_answer: bool,
    fields: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> PromptRow:
    if isinstance(raw, DataError):
        raise raw
    if not isinstance(raw, dict):
        raise _BadRow(f"{where}: expected an object, got {type(raw).__name__}")
    has = f"(the row has: {', '.join(map(str, raw)) or 'no fields'})"
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
            raise _BadRow(
                f"{where}: field '{cfg.messages_field}' must be a list of {{role, content}} strings"
            )
        # a chat row may carry a reference answer too (RL on chat prompts): keep it
        answer = raw.get(cfg.answer_field)
        answer = "" if answer is None else answer
        if not isinstance(answer, str | int | float):
            raise _BadRow(f"{where}: field '{cfg.answer_field}' must be a string or number")
        if need_answer and str(answer) == "":
            # RL scores against the answer: with "" any completion whose first line is blank would earn 1.0
            raise _BadRow(
                f"{where}: chat row without '{cfg.answer_field}', needed to score it in RL {has} "
                "(`loopline sft` trains on chat rows that end with an assistant message)",
                "no_answer",
            )
        # SFT alone (no answer needed) learns the assistant's messages, or the answer when there are none
        problem = transcript_problem(messages, need_assistant=not need_answer and str(answer) == "")
        if problem:
            raise _BadRow(f"{where}: field '{cfg.messages_field}': {problem}")
        extra = _extra(raw, fields, where, has, optional)
        # a transcript's prompt is its first user message: what an env's reset reads (sample.prompt)
        prompt = first_user(messages) if any(m["role"] == "assistant" for m in messages) else ""
        return PromptRow(
            index=index, prompt=prompt, answer=str(answer), messages=tuple(messages), extra=extra
        )
    prompt = raw.get(cfg.prompt_field)
    if not isinstance(prompt, str) or not prompt:
        hint = "" if cfg.prompt_field in raw else _field_hint("data.prompt_field", PROMPT_NAMES, raw)
        raise _BadRow(f"{where}: missing or empty string field '{cfg.prompt_field}' {has}", hint=hint)
    answer = raw.get(cfg.answer_field)
    answer = "" if answer is None else answer
    completion = raw.get(cfg.completion_field)
    completion = "" if completion is None else completion
    if need_answer and not isinstance(answer, str | int | float):
        raise _BadRow(f"{where}: field '{cfg.answer_field}' must be a string or number")
    if need_answer and str(answer) == "":
        hint = "" if cfg.answer_field in raw else _field_hint("data.answer_field", ANSWER_NAMES, raw)
        raise _BadRow(f"{where}: missing field '{cfg.answer_field}' {has}", "no_answer", hint)
    if not isinstance(completion, str):
        raise _BadRow(f"{where}: field '{cfg.completion_field}' must be a string")
    extra = _extra(raw, fields, where, has, optional)
    return PromptRow(index=index, prompt=prompt, answer=str(answer), completion=completion, extra=extra)


# No tokenizer in use makes tokens of this many characters on average: a row with more characters than this per
# token allowed is over its limit without being tokenized (a 10 MB line is refused at once, not fed to the model).
MAX_CHARS_PER_TOKEN = 64


def _over_limit(row: PromptRow, limits: LengthLimits) -> str:
    """Why `row` is over the limits ("" when it is not)."""
    prompt_chars = sum(len(m["content"]) for m in row.messages) if row.messages else len(row.prompt)
    seq_chars = prompt_chars + len(row.completion) + len(row.answer)
    if prompt_chars > MAX_CHARS_PER_TOKEN * limits.max_prompt_tokens:
        return (
            f"prompt of {prompt_chars} characters, far over data.max_prompt_tokens={limits.max_prompt_tokens}"
        )
    if seq_chars > MAX_CHARS_PER_TOKEN * limits.max_seq_len:
        return f"row of {seq_chars} characters, far over data.max_seq_len={limits.max_seq_len}"
    prompt_tokens, seq_tokens = limits.count(row)
    if prompt_tokens > limits.max_prompt_tokens:
        return f"prompt of {prompt_tokens} tokens > data.max_prompt_tokens={limits.max_prompt_tokens}"
    if seq_tokens > limits.max_seq_len:
        return f"prompt + completion of {seq_tokens} tokens > data.max_seq_len={limits.max_seq_len}"
    return ""


def load_rows(
    path: str | Path,
    cfg: DataConfig,
    need_answer: bool = True,
    limits: LengthLimits | None = None,
    fields: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> tuple[list[PromptRow], dict[str, int]]:
    """Read prompt rows from a file; returns (rows, skipped rows by reason, keys of SKIP_REASONS). `fields`: more
    fields every row must have, kept for the env (PromptRow.get); `optional`: kept when a row has them. Bad rows
    raise DataError naming file and row, or are skipped and counted when cfg.skip_bad_rows is set; rows
    over `limits` likewise, by limits.overlong. One summary line reports what was skipped."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset '{p}' does not exist")
    if cfg.source in ("jsonl", "parquet") and not p.is_file():
        raise DataError(f"dataset '{p}' is not a file (data.source={cfg.source} reads one file)")
    if cfg.source == "hf_disk" and not p.is_dir():
        raise DataError(
            f"dataset '{p}' is not a directory (data.source=hf_disk reads a save_to_disk directory)"
        )
    rows: list[PromptRow] = []
    skipped: Counter[str] = Counter()
    for rownum, raw in _iter_raw(p, cfg, need_answer):
        where = f"{p}: row {rownum}"
        try:
            row = _to_row(raw, len(rows), cfg, where, need_answer, fields, optional)
        except _BadRow as e:
            if not cfg.skip_bad_rows:
                raise DataError(
                    f"{e} ({e.hint or 'set data.skip_bad_rows=true to skip such rows'})"
                ) from None
            skipped[e.reason] += 1
            continue
        too_long = _over_limit(row, limits) if limits is not None else ""
        if too_long and limits is not None and limits.overlong == "error":
            raise DataError(f"{where}: {too_long} (data.overlong=skip skips such rows)")
        if too_long:
            skipped["too_long"] += 1
            continue
        rows.append(row)
    if skipped:
        reasons = ", ".join(f"{n} {SKIP_REASONS[k]}" for k, n in skipped.items())
        total = skipped.total()
        # one line for the file, on stderr whatever logging is set up (a warning per row drowned the run's output)
        print(
            f"loopline: warning: {p}: skipped {total} of {total + len(rows)} rows: {reasons}", file=sys.stderr
        )
    if not rows:
        raise DataError(f"dataset '{p}' has no usable rows ({skipped.total()} skipped)")
    return rows, dict(skipped)


def load_splits(
    cfg: DataConfig,
    seed: int,
    need_answer: bool = True,
    limits: LengthLimits | None = None,
    fields: tuple[str, ...] = (),
    answered: bool = True,
    optional: tuple[str, ...] = (),
) -> tuple[list[PromptRow], list[PromptRow], dict[str, int]]:
    """Train and held-out rows for a run (the built-in task or files named in the config), and the rows
    skipped in both by reason. need_answer: the training rows are scored (RL). Rows that are scored need what the
    env reads: the answer when `answered`, and `fields` (and keep `optional` ones); held-out rows are always scored."""
    if cfg.source == "builtin":
        from loopline.data.tasks import arithmetic_splits

        return (*arithmetic_splits(cfg.task, seed), {})
    if not cfg.train_path:
        raise DataError(f"data.train_path is required when data.source is '{cfg.source}'")
    train_fields, train_optional = (fields, optional) if need_answer else ((), ())
    train, skipped = load_rows(
        cfg.train_path, cfg, need_answer and answered, limits, train_fields, train_optional
    )
    held_out: list[PromptRow] = []
    if cfg.eval_path:
        held_out, eval_skipped = load_rows(cfg.eval_path, cfg, answered, limits, fields, optional)
        skipped = dict(Counter(skipped) + Counter(eval_skipped))
    return train, held_out, skipped
