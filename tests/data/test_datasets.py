"""Loading prompt datasets from jsonl, parquet and saved HF datasets; malformed rows name file and row."""

from __future__ import annotations

import json

import pytest

from loopline.config import DataConfig
from loopline.data.datasets import DataError, load_rows, load_splits

ROWS = [
    {"question": "1+1=", "solution": "2", "target": "2\n"},
    {"question": "2+3=", "solution": 5, "target": "5\n"},  # a numeric answer becomes text
    {"question": "what is 7?", "solution": "7", "extra": "ignored"},
]
MAPPING = dict(prompt_field="question", answer_field="solution", completion_field="target")


def _write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_rows(rows):
    assert [(r.index, r.prompt, r.answer, r.completion) for r in rows] == [
        (0, "1+1=", "2", "2\n"),
        (1, "2+3=", "5", "5\n"),
        (2, "what is 7?", "7", ""),
    ]


def test_jsonl_with_field_mapping(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS[:2])
    path.write_text(path.read_text() + "\n   \n" + json.dumps(ROWS[2]) + "\n")  # blank lines are skipped
    rows, skipped = load_rows(path, DataConfig(source="jsonl", **MAPPING))
    _check_rows(rows)
    assert skipped == {}


def test_parquet_with_field_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(r, solution=str(r["solution"]), target=r.get("target", "")) for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    loaded, _ = load_rows(tmp_path / "train.parquet", DataConfig(source="parquet", **MAPPING))
    _check_rows(loaded)


@pytest.mark.parametrize("as_dict", [False, True])
def test_hf_disk_with_field_mapping(tmp_path, as_dict):
    from datasets import Dataset, DatasetDict

    rows = [dict(r, solution=str(r["solution"]), target=r.get("target", "")) for r in ROWS]
    ds = Dataset.from_list(rows)
    (DatasetDict({"train": ds, "test": ds.select([0])}) if as_dict else ds).save_to_disk(tmp_path / "ds")
    loaded, _ = load_rows(tmp_path / "ds", DataConfig(source="hf_disk", **MAPPING))
    _check_rows(loaded)


def test_chat_rows_keep_messages_and_answer(tmp_path):
    chat = [
        {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "3+3="}], "answer": "6"},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", chat)
    # SFT: the assistant turn is the target, no answer needed
    rows, _ = load_rows(path, DataConfig(source="jsonl"), need_answer=False)
    # a row with an assistant message records an episode: its prompt is its first user message (envs read it)
    assert rows[0].messages == tuple(chat[0]["messages"]) and rows[0].prompt == "2+2="
    # the reference answer of a chat prompt is what RL scores against: it must not be dropped
    assert rows[1].answer == "6"
    # for RL a chat row without an answer is refused: "" would pay 1.0 for any blank first line
    with pytest.raises(DataError, match=f"{path}: row 1: chat row without 'answer'"):
        load_rows(path, DataConfig(source="jsonl"))


@pytest.mark.parametrize(
    "line,row,why",
    [
        ("{not json", 2, "not valid JSON"),
        (json.dumps({"question": "9+9="}), 2, "missing field 'solution'"),
        (json.dumps({"solution": "1"}), 2, "missing or empty string field 'question'"),
        (json.dumps({"question": "", "solution": "1"}), 2, "'question'"),
        (json.dumps({"question": "1+1=", "solution": ["2"]}), 2, "must be a string or number"),
        (json.dumps([1, 2]), 2, "expected an object"),
        (json.dumps({"messages": "hi"}), 2, "'messages' must be a list"),
        (json.dumps({"messages": []}), 2, "'messages' must be a list"),
    ],
)
def test_malformed_row_names_file_and_row(tmp_path, line, row, why):
    path = _write_jsonl(tmp_path / "bad.jsonl", ROWS[:1], raw_lines=[line, json.dumps(ROWS[1])])
    with pytest.raises(DataError) as err:
        load_rows(path, DataConfig(source="jsonl", **MAPPING))
    msg = str(err.value)
    assert f"{path}: row {row}" in msg  # jsonl rows are 1-based line numbers
    assert why in msg
    assert "skip_bad_rows" in msg  # and the way out


def test_skip_bad_rows_counts_them(tmp_path):
    bad = ["{not json", json.dumps({"question": "9+9="}), json.dumps({"solution": "1"})]
    path = _write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], raw_lines=bad + [json.dumps(ROWS[2])])
    rows, skipped = load_rows(path, DataConfig(source="jsonl", skip_bad_rows=True, **MAPPING))
    assert skipped == {"json": 1, "no_answer": 1, "fields": 1}  # by reason, for the summary line and metrics
    _check_rows(rows)  # indices stay dense over the kept rows


def test_answers_optional_when_not_needed(tmp_path):
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "hi", "completion": "there"}])
    rows, _ = load_rows(path, DataConfig(source="jsonl"), need_answer=False)
    assert rows[0].completion == "there" and rows[0].answer == ""
    with pytest.raises(DataError, match="missing field 'answer'"):
        load_rows(path, DataConfig(source="jsonl"))


def test_env_fields_are_kept_and_required_where_rows_are_scored(tmp_path):
    """The code env's rows (HumanEval form) carry entry_point and test and no answer: both are kept on the row,
    required in every scored row (RL's training rows, every held-out row), and a row without one is named."""
    good = {"prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    assert c() == 7\n"}
    train = _write_jsonl(tmp_path / "train.jsonl", [good, {**good, "canonical_solution": "    return 7\n"}])
    held_out = _write_jsonl(tmp_path / "eval.jsonl", [good, {"prompt": "def g():\n", "entry_point": "g"}])
    fields = ("entry_point", "test")
    cfg = DataConfig(source="jsonl", train_path=str(train), completion_field="canonical_solution")
    tr, _, _ = load_splits(cfg, seed=0, fields=fields, answered=False)
    assert [r.get("test") for r in tr] == [good["test"]] * 2 and tr[1].completion == "    return 7\n"
    assert tr[0].get("entry_point") == "f" and tr[0].get("nope", "-") == "-"
    with pytest.raises(DataError, match=r"eval.jsonl: row 2: field 'test' is missing; the env reads it"):
        load_splits(
            cfg.model_copy(update={"eval_path": str(held_out)}), seed=0, fields=fields, answered=False
        )
    # unscored training rows (SFT) need no env fields, held-out rows still do
    sft_cfg = cfg.model_copy(update={"train_path": str(held_out)})
    assert len(load_splits(sft_cfg, seed=0, need_answer=False, fields=fields, answered=False)[0]) == 2
    with pytest.raises(DataError, match=r"row 2: field 'test' is missing"):
        load_splits(sft_cfg, seed=0, fields=fields, answered=False)
    for bad in ([1], [], ["x", ""], {"a": "b"}):
        with pytest.raises(DataError, match=r"field 'test' is not a non-empty string \(or list of strings\)"):
            load_rows(
                _write_jsonl(tmp_path / "bad.jsonl", [{**good, "test": bad}]), cfg, False, fields=fields
            )
    # a list of strings (MBPP's test_list) is kept as JSON text
    listed = load_rows(
        _write_jsonl(tmp_path / "list.jsonl", [{**good, "test": ["a", "b"]}]), cfg, False, fields=fields
    )
    assert json.loads(listed[0][0].get("test")) == ["a", "b"]
    rows, skipped = load_rows(held_out, cfg.model_copy(update={"skip_bad_rows": True}), False, fields=fields)
    assert len(rows) == 1 and skipped == {"fields": 1}


def test_optional_env_fields_are_kept_when_a_row_has_them(tmp_path):
    """MBPP's test_imports and test_setup_code: read when there, left out when missing, null, "" or []; a value of
    the wrong kind is named like a required field's."""
    base = {"prompt": "Write f.", "test_list": ["assert f() == 1"]}
    rows = [
        {**base, "test_imports": ["import math"], "test_setup_code": "X = 1"},
        {**base, "test_imports": [], "test_setup_code": ""},
        {**base, "test_setup_code": None},
        base,
    ]
    cfg = DataConfig(source="jsonl")
    optional = ("test_imports", "test_setup_code")
    got, _ = load_rows(
        _write_jsonl(tmp_path / "m.jsonl", rows), cfg, False, fields=("test_list",), optional=optional
    )
    assert (
        json.loads(got[0].get("test_imports")) == ["import math"] and got[0].get("test_setup_code") == "X = 1"
    )
    assert [dict(r.extra).keys() == {"test_list"} for r in got[1:]] == [True, True, True]
    with pytest.raises(DataError, match=r"row 1: field 'test_imports' is not a non-empty string"):
        load_rows(
            _write_jsonl(tmp_path / "b.jsonl", [{**base, "test_imports": [1]}]), cfg, False, (), optional
        )


def test_empty_or_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl", DataConfig(source="jsonl"))
    path = _write_jsonl(tmp_path / "all_bad.jsonl", [], raw_lines=["{bad"])
    with pytest.raises(DataError, match=r"no usable rows \(1 skipped\)"):
        load_rows(path, DataConfig(source="jsonl", skip_bad_rows=True))


def test_load_splits_from_files(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    held_out = _write_jsonl(tmp_path / "eval.jsonl", ROWS[:1])
    cfg = DataConfig(source="jsonl", train_path=str(train), eval_path=str(held_out), **MAPPING)
    tr, ev, _ = load_splits(cfg, seed=0)
    assert len(tr) == 3 and [r.prompt for r in ev] == ["1+1="]
    assert load_splits(cfg.model_copy(update={"eval_path": ""}), seed=0)[1] == []
    with pytest.raises(DataError, match="data.train_path is required"):
        load_splits(DataConfig(source="jsonl"), seed=0)


def _with_bad_second_row(bad: dict) -> list[dict]:
    good = [dict(r, solution=str(r["solution"]), target=r.get("target", "")) for r in ROWS]
    good = [{k: r[k] for k in ("question", "solution", "target")} for r in good]  # one schema for every row
    return [good[0], {**good[1], **bad}, good[1], good[2]]


def _save(source: str, rows: list[dict], tmp_path):
    if source == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "bad.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        from datasets import Dataset

        path = tmp_path / "bad_ds"
        Dataset.from_list(rows).save_to_disk(path)
    return path


@pytest.mark.parametrize("source", ["parquet", "hf_disk"])
@pytest.mark.parametrize(
    "bad,why,reason",
    [
        ({"question": None}, "missing or empty string field 'question'", "fields"),
        ({"question": ""}, "'question'", "fields"),
        ({"solution": None}, "'solution'", "no_answer"),
    ],
)
def test_malformed_parquet_and_hf_disk_rows_name_file_and_row(tmp_path, source, bad, why, reason):
    path = _save(source, _with_bad_second_row(bad), tmp_path)
    with pytest.raises(DataError) as err:
        load_rows(path, DataConfig(source=source, **MAPPING))
    msg = str(err.value)
    assert f"{path}: row 2" in msg  # 1-based, as jsonl lines are
    assert why in msg and "skip_bad_rows" in msg
    rows, skipped = load_rows(path, DataConfig(source=source, skip_bad_rows=True, **MAPPING))
    assert skipped == {reason: 1}
    _check_rows(rows)  # the other rows kept, indices dense over them


def test_a_field_named_otherwise_gets_the_setting_that_reads_it(tmp_path):
    """A file whose rows say 'question'/'solution': the hint is the field setting, not data.skip_bad_rows (which
    would skip every row and then find none)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    cfg = DataConfig(source="jsonl", train_path=str(path))
    with pytest.raises(DataError) as err:
        load_rows(path, cfg)
    assert "set data.prompt_field=question" in str(err.value) and "skip_bad_rows" not in str(err.value)
    with pytest.raises(DataError) as err:
        load_rows(path, cfg.model_copy(update={"prompt_field": "question"}))
    assert "set data.answer_field=solution" in str(err.value)
    rows, _ = load_rows(path, cfg.model_copy(update={"prompt_field": "question", "answer_field": "solution"}))
    assert (rows[0].prompt, rows[0].answer) == ("1+1=", "2")
    path.write_text(json.dumps({"prompt": "", "answer": "2"}) + "\n")  # there but empty: nothing to rename
    with pytest.raises(DataError, match="skip_bad_rows"):
        load_rows(path, cfg)


def test_a_column_named_otherwise_gets_the_setting_that_reads_it(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "1+1=", "answer": "2"}]), path)
    with pytest.raises(DataError, match="set data.prompt_field=problem"):
        load_rows(path, DataConfig(source="parquet", train_path=str(path)))
