"""Tool calling: plain Python functions as tools, calls parsed from model text, and `ToolEnv`.

- A tool is a function with annotated parameters and a docstring. `tool_schema` derives its JSON
  schema in the OpenAI function format from the signature (int/float/str/bool/list/dict, `X | None`,
  `list[X]`; a parameter without a default is required) and the docstring (first line = description,
  an `Args:` section = parameter descriptions).
- A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text (tags
  configurable); `arguments` may also be a JSON string, as OpenAI clients send it. Writing and parsing
  calls is rollout.tool_calls (the chat-completions server shares it); running them is here.
- Nothing a model writes can crash a run: a malformed call, an unknown tool, bad arguments, a tool
  that raises or runs past its timeout each become an error observation shown to the model, and are
  counted per kind (`ERROR_KINDS`) in the step's info.
- Built-in tools: `calculator` (arithmetic through an AST whitelist, never `eval`) and `python`
  (code run in the sandbox of envs.sandbox, answering with the tail of stdout and stderr).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loopline.data.datasets import PromptRow
from loopline.envs.base import MAX_REWARD, StepResult, Verifier
from loopline.envs.sandbox import SandboxConfig
from loopline.rollout.tool_calls import MalformedCall, ToolCall, ToolsConfig, parse_tool_calls

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "tool_raised", "timeout", "too_many_calls")


# ---------------------------------------------------------------------------------------------
# Schemas from signatures
# ---------------------------------------------------------------------------------------------

_JSON_TYPES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    """JSON schema of one annotation; raises TypeError naming `where` for unsupported ones."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        return _json_type(inner, where)
    raise TypeError(f"{where}: unsupported annotation {annotation!r} (use int/float/str/bool/list/dict)")


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style `Args:` section."""
    found: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and re.match(r"^[A-Z][a-z]+:$", stripped):
            in_args = False  # the next section (Returns:, Raises:)
        elif in_args and (m := re.match(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.+)$", stripped)):
            found[m.group(1)] = m.group(3)
    return found


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function-format schema of `fn`: name, description, JSON-schema parameters."""
    name = name or fn.__name__
    hints = typing.get_type_hints(fn)
    doc = inspect.getdoc(fn) or ""
    arg_docs = _arg_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool '{name}': *args/**kwargs cannot be described; name every parameter")
        if param.name not in hints:
            raise TypeError(f"tool '{name}': parameter '{param.name}' needs a type annotation")
        prop = _json_type(hints[param.name], f"tool '{name}' parameter '{param.name}'")
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            prop["default"] = param.default
        properties[param.name] = prop
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc.split("\n", 1)[0] if doc else "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a JSON-decoded value fits an annotation (an int is a float; a bool is not an int)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is list or origin is list:
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if annotation is dict or origin is dict:
        return isinstance(value, dict)
    return False


# ---------------------------------------------------------------------------------------------
# Tools and calls
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A callable the model may use, with its schema; build with `Tool.of(fn)`."""

    name: str
    fn: Callable[..., Any]  # sync (run in a thread) or async
    schema: dict[str, Any]
    hints: dict[str, Any]

    @classmethod
    def of(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        """Describe `fn` as a tool (raises TypeError if its signature cannot be described)."""
        schema = tool_schema(fn, name)
        return cls(schema["function"]["name"], fn, schema, typing.get_type_hints(fn))

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why these arguments do not fit the signature, or None when they do."""
        params = self.schema["function"]["parameters"]
        unknown = sorted(set(arguments) - set(params["properties"]))
        if unknown:
            return f"unexpected argument(s) {', '.join(unknown)}; takes {', '.join(params['properties']) or 'none'}"
        missing = [p for p in params["required"] if p not in arguments]
        if missing:
            return f"missing required argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            if not _matches(value, self.hints[key]):
                want = params["properties"][key].get("type", "?")
                return f"argument '{key}' must be {want}, got {type(value).__name__}"
        return None


@dataclass(frozen=True)
class ToolOutcome:
    """What running one call gave: the text shown to the model, and an error kind if it failed."""

    text: str
    error: str | None = None  # one of ERROR_KINDS, or None on success


class Toolbox:
    """A set of tools that runs parsed calls; every failure becomes an error outcome.

    tools: plain functions (sync, run in a thread, or async) with annotated parameters and a docstring, or
    `Tool`s; each is described by `tool_schema`. cfg: the call and result tags, calls per turn, result length
    and timeout (rollout.tool_calls.ToolsConfig).
    """

    def __init__(self, tools: list[Tool | Callable[..., Any]], cfg: ToolsConfig | None = None) -> None:
        self.cfg = cfg or ToolsConfig()
        self.tools: dict[str, Tool] = {}
        for t in tools:
            tool = t if isinstance(t, Tool) else Tool.of(t)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named '{tool.name}'")
            self.tools[tool.name] = tool

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, OpenAI `tools=[...]` format."""
        return [t.schema for t in self.tools.values()]

    async def run(self, call: ToolCall | MalformedCall) -> ToolOutcome:
        """Run one call; never raises for anything the model wrote or the tool did."""
        if isinstance(call, MalformedCall):
            return ToolOutcome(f"error: malformed tool call: {call.reason}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolOutcome(f"error: unknown tool '{call.name}'; available: {known}", "unknown_tool")
        problem = tool.check_arguments(call.arguments)
        if problem:
            return ToolOutcome(f"error: bad arguments for '{call.name}': {problem}", "bad_arguments")
        try:
            if inspect.iscoroutinefunction(tool.fn):
                pending = tool.fn(**call.arguments)
            else:
                pending = asyncio.to_thread(tool.fn, **call.arguments)
            # a sync tool that overruns keeps its thread until it returns; the episode moves on
            value = await asyncio.wait_for(pending, self.cfg.timeout_s)
        except TimeoutError:
            return ToolOutcome(
                f"error: tool '{call.name}' timed out after {self.cfg.timeout_s:g}s", "timeout"
            )
        except Exception as e:  # a tool's own failure is the model's information, not ours
            return ToolOutcome(f"error: {type(e).__name__}: {e}", "tool_raised")
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return ToolOutcome(_tail(text, self.cfg.max_result_chars))


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3) :]


def describe_tools(toolbox: Toolbox) -> str:
    """A system-prompt paragraph listing the tools' schemas and how to call them."""
    return tools_paragraph([s["function"] for s in toolbox.schemas()], toolbox.cfg)


def tools_paragraph(functions: list[dict[str, Any]], cfg: ToolsConfig) -> str:
    """The paragraph of describe_tools for function schemas ({name, description, parameters}) from anywhere (a
    library's tool definitions: envs.verifiers_env)."""
    lines = ["You can call these tools:"]
    lines += [json.dumps(f) for f in functions]
    lines.append(
        f'To call one, write {cfg.call_open}{{"name": <tool name>, "arguments": {{...}}}}{cfg.call_close}; '
        f"its result comes back as {cfg.result_open}...{cfg.result_close}."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Built-in tools
# ---------------------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil,
}  # fmt: skip
# Bounds that keep one expression cheap: 9**9**9 or a 10**6-digit product would stall the rollout.
MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096
MAX_EXPONENT = 1000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            too_big = (
                isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS
            )
            if abs(right) > MAX_EXPONENT or too_big:
                raise ValueError(
                    f"power too large (exponent above {MAX_EXPONENT} or result above {MAX_INT_BITS} bits)"
                )
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        value = _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
    else:
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result is too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, complex):
        raise ValueError("complex result")
    return value


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: + - * / // % **, parentheses, abs round min max sqrt floor ceil.

    Args:
        expression: The expression, e.g. "4821*377+90".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def python_tool(sandbox: SandboxConfig | None = None) -> Tool:
    """The `python` tool: runs code in the sandbox (one warm sandbox per process and config)."""
    # Imported here: code.py pulls in the judge program, which plain tool users do not need.
    from loopline.envs.code import sandbox_for

    config = sandbox or SandboxConfig()

    def python(code: str) -> str:
        """Run Python code in a sandbox and return the tail of its stdout (and stderr when it fails).

        Args:
            code: A complete Python program; print what you want to see.
        """
        result = sandbox_for(config).run(code)
        if result.timed_out:
            return f"timed out after {config.timeout_s:g}s\n{result.stdout}"
        if result.exit_code != 0:
            return f"{result.stdout}exit status {result.exit_code}\n{result.stderr}"
        return result.stdout

    return Tool.of(python)


# ---------------------------------------------------------------------------------------------
# The env
# ---------------------------------------------------------------------------------------------


class ToolEnv:
    """Tools plus a final-answer verifier as an Env: calls get results; a turn without a call is the answer.

    A turn with any call tag in it (well-formed or not) is a tool turn: its calls run, their results
    (or errors) are the observation, and it earns 0 (or `call_bonus`, see below); only a turn without
    calls is scored, by `verify(turn text, reference answer)`, and ends the episode.

    toolbox: the tools (`Toolbox([fn, ...])`). verify: `(text, answer) -> reward`, e.g. `answer_match`.
    instructions: text put before every prompt (e.g. `describe_tools(toolbox)`). call_bonus: a format reward,
    paid once per episode. Info per step: `tool_calls`, `tool_calls_ok`, `tool_error_<kind>` (ERROR_KINDS);
    on the answer `answered` and `correct` (the answer's full marks, 1.0). Subclass it to give tools the
    episode's row (reset, then the tool reads it: examples/unit_env.py).
    """

    def __init__(
        self, toolbox: Toolbox, verify: Verifier, instructions: str = "", call_bonus: float = 0.0
    ) -> None:
        self.toolbox = toolbox
        self.verify = verify
        self.instructions = instructions  # put before every prompt (e.g. describe_tools(toolbox))
        # A format reward: paid once per episode, on the first turn whose calls all ran without error.
        self.call_bonus = call_bonus
        self._answer: str | None = None
        self._bonus_paid = False

    async def reset(self, sample: PromptRow) -> str:
        """Start on `sample`; the observation is the instructions and the prompt."""
        self._answer = sample.answer
        self._bonus_paid = False
        return self.instructions + sample.prompt

    async def step(self, action: str) -> StepResult:
        """Run the action's tool calls (observation: their results), or score it as the final answer."""
        if self._answer is None:
            raise RuntimeError("step() before reset()")
        cfg = self.toolbox.cfg
        calls = parse_tool_calls(action, cfg)
        if not calls:
            reward = float(self.verify(action, self._answer))
            # correct: the answer's full marks (a call_bonus earlier in the episode does not make it so)
            return StepResult("", reward, True, {"answered": 1, "correct": float(reward >= MAX_REWARD)})
        info: dict[str, float | int | str] = {"tool_calls": len(calls), "tool_calls_ok": 0}
        parts = []
        for i, call in enumerate(calls):
            if i < cfg.max_calls_per_turn:
                outcome = await self.toolbox.run(call)
            else:
                outcome = ToolOutcome(
                    f"error: more than {cfg.max_calls_per_turn} calls in one turn", "too_many_calls"
                )
            if outcome.error is None:
                info["tool_calls_ok"] = int(info["tool_calls_ok"]) + 1
            else:
                key = f"tool_error_{outcome.error}"
                info[key] = int(info.get(key, 0)) + 1
            parts.append(cfg.result_open + outcome.text + cfg.result_close)
        reward = 0.0
        if self.call_bonus and not self._bonus_paid and info["tool_calls_ok"] == len(calls):
            reward, self._bonus_paid = self.call_bonus, True
        return StepResult("".join(parts), reward, False, info)
