"""The generated reference pages (config fields, commands and flags, metrics keys) match the code: a change to
a config field, a parser or metrics/keys.py without `python scripts/gen_docs.py` fails here."""

from __future__ import annotations

import importlib.util
import json
import re
import typing
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]


def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current() -> None:
    stale = gen_docs().stale()
    assert not stale, f"stale generated docs {stale}: run `python scripts/gen_docs.py` and commit the pages"


def test_a_changed_page_is_found_stale(tmp_path: Path) -> None:
    module = gen_docs()
    for path, make in module.PAGES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(make())
    assert module.stale(tmp_path) == []
    page = tmp_path / "docs/reference/config.md"
    page.write_text(page.read_text().replace("| `seed` | `int` | `0` |", "| `seed` | `int` | `1` |"))
    assert module.stale(tmp_path) == ["docs/reference/config.md"]


def test_every_config_field_is_on_the_page() -> None:
    from loopline.config import describe

    page = (ROOT / "docs/reference/config.md").read_text()
    for line in describe():
        key = line.split(" = ", 1)[0]
        # a list or a map of sections shows as name[] or name.<name>, its items' fields below it
        assert any(f"| `{key}{suffix}` |" in page for suffix in ("", "[]", ".<name>")), key


def test_the_env_api_page_is_generated_from_the_docstrings(tmp_path: Path) -> None:
    module = gen_docs()
    page = tmp_path / "docs/reference/envs.md"
    page.parent.mkdir(parents=True)
    page.write_text(module.envs_page())
    text = page.read_text()
    from loopline.envs.base import StepResult

    # what a user subclasses and calls is on it, with the code's own docstrings
    for name in ("Env", "StepResult", "ToolEnv", "Toolbox", "answer_match", "max_reward", "counts_correct"):
        assert f"### `{name}`" in text, name
    first = (StepResult.__doc__ or "").strip().splitlines()[0]
    assert first in text and "reward(prompt, completion, **row_fields)" in text
    # a docstring changed in the code and not on the page: the page is stale
    page.write_text(text.replace(first, first + " (edited)"))
    assert "docs/reference/envs.md" in module.stale(tmp_path)


def _item_model(annotation: object) -> type[BaseModel]:
    """The section class inside a list, dict or optional annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        try:
            return _item_model(arg)
        except LookupError:
            continue
    raise LookupError(annotation)


def _default_of(key: str) -> object:
    """The JSON value the dotted page key has in RunConfig() (an item of a list or map of sections, or a field of
    an unset optional section: the default a new item or a newly set section gets)."""
    from loopline.config import RunConfig

    obj: object = RunConfig()
    model: type[BaseModel] = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part == "<name>":
            continue
        name = part.removesuffix("[]")
        field = model.model_fields[name]
        if obj is not None:
            value = getattr(obj, name)
        elif field.default_factory is not None:
            value = field.default_factory()
        else:
            value = field.default
        last = i == len(parts) - 1 or (i == len(parts) - 2 and parts[-1] == "<name>")
        if last:
            return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        if part.endswith("[]") or parts[i + 1] == "<name>":
            obj = None  # the fields of an item: a new item's defaults
        else:
            obj = value if isinstance(value, BaseModel) else None
        model = _item_model(field.annotation)
    raise AssertionError(key)


def test_every_documented_default_is_the_one_a_run_gets() -> None:
    """Each default on the config page is RunConfig()'s value, field by field: a section composed into RunConfig
    with its own defaults (sft.optim.lr=2e-3, not OptimConfig's 3e-4) shows those, as `loopline config` does."""
    from pydantic import TypeAdapter

    dump = TypeAdapter(object).dump_python
    page = (ROOT / "docs/reference/config.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| `(?:[^`]*)` \| `((?:[^`]|``)*)` \|", page, re.MULTILINE)
    assert len(rows) == page.count("\n| `"), "a field row of the page was not read"
    wrong = []
    for key, shown in rows:
        if shown == "(required)":
            continue
        want = " ".join(json.dumps(dump(_default_of(key), mode="json")).split()).replace("|", "\\|")
        if shown != want:
            wrong.append(f"{key}: page {shown}, RunConfig() {want}")
    assert not wrong, "\n".join(wrong)
