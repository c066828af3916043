"""The leaf of the config convention: the `Section` base every config section builds on, `ConfigError`,
and the loader's helpers that need no RunConfig (YAML file + dotted `a.b.c=value` overrides into one tree).

Imports nothing from loopline but errors.UserError, so that a section can live beside the code that
reads it in any room (tests/test_layering.py checks this); loopline.config composes them into RunConfig.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from loopline.errors import UserError


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(UserError):
    """A config file or override is wrong; the message names the key and what is accepted."""


def _section_at(root: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section class that `loc` (a dotted key's parts) points into, or None past a leaf."""
    node = root
    for part in loc:
        field = node.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        node = annotation
    return node


def flat_values(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every leaf of a nested dict (a config's model_dump)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_values(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def leaf_keys(root: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted leaf key of a section class (e.g. 'grpo.sampling.max_new_tokens')."""
    keys = []
    for name, field in root.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(leaf_keys(annotation, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
    return keys


def nearest_keys(root: type[BaseModel], key: str) -> list[str]:
    """Valid keys a misspelt or misplaced dotted `key` likely meant: its section's fields spelt alike
    (grpo.stepz: grpo.steps), else keys of the same first section ending in the same name
    (grpo.max_new_tokens: grpo.sampling.max_new_tokens), else dotted keys spelt alike."""
    parts = key.split(".")
    section = _section_at(root, tuple(parts[:-1]))
    if section is not None:
        prefix = ".".join(parts[:-1]) + "." if len(parts) > 1 else ""
        close = difflib.get_close_matches(parts[-1], list(section.model_fields), n=3, cutoff=0.7)
        if close:
            return [prefix + c for c in close]
    leaves = leaf_keys(root)
    same_name = [k for k in leaves if k.endswith("." + parts[-1]) and k.split(".")[0] == parts[0]]
    if same_name:
        return same_name[:3]
    return difflib.get_close_matches(key, leaves, n=3, cutoff=0.8)


def format_validation_error(
    err: ValidationError, root: type[BaseModel] | None = None, given: set[str] | frozenset[str] = frozenset()
) -> str:
    """A pydantic error as one line per bad key ('unknown config key ...', 'config key ...: why'),
    so that every command built on a config Section reports bad input alike. root: the section class
    validated, to name the nearest valid key of a misspelt one and the field a check across fields names;
    given: the dotted keys the user set (a file's, the overrides'), named first among those."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        if e["type"] == "extra_forbidden":
            near = nearest_keys(root, key) if root is not None else []
            maybe = f": did you mean {' or '.join(near)}?" if near else ""
            lines.append(f"unknown config key '{key}'{maybe}")
        elif e["type"] == "list_type":
            # a bare word for a list: show the list syntax with the word in it
            word = got if isinstance(got, str | int | float) and not isinstance(got, bool) else "a"
            lines.append(
                f"config key '{key}': {e['msg']} (got {got!r}): write a list as {key}=[{word}] or {key}=[{word},b]"
            )
        elif isinstance(got, dict):
            # a section's own check across its fields: its input is the whole section, its message names the
            # fields; the error is put on the field it names (the one the user set, if any), not on the section
            error = (e.get("ctx") or {}).get("error")
            why = str(error) if isinstance(error, ValueError) else e["msg"]
            key = (_named_field(root, e["loc"], why, given) if root is not None else None) or key
            lines.append(f"config key '{key}': {why}" if key else why)
        else:
            lines.append(f"config key '{key or '<root>'}': {e['msg']} (got {got!r})")
    return "\n".join(lines)


def mark_given(model: BaseModel, tree: dict[str, Any]) -> None:
    """Make each section's `model_fields_set` the keys `tree` gives it (recursively), so that a config validated
    from the defaults merged with the user's YAML and overrides still knows which fields the user set: what
    `memory=auto`-style choices must never change. In place."""
    given = {k for k in tree if k in type(model).model_fields}
    object.__setattr__(model, "__pydantic_fields_set__", given)
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            sub = tree.get(name)
            mark_given(value, sub if isinstance(sub, dict) else {})


def given_tree(model: BaseModel) -> dict[str, Any]:
    """The fields of `model` set by its input (model_fields_set), as a nested dict of the values (mark_given's
    inverse): a base config's own settings, to keep them set under new overrides."""
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            sub = given_tree(value)
            if sub or name in model.model_fields_set:
                out[name] = sub
        elif name in model.model_fields_set:
            out[name] = value
    return out


def given_keys(model: BaseModel) -> set[str]:
    """The dotted keys of every leaf field set by the config's input (YAML, overrides), whatever its value."""
    return set(flat_values(given_tree(model)))


def _named_field(
    root: type[BaseModel], loc: tuple[Any, ...], message: str, given: set[str] | frozenset[str]
) -> str | None:
    """The dotted key of the first field a section check's `message` names (relative to the section at `loc`, or
    from the root), preferring one in `given`; None when it names none (or `loc` is inside a list or map)."""
    if any(not isinstance(part, str) for part in loc) or _section_at(root, tuple(loc)) is None:
        return None
    leaves, prefix = set(leaf_keys(root)), "".join(f"{part}." for part in loc)
    named = []
    for word in re.findall(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*", message):
        for candidate in (prefix + word, word):
            if candidate in leaves and candidate not in named:
                named.append(candidate)
                break
    return next((k for k in named if k in given), named[0] if named else None)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ["a.b=1", "c=x"] into a nested dict; values are parsed as YAML scalars/lists."""
    tree: dict[str, Any] = {}
    for i, item in enumerate(overrides):
        if "=" not in item:
            after = overrides[i + 1] if i + 1 < len(overrides) else ""
            if after and "=" not in after:  # `grpo.steps 4`: a space for the '='
                raise ConfigError(f"override '{item}' looks like a setting: write {item}={after}")
            raise ConfigError(f"override '{item}' must look like key.path=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override '{item}' has an empty key")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw != "" else "")
    return tree


def merge_trees(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, section by section (a nested dict in `extra` keeps base's other keys)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_trees(out[k], v)
        else:
            out[k] = v
    return out


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message on one line: what is wrong and where (its own spans several, with the line quoted)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def read_tree(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The optional YAML file at `path` as a nested dict, updated by the dotted overrides; ConfigError if bad."""
    tree: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file '{p}' is not text (UTF-8): byte {e.start} is {e.object[e.start]:#x}"
            ) from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{p}' is not valid YAML: {_yaml_problem(e)}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
        tree = loaded
    return merge_trees(tree, parse_overrides(overrides or []))


@dataclass(frozen=True)
class LocalPath:
    """Marks a config field whose value names a file or directory on the machine that reads the config
    (`Annotated[str, LocalPath("model directory")]`), so that tools that move a run elsewhere (`loopline k8s
    render`, `loopline k8s stage`) find every such field from the models instead of from a list of names.

    what: what the path holds, for messages. inside: a regex whose group `path` is the path when the value holds
    more than a path (env.name's python:FILE.py:FACTORY); a value it does not match names no file.
    """

    what: str
    inside: str = ""

    def find(self, value: str) -> tuple[int, int] | None:
        """The (start, end) of the path within `value`, or None when the value names no file (empty, a URL,
        or not matching `inside`)."""
        if not value or "://" in value:
            return None
        if not self.inside:
            return 0, len(value)
        match = re.match(self.inside, value)
        return match.span("path") if match else None
