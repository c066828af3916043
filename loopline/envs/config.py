"""The `env` section: which environment scores the RL loop's completions. Pydantic only (loading a config
imports no torch); the names resolve in envs.single_turn, on the env workers."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from loopline.section import Section

# name -> what it checks; the single-turn envs of envs.single_turn
BUILTIN_ENVS = {
    "addition": "the built-in task's verifier: the first line of the response equals the answer",
    "exact_match": "file datasets: the first line of the response equals the row's answer (spaces ignored)",
    "math": "the response's final answer (\\boxed{...}, 'answer is ...' or its last number) is mathematically "
    "equal to the row's answer (sympy)",
}
NOT_IN_THE_LOOP_YET = {
    "code": "sandboxed unit tests are scored by `loopline sandbox check`",
    "calculator": "the tool-using agent trains with `loopline agent`",
}
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
