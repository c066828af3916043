"""The `env` section: which environment scores the RL loop's completions. Pydantic only (loading a config
imports no torch); the names resolve in envs.single_turn, on the env workers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from loopline.envs.sandbox.config import SandboxConfig
from loopline.section import Section

# name -> what it checks; the single-turn envs of envs.single_turn
BUILTIN_ENVS = {
    "addition": "the built-in task's verifier: the first line of the response equals the answer",
    "exact_match": "file datasets: the first line of the response equals the row's answer (spaces ignored)",
    "math": "the response's final answer (\\boxed{...}, 'answer is ...' or its last number) is mathematically "
    "equal to the row's answer (sympy)",
    "code": "HumanEval-form rows (prompt, entry_point, test): the completion's tests run in the sandbox on the env "
    "workers (env.code_reward: all, or the fraction of check()'s asserts passed)",
}
NOT_IN_THE_LOOP_YET = {
    "calculator": "the tool-using agent trains with `loopline agent`",
}
# The fields of a file's rows an env reads besides the prompt (and whether it reads the answer).
ROW_FIELDS = {"code": ("entry_point", "test")}
USER_ENV = re.compile(r"^python:(?P<module>[^:]+):(?P<factory>[A-Za-z_][A-Za-z0-9_]*)$")


class EnvConfig(Section):
    """The environment of the RL loop: one episode per completion, stepped on the env workers (runtime.env_workers:
    processes on the local backend, Ray actors in the env pool's bundles on ray), never in the controller."""

    name: str = Field(
        "addition",
        description="A built-in env ("
        + ", ".join(BUILTIN_ENVS)
        + ") or your own: python:MODULE:FACTORY, where "
        "MODULE is a dotted module name or a path to a .py file (stored absolute) and FACTORY() returns a fresh "
        "envs.base.Env (one per episode).",
    )

    code_reward: Literal["all", "fraction"] = Field(
        "all",
        description="env.name=code: 1 when every test passes (all), or the fraction passed, where each top-level "
        "statement of check() that holds an assert is one test (fraction). Accuracy counts full passes either way.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="env.name=code: the sandbox the tests run in (isolation, limits), as `loopline sandbox check`.",
    )

    fields: list[str] = Field(
        default_factory=list,
        description="More fields of a file's rows that your env reads (row.get(name)); every row must have them.",
    )

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The fields of a file's rows the env reads, besides prompt and answer (kept on PromptRow.extra)."""
        return tuple(dict.fromkeys([*ROW_FIELDS.get(self.name, ()), *self.fields]))

    @property
    def reads_answer(self) -> bool:
        """Whether the env scores against the row's answer (the code env runs the row's tests instead)."""
        return self.name != "code"

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name in BUILTIN_ENVS:
            return name
        user = USER_ENV.match(name)
        if user and user["module"].endswith(
            ".py"
        ):  # a file: absolute, so env workers (any cwd) and resumes find it
            return f"python:{Path(user['module']).resolve()}:{user['factory']}"
        if user:
            return name
        if name in NOT_IN_THE_LOOP_YET:
            raise ValueError(
                f"env '{name}' is not in the RL loop yet ({NOT_IN_THE_LOOP_YET[name]}); "
                f"built-in envs here: {', '.join(BUILTIN_ENVS)}"
            )
        raise ValueError(
            f"unknown env {name!r}: use one of {', '.join(BUILTIN_ENVS)}, or python:MODULE:FACTORY for your own"
        )
