"""The `env` section: which environment scores the RL loop's completions, in one turn or over several. Pydantic
only (loading a config imports no torch); the names resolve in envs.episodes, on the env workers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from loopline.envs.sandbox.config import SandboxConfig
from loopline.section import LocalPath, Section


@dataclass(frozen=True)
class EnvSpec:
    """A built-in env, declared once: everything the config, the data loading, the memory plan and the loops need
    to know of it. Code is named as "module:function", imported only where it runs (loading a config imports no
    torch): a new built-in env is a spec here and its code in envs/."""

    about: str  # what it checks, for env.name's description
    factory: str  # function(env: EnvConfig) -> EnvFactory (a fresh Env per episode), on the env workers
    builtin_rows: str | None = (
        None  # data.source=builtin: function(env, seed) -> (train, eval, val) of its own task
    )
    row_fields: tuple[str, ...] = ()  # the fields of a file's rows it reads besides prompt and answer
    format_row_fields: dict[str, tuple[str, ...]] = field(default_factory=dict)  # by env.code_format, instead
    optional_row_fields: dict[str, tuple[str, ...]] = field(
        default_factory=dict
    )  # by env.code_format, if present
    reads_answer: bool = True  # scores against the row's answer
    max_turns: int = 1  # model turns per episode unless env.max_turns says otherwise
    stop: tuple[str, ...] = ()  # strings that end a model turn (multi-turn)
    agent_program: bool = False  # episodes are runs of the user's program (env.command) against the endpoint
    demonstration: str | None = (
        None  # multi-turn SFT: function(env, row, rng) -> the actions that solve the row
    )
    sandboxed: bool = False  # runs programs in the code sandbox: env.sandbox.memory_mb per env worker
    long_builtin_prompts: bool = (
        False  # its built-in rows are not 'a+b=' short (the memory plan's length bound)
    )
    own_rows: bool = (
        False  # its rows are its own episodes (an OpenEnv env's reset seeds): data.source=builtin only
    )


_VERIFIER = "loopline.envs.episodes:verifier_env"
# name -> its spec; env.name=python:MODULE:FACTORY names an env of the user's instead
ENVS: dict[str, EnvSpec] = {
    "addition": EnvSpec(
        "the built-in task's verifier: the first line of the response equals the answer", _VERIFIER
    ),
    "exact_match": EnvSpec(
        "file datasets: the first line of the response equals the row's answer (spaces ignored)", _VERIFIER
    ),
    "math": EnvSpec(
        "the response's final answer (its last \\boxed{...}, else 'answer is ...', else its last number, "
        "fraction or root, taken whole) is mathematically equal to the row's answer (sympy; "
        "docs/guide/math-reward.md)",
        "loopline.envs.episodes:math_env",
    ),
    "code": EnvSpec(
        "HumanEval-form rows (prompt, entry_point, test): the completion's tests run in the sandbox on the env "
        "workers (env.code_reward: all, or the fraction of check()'s asserts passed); data.source=builtin: "
        "env.code_task's one-line functions",
        "loopline.envs.code:code_env",
        builtin_rows="loopline.envs.tasks:code_rows",
        row_fields=("entry_point", "test"),
        format_row_fields={"mbpp": ("test_list",)},
        optional_row_fields={"mbpp": ("test_imports", "test_setup_code")},  # what MBPP's asserts need
        reads_answer=False,  # runs the row's tests instead
        sandboxed=True,
        long_builtin_prompts=True,
    ),
    "calculator": EnvSpec(
        "the agentic task (multi-turn): the model calls the calculator tool, reads its result and writes "
        "<answer>...</answer>; reward 1 when the answer equals the row's (data.source=builtin: env.calculator's "
        "problems)",
        "loopline.envs.tasks:calculator_env",
        builtin_rows="loopline.envs.tasks:calculator_rows",
        demonstration="loopline.envs.tasks:calculator_demonstration",
        max_turns=3,
        stop=("</tool_call>", "</answer>"),
    ),
    "openai_agent": EnvSpec(
        "your agent program (env.command), written against the OpenAI API and unaware of loopline: each episode "
        "runs it on an env worker against loopline's OpenAI-compatible endpoint; every call it makes is recorded "
        "(tokens, log-probs) and trained on; reward 1 when the last line it prints equals the row's answer",
        _VERIFIER,  # never stepped: its episodes are runs of env.command (envs.episodes.run_agents)
        agent_program=True,
    ),
}
USER_ENV = re.compile(r"^python:(?P<module>[^:]+):(?P<factory>[A-Za-z_][A-Za-z0-9_]*)$")
# An env of a library users already have, through its adapter: LIBRARY:MODULE[:NAME] (envs/verifiers_env.py,
# envs/openenv_env.py); MODULE is a dotted module name or a .py file, as for python:
LIBRARY_ENV = re.compile(
    r"^(?P<library>verifiers|openenv):(?P<module>[^:]+)(?::(?P<name>[A-Za-z_][A-Za-z0-9_]*))?$"
)
# library -> its adapter, a spec like a built-in's (its factory parses env.name; its rows are the env's own)
LIBRARIES: dict[str, EnvSpec] = {
    "verifiers": EnvSpec(
        "an environment of the verifiers library (pip install 'loopline[envs]'): NAME (default load_environment) "
        "returns a vf.Environment; its dataset is the rows, its rubric the reward, its env_response the "
        "observations (docs/guide/environments.md)",
        "loopline.envs.verifiers_env:verifiers_env",
        builtin_rows="loopline.envs.verifiers_env:verifiers_rows",
        stop=("</tool_call>",),  # a model turn that calls a tool ends with its call (a ToolEnv's)
    ),
    "openenv": EnvSpec(
        "an OpenEnv environment class, in process (pip install 'loopline[envs]'): NAME (default: the module's one "
        "Environment subclass) makes a fresh one per episode, reset with a seed per row (env.openenv)",
        "loopline.envs.openenv_env:openenv_env",
        builtin_rows="loopline.envs.openenv_env:openenv_rows",
        reads_answer=False,  # its own observations' rewards
        own_rows=True,
    ),
}
# The file in python:FILE.py:FACTORY or LIBRARY:FILE.py[:NAME] (a dotted module name is imported from the installed
# packages instead)
ENV_FILE = r"^(?:python|verifiers|openenv):(?P<path>[^:]+\.py)(?::[A-Za-z_][A-Za-z0-9_]*)?$"


def _enough(task: CalculatorConfig | CodeTaskConfig, space: int, hint: str) -> None:
    """A generated task's splits must fit in half of its `space` distinct problems (drawing distinct ones from a
    nearly exhausted space would loop for ever)."""
    wanted = task.num_train + task.num_eval + task.num_val
    if wanted > space // 2:
        raise ValueError(
            f"num_train + num_eval + num_val ({wanted}) must be at most half of the {space} distinct problems; {hint}"
        )


class CalculatorConfig(Section):
    """The calculator task: a*b+c with a, b drawn from [min_operand, max_operand] and c from [0, max_addend].

    The default ranges keep every expression and every value the same length (32*32 > 999, 99*99+9 <
    10000): with fixed lengths, what the model copies (the expression into the call, the result into
    the answer) sits at a fixed distance, which is what a tiny model learns to copy quickly.
    """

    min_operand: int = Field(32, ge=0, description="Smallest a and b.")
    max_operand: int = Field(99, ge=0, description="Largest a and b.")
    max_addend: int = Field(9, ge=0, description="Largest c.")
    num_train: int = Field(4000, gt=0, description="Training problems generated.")
    num_eval: int = Field(
        128, gt=0, description="Held-out problems, disjoint from training (128: a 1-problem change is 0.8%)."
    )
    num_val: int = Field(
        128, ge=0, description="Validation problems, disjoint from both: sft.stop_at_accuracy reads them."
    )
    direct_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of SFT demonstrations that answer without calling the tool."
    )
    call_bonus: float = Field(
        0.0, ge=0.0, description="Format reward, once per episode, for a turn whose tool calls all succeed."
    )

    @model_validator(mode="after")
    def _enough_problems(self) -> CalculatorConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})")
        _enough(
            self,
            (self.max_operand - self.min_operand + 1) ** 2 * (self.max_addend + 1),
            "widen the operand ranges",
        )
        return self


class CodeTaskConfig(Section):
    """The built-in code task: complete `def f(x):` from a docstring that says, in words, which steps turn x into
    the result (e.g. "Start with x, add four, multiply by three, then subtract two.") and one example call. The
    solution is one line (`return (x + 4) * 3 - 2`): translate each step, and put parentheses where Python's
    precedence would otherwise reorder them. Each problem's check() asserts the result on `num_tests` inputs."""

    min_steps: int = Field(2, ge=1, description="Fewest steps in a problem.")
    max_steps: int = Field(
        3, ge=1, le=8, description="Most steps in a problem (8 keeps a problem under 300 characters)."
    )
    max_constant: int = Field(
        9,
        ge=2,
        le=9,
        description="Largest constant of a step (constants are 2..max_constant, written as words).",
    )
    num_tests: int = Field(5, ge=1, description="Inputs each problem's check() asserts.")
    num_train: int = Field(4000, gt=0, description="Training problems generated.")
    num_eval: int = Field(
        128, gt=0, description="Held-out problems, disjoint from training (128: a 1-problem change is 0.8%)."
    )
    num_val: int = Field(
        128, ge=0, description="Validation problems, disjoint from both: sft.stop_at_accuracy reads them."
    )

    @model_validator(mode="after")
    def _enough_problems(self) -> CodeTaskConfig:
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps ({self.min_steps}) must be <= max_steps ({self.max_steps})")
        kinds = 5 * (self.max_constant - 1)  # operations x constants per step
        _enough(
            self,
            sum(kinds**n for n in range(self.min_steps, self.max_steps + 1)),
            "raise max_steps or max_constant",
        )
        return self


class OpenEnvConfig(Section):
    """env.name=openenv:...: the episodes of an OpenEnv environment are its resets, one seed per row (its reset's
    observation is the prompt), so that a replayed episode is the same episode."""

    num_train: int = Field(1000, gt=0, description="Training episodes: seeds 0 .. num_train-1.")
    num_eval: int = Field(
        64,
        gt=0,
        description="Held-out episodes: seeds 1000000 .. 1000000+num_eval-1, disjoint from training.",
    )


class EnvConfig(Section):
    """The environment of the RL loop: one episode per completion, stepped on the env workers (runtime.env_workers:
    processes on the local backend, Ray actors in the env pool's bundles on ray), never in the controller."""

    name: Annotated[str, LocalPath("env file", inside=ENV_FILE)] = Field(
        "addition",
        description="A built-in env (" + ", ".join(ENVS) + ") or your own: python:MODULE:NAME, where "
        "MODULE is a dotted module name or a path to a .py file (stored absolute) and NAME is a factory (NAME() "
        "returns a fresh envs.base.Env, one per episode) or a reward function NAME(prompt, completion, "
        "**row_fields) -> float (a single-turn env; envs.reward_fn). loopline.api writes python:FILE.pkl:reward for "
        "a reward function it pickles by value (a lambda, a notebook's). Or an environment of a library: "
        "verifiers:MODULE[:NAME] (NAME defaults to load_environment) or openenv:MODULE[:NAME] (an Environment class), "
        "run through loopline's adapter (docs/guide/environments.md).",
    )

    code_reward: Literal["all", "fraction"] = Field(
        "all",
        description="env.name=code: 1 when every test passes (all), or the fraction passed, where each top-level "
        "statement of check() that holds an assert is one test (fraction). Accuracy counts full passes either way.",
    )
    code_format: Literal["humaneval", "mbpp"] = Field(
        "humaneval",
        description="env.name=code: the rows' form. humaneval: prompt (the function's start), entry_point, test "
        "(defines check(candidate)); the program is prompt + completion. mbpp: the prompt is the task in words "
        "(e.g. data.prompt_field=text, data.completion_field=code), test_list a list of assert lines that call the "
        "function by name (each one test), and when a row has them test_imports and test_setup_code, run before the "
        "asserts and before the completion, which is the program.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="env.name=code: the sandbox the tests run in (isolation, limits), as `loopline sandbox check`.",
    )

    fields: list[str] = Field(
        default_factory=list,
        description="More fields of a file's rows that your env reads (row.get(name)); every row must have them.",
    )

    max_turns: int | None = Field(
        None,
        ge=1,
        description="Model turns per episode at most; null: the env's own (calculator 3, others 1). 1: "
        "single-turn, the env ends the episode after the response; more: the multi-turn driver alternates model "
        "turns (grpo.sampling.max_new_tokens each) and env observations, and only the model's tokens are trained.",
    )
    max_episode_tokens: int = Field(
        256,
        gt=0,
        description="Multi-turn: response tokens per episode (model turns and observations) at most.",
    )
    returns: Literal["sum", "final"] = Field(
        "sum",
        description="Multi-turn: an episode's reward is the sum of its turns' rewards, or the last one.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Multi-turn: strings that end a model turn (kept in it), besides the sampling's stop "
        "(calculator: </tool_call> and </answer>).",
    )
    command: str = Field(
        "",
        description="env.name=openai_agent: the shell command of one episode. It gets OPENAI_BASE_URL and "
        "OPENAI_API_KEY (the episode's id: the openai client sends it, so the endpoint knows the episode) in its "
        "environment and the row as JSON ({index, prompt, answer}) on stdin, and prints its answer as the last "
        "line of stdout.",
    )
    agent_timeout_s: float = Field(
        120.0, gt=0, description="env.name=openai_agent: an episode running longer is killed (an error)."
    )
    calculator: CalculatorConfig = Field(
        default_factory=CalculatorConfig,
        description="env.name=calculator with data.source=builtin: the generated problems (and SFT's demonstrations).",
    )
    code_task: CodeTaskConfig = Field(
        default_factory=CodeTaskConfig,
        description="env.name=code with data.source=builtin: the generated problems (one-line functions).",
    )
    openenv: OpenEnvConfig = Field(
        default_factory=OpenEnvConfig,
        description="env.name=openenv:...: how many episodes (reset seeds) each split has.",
    )

    @property
    def spec(self) -> EnvSpec | None:
        """The built-in env's spec, or its library's adapter (LIBRARY:MODULE[:NAME]); None for python:MODULE:FACTORY."""
        library = LIBRARY_ENV.match(self.name)
        return LIBRARIES[library["library"]] if library else ENVS.get(self.name)

    @property
    def turns(self) -> int:
        """Model turns per episode at most: env.max_turns, or the env's own."""
        return self.max_turns or (self.spec.max_turns if self.spec else 1)

    @property
    def agent_program(self) -> bool:
        """Whether episodes are runs of the user's agent program (env.name=openai_agent), which calls the model."""
        return self.spec is not None and self.spec.agent_program

    @property
    def multi_turn(self) -> bool:
        """Whether an episode is a sequence of model turns and env observations: more than one turn through the
        multi-turn driver, or an agent program's calls."""
        return self.turns > 1 or self.agent_program

    @property
    def turn_stop(self) -> tuple[str, ...]:
        """The strings that end a model turn besides the sampling's: the env's own, then env.stop."""
        return tuple(dict.fromkeys([*(self.spec.stop if self.spec else ()), *self.stop]))

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The fields of a file's rows the env reads, besides prompt and answer (kept on PromptRow.extra)."""
        spec = self.spec
        own = spec.format_row_fields.get(self.code_format, spec.row_fields) if spec else ()
        return tuple(dict.fromkeys([*own, *self.fields]))

    @property
    def optional_row_fields(self) -> tuple[str, ...]:
        """The fields the env reads when a row has them."""
        return self.spec.optional_row_fields.get(self.code_format, ()) if self.spec else ()

    @property
    def has_builtin_rows(self) -> bool:
        """Whether data.source=builtin means the env's own task (else the built-in addition task)."""
        return self.spec is not None and self.spec.builtin_rows is not None

    @property
    def sandboxed(self) -> bool:
        """Whether the env runs programs in the code sandbox (env.sandbox.memory_mb per env worker)."""
        return self.spec is not None and self.spec.sandboxed

    @property
    def long_builtin_prompts(self) -> bool:
        """Whether the env's built-in rows are longer than the addition task's (the memory plan's bound)."""
        return self.spec is not None and self.spec.long_builtin_prompts

    @property
    def builtin_row_fields(self) -> tuple[str, ...]:
        """The fields the built-in rows carry (data.source=builtin): the env's own task's, or none."""
        spec = self.spec
        return spec.row_fields if spec and spec.builtin_rows else ()

    @property
    def own_rows(self) -> bool:
        """Whether the env's rows can only be its own (data.source=builtin): an OpenEnv env's episodes are seeds."""
        return self.spec is not None and self.spec.own_rows

    @property
    def reads_answer(self) -> bool:
        """Whether the env scores against the row's answer (the code env runs the row's tests instead)."""
        return self.spec is None or self.spec.reads_answer

    @model_validator(mode="after")
    def _agent_has_a_command(self) -> EnvConfig:
        if self.agent_program and not self.command.strip():
            raise ValueError(
                "env.name=openai_agent runs your agent program: set env.command (e.g. 'python agent.py')"
            )
        return self

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name in ENVS:
            return name
        user = USER_ENV.match(name) or LIBRARY_ENV.match(name)
        if user and user["module"].endswith(
            ".py"
        ):  # a file: absolute, so env workers (any cwd) and resumes find it
            start, end = user.span("module")
            return f"{name[:start]}{Path(user['module']).resolve()}{name[end:]}"
        if user:
            return name
        raise ValueError(
            f"unknown env {name!r}: use one of {', '.join(ENVS)}, python:MODULE:FACTORY for your own, or "
            "verifiers:MODULE[:NAME] / openenv:MODULE[:NAME] for an environment of those libraries"
        )
