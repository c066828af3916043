"""The env section's built-in tasks (data.source=builtin): the calculator (the agentic example) and one-line
functions (env.name=code, below).

The calculator: arithmetic too long to do in one's head, solved with the calculator tool.

    prompt:   What is 87*64+5?
    model:    <tool_call>{"name":"calculator","arguments":{"expression":"87*64+5"}}</tool_call>
    env:      <tool_result>5573</tool_result>
    model:    <answer>5573</answer>

Reward 1 when the text in <answer>...</answer> equals the value. SFT demonstrations are the tool
trace above, run through the real env (so the tool results are real, and masked in the loss).

The right answer needs two exact copies: the expression into the call, the result into the answer.
That is the hard part for the built-in tiny model, and why the default problems have fixed lengths
(the copies then sit at fixed distances). Measured on 2 cores, batch 32, lr 1e-3: the copied digits
stay at chance for ~250 SFT steps, then are learned within ~100 more (at lr 3e-3 they were still
at chance after 200-300 steps).

Two options, off by default: `direct_fraction` mixes in demonstrations that answer without the tool
(almost always wrong), so that RL has a tool-use habit to learn; it also slows the copies down (at
0.25, 500 steps were not enough). `call_bonus` is a format reward, once per episode, for a turn
whose tool calls all ran: with it, RL raises tool use even while answers are still wrong.
"""

from __future__ import annotations

import functools
import json
import operator
import random
import re

from loopline.data.datasets import PromptRow
from loopline.envs.config import CalculatorConfig, CodeTaskConfig, EnvConfig
from loopline.envs.tools import Toolbox, ToolEnv, ToolsConfig, calculator

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _calculator_problems(cfg: CalculatorConfig, seed: int) -> list[PromptRow]:
    """Train, held-out and validation problems in one stream of distinct expressions, in that order."""
    rng = random.Random(f"calculator-{seed}")
    seen: set[str] = set()
    rows: list[PromptRow] = []
    while len(rows) < cfg.num_train + cfg.num_eval + cfg.num_val:
        a, b = rng.randint(cfg.min_operand, cfg.max_operand), rng.randint(cfg.min_operand, cfg.max_operand)
        expression = f"{a}*{b}+{rng.randint(0, cfg.max_addend)}"
        if expression in seen:
            continue
        seen.add(expression)
        value = calculator(expression)
        rows.append(PromptRow(len(rows), f"What is {expression}?\n", value, completion=expression))
    return rows


def _renumbered(rows: list[PromptRow]) -> list[PromptRow]:
    return [PromptRow(i, r.prompt, r.answer, r.completion, extra=r.extra) for i, r in enumerate(rows)]


def _split(rows: list[PromptRow], num_train: int, num_eval: int) -> tuple[list[PromptRow], list[PromptRow]]:
    return rows[:num_train], _renumbered(rows[num_train : num_train + num_eval])


def calculator_splits(cfg: CalculatorConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Disjoint train and held-out problems 'What is a*b+c?' (answer the value, completion the expression)."""
    return _split(_calculator_problems(cfg, seed), cfg.num_train, cfg.num_eval)


def calculator_validation(cfg: CalculatorConfig, seed: int) -> list[PromptRow]:
    """num_val problems disjoint from both splits, for SFT's stopping rule (the held-out split stays unread)."""
    return _renumbered(_calculator_problems(cfg, seed)[cfg.num_train + cfg.num_eval :])


def answer_match(text: str, answer: str) -> float:
    """1.0 if the text's first <answer>...</answer> equals the reference (surrounding spaces ignored), else 0.0:
    the verifier of ToolEnv's final answer (a `Verifier`, (text, answer) -> reward)."""
    found = ANSWER.search(text)
    return 1.0 if found is not None and found.group(1).strip() == answer.strip() else 0.0


def make_env(tools: ToolsConfig | None = None, call_bonus: float = 0.0) -> ToolEnv:
    """One episode's env: the calculator tool and the <answer> verifier (reward 1 when right)."""
    return ToolEnv(Toolbox([calculator], tools), answer_match, call_bonus=call_bonus)


def calculator_env(env: EnvConfig) -> functools.partial[ToolEnv]:
    """env.name=calculator's factory (its spec in envs.config.ENVS): one make_env per episode."""
    return functools.partial(make_env, None, env.calculator.call_bonus)


def calculator_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    """env.name=calculator with data.source=builtin: its own problems (train, held-out, validation)."""
    return (*calculator_splits(env.calculator, seed), calculator_validation(env.calculator, seed))


def calculator_demonstration(env: EnvConfig, row: PromptRow, rng: random.Random) -> list[str]:
    """Multi-turn SFT's actions for `row`: the tool call then the answer, or, for env.calculator.direct_fraction of
    rows, the answer alone."""
    return demonstration(row, use_tool=rng.random() >= env.calculator.direct_fraction)


def code_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    """env.name=code with data.source=builtin: the code task's one-line functions (train, held-out, validation)."""
    return (*code_splits(env.code_task, seed), code_validation(env.code_task, seed))


def tool_call_text(name: str, arguments: dict[str, object], tools: ToolsConfig | None = None) -> str:
    """A tool call as the model should write it (compact JSON between the call tags)."""
    tools = tools or ToolsConfig()
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return tools.call_open + body + tools.call_close


def demonstration(row: PromptRow, use_tool: bool, tools: ToolsConfig | None = None) -> list[str]:
    """The action texts of one SFT demonstration: call then answer, or the answer directly."""
    answer = f"<answer>{row.answer}</answer>"
    if not use_tool:
        return [answer]
    return [tool_call_text("calculator", {"expression": row.completion}, tools), answer]


# ---------------------------------------------------------------------------------------------------------
# The code task (env.name=code, data.source=builtin): one-line functions from steps in words
#
#     def f(x):
#         """Start with x, add four, multiply by three, then subtract two.
#         >>> f(5)
#         25
#         """
#     ----- the completion, run against check(f) in the sandbox:
#         return (x + 4) * 3 - 2
# ---------------------------------------------------------------------------------------------------------

# step -> (its words, its operator, what it does); the constant follows the words, spelled out: written as
# digits, the tiny model learned every operator and parenthesis but not the constants in 600 SFT steps
STEPS = {
    "add": ("add", "+", operator.add),
    "sub": ("subtract", "-", operator.sub),
    "mul": ("multiply by", "*", operator.mul),
    "div": ("floor-divide by", "//", operator.floordiv),
    "mod": ("take mod", "%", operator.mod),
}
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def function_source(steps: list[tuple[str, int]]) -> str:
    """The expression of x the steps describe, in order, with the parentheses Python's precedence needs: a sum
    or difference is wrapped before a *, // or % applies to it (left to right, nothing else needs them)."""
    expression, additive = "x", False
    for kind, constant in steps:
        symbol = STEPS[kind][1]
        if symbol not in "+-" and additive:
            expression, additive = f"({expression})", False
        expression = f"{expression} {symbol} {constant}"
        additive = additive or symbol in "+-"
    return expression


def _apply(steps: list[tuple[str, int]], x: int) -> int:
    for kind, constant in steps:
        x = STEPS[kind][2](x, constant)
    return x


def _describe(steps: list[tuple[str, int]]) -> str:
    words = [f"{STEPS[kind][0]} {NUMBERS[constant]}" for kind, constant in steps]
    if len(words) > 1:
        words[-1] = "then " + words[-1]
    return "Start with x, " + ", ".join(words) + "."


def _code_problems(cfg: CodeTaskConfig, seed: int) -> list[PromptRow]:
    """Train, held-out and validation problems in one stream of distinct step lists, in that order."""
    rng = random.Random(f"code-{seed}")
    seen: set[str] = set()
    rows: list[PromptRow] = []
    while len(rows) < cfg.num_train + cfg.num_eval + cfg.num_val:
        count = rng.randint(cfg.min_steps, cfg.max_steps)
        steps = [(rng.choice(list(STEPS)), rng.randint(2, cfg.max_constant)) for _ in range(count)]
        expression = function_source(steps)
        if expression in seen:
            continue
        seen.add(expression)
        example = rng.randint(0, 9)
        prompt = f'def f(x):\n    """{_describe(steps)}\n    >>> f({example})\n    {_apply(steps, example)}\n    """\n'
        inputs = rng.sample(range(-20, 41), cfg.num_tests)
        test = "def check(candidate):\n" + "".join(
            f"    assert candidate({v}) == {_apply(steps, v)}\n" for v in inputs
        )
        extra = (("entry_point", "f"), ("test", test))
        rows.append(PromptRow(len(rows), prompt, completion=f"    return {expression}\n", extra=extra))
    return rows


def code_splits(cfg: CodeTaskConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Disjoint train and held-out problems (HumanEval form: the prompt, entry_point f, test; completion the
    one-line body)."""
    return _split(_code_problems(cfg, seed), cfg.num_train, cfg.num_eval)


def code_validation(cfg: CodeTaskConfig, seed: int) -> list[PromptRow]:
    """num_val problems disjoint from both splits, for SFT's stopping rule (the held-out split stays unread)."""
    return _renumbered(_code_problems(cfg, seed)[cfg.num_train + cfg.num_eval :])
