"""Tool calling: schemas from signatures, call parsing, every error kind as an observation, the
calculator's whitelist, the python tool in the real sandbox, and ToolEnv episodes."""

from __future__ import annotations

import asyncio
import time

import jsonschema
import pytest

from loopline.data.datasets import PromptRow
from loopline.envs.base import StepResult
from loopline.envs.sandbox import SandboxConfig
from loopline.envs.tools import (
    MalformedCall,
    Tool,
    Toolbox,
    ToolCall,
    ToolEnv,
    ToolsConfig,
    calculator,
    describe_tools,
    parse_tool_calls,
    python_tool,
    tool_schema,
)


def search(
    query: str, limit: int = 5, exact: bool = False, tags: list[str] | None = None, scale: float = 1.0
) -> str:
    """Search the notes.

    Args:
        query: Words to look for.
        limit: Most results returned.

    Returns:
        The matches, one per line.
    """
    return f"{query}:{limit}:{exact}:{tags}:{scale}"


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------ schemas


def test_schema_from_signature_and_docstring():
    schema = tool_schema(search)
    assert schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Words to look for."},
                    "limit": {"type": "integer", "description": "Most results returned.", "default": 5},
                    "exact": {"type": "boolean", "default": False},
                    "tags": {"type": "array", "items": {"type": "string"}, "default": None},
                    "scale": {"type": "number", "default": 1.0},
                },
                "required": ["query"],
            },
        },
    }
    jsonschema.Draft202012Validator.check_schema(schema["function"]["parameters"])
    jsonschema.validate({"query": "x", "limit": 2}, schema["function"]["parameters"])


def test_dict_parameters_and_a_renamed_tool():
    def f(options: dict, n: int) -> str:
        """Do f."""
        return ""

    schema = Tool.of(f, name="g").schema["function"]
    assert schema["name"] == "g"
    assert schema["parameters"]["properties"] == {"options": {"type": "object"}, "n": {"type": "integer"}}


@pytest.mark.parametrize(
    "source, message",
    [
        ("def f(x): pass", "needs a type annotation"),
        ("def f(*xs: int): pass", "name every parameter"),
        ("def f(x: set): pass", "unsupported annotation"),
    ],
)
def test_undescribable_signatures_fail_at_registration(source, message):
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(TypeError, match=message):
        Tool.of(namespace["f"])


def test_describe_tools_lists_schemas_and_the_call_format():
    text = describe_tools(Toolbox([calculator]))
    assert '"name": "calculator"' in text and "<tool_call>" in text and "<tool_result>" in text


# ------------------------------------------------------------------------------------ parsing


def test_parse_calls_in_order_with_string_arguments():
    cfg = ToolsConfig()
    text = (
        'think <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call><tool_call>{"name": "c"}</tool_call>'
    )
    assert parse_tool_calls(text, cfg) == [
        ToolCall("a", {"x": 1}),
        ToolCall("b", {"y": [2]}),
        ToolCall("c", {}),
    ]
    assert parse_tool_calls("no call here </tool_call>", cfg) == []


@pytest.mark.parametrize(
    "body, reason",
    [
        ("{not json}", "not valid JSON"),
        ('["calculator"]', "expected a JSON object"),
        ('{"arguments": {}}', "expected a JSON object"),
        ('{"name": "a", "arguments": [1]}', "arguments must be an object"),
        ('{"name": "a", "arguments": "{oops"}', "arguments string is not valid JSON"),
    ],
)
def test_malformed_calls_are_explained(body, reason):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", ToolsConfig())
    assert isinstance(call, MalformedCall) and reason in call.reason


def test_unterminated_call_and_custom_tags():
    (call,) = parse_tool_calls('<tool_call>{"name": "a"', ToolsConfig())
    assert isinstance(call, MalformedCall) and "no closing" in call.reason
    cfg = ToolsConfig(call_open="[[", call_close="]]")
    assert parse_tool_calls('x [[{"name": "a", "arguments": {}}]] y', cfg) == [ToolCall("a", {})]


# ------------------------------------------------------------------------------------ running


def boom(x: int) -> str:
    """Always fails."""
    raise RuntimeError(f"broken on {x}")


def slow(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "woke"


async def shout(text: str) -> str:
    """An async tool."""
    await asyncio.sleep(0)
    return text.upper()


def listing(n: int) -> list:
    """Returns data, not text."""
    return list(range(n))


def test_every_failure_is_an_error_outcome_of_its_kind():
    box = Toolbox([search, boom, slow, shout, listing], ToolsConfig(timeout_s=0.3, max_result_chars=20))
    cases = [
        (MalformedCall("{", "not valid JSON"), "malformed", "malformed tool call"),
        (ToolCall("nope", {}), "unknown_tool", "unknown tool 'nope'; available: search, boom"),
        (ToolCall("search", {}), "bad_arguments", "missing required argument(s) query"),
        (ToolCall("search", {"query": "q", "limt": 1}), "bad_arguments", "unexpected argument(s) limt"),
        (ToolCall("search", {"query": 3}), "bad_arguments", "argument 'query' must be string, got int"),
        (ToolCall("search", {"query": "q", "limit": True}), "bad_arguments", "must be integer, got bool"),
        (ToolCall("search", {"query": "q", "tags": ["a", 1]}), "bad_arguments", "'tags' must be array"),
        (ToolCall("boom", {"x": 7}), "tool_raised", "RuntimeError: broken on 7"),
        (ToolCall("slow", {"seconds": 0.8}), "timeout", "timed out after 0.3s"),
    ]
    for call, kind, text in cases:
        outcome = run(box.run(call))
        assert outcome.error == kind, call
        assert text in outcome.text, (call, outcome.text)
    # successes: defaults, an int for a float, None for an optional list, async tools, long and non-text results
    ok = run(box.run(ToolCall("search", {"query": "q", "scale": 2, "tags": None})))
    assert ok.error is None and ok.text == "q:5:False:None:2"
    assert run(box.run(ToolCall("shout", {"text": "hi"}))).text == "HI"
    long = run(box.run(ToolCall("listing", {"n": 30})))
    assert (
        long.error is None
        and long.text.startswith("...")
        and long.text.endswith("28, 29]")
        and len(long.text) == 20
    )


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools"):
        Toolbox([calculator, Tool.of(search, name="calculator")])


@pytest.mark.parametrize(
    "expression, value",
    [
        ("4821*377+90", "1817607"),
        ("-(3 - 10) ** 2 // 4", "-13"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("abs(-2) + max(1, 5) + round(2.6) + sqrt(16) + floor(1.5) + ceil(1.2) + 10 % 4", "19"),
        ("2**100", str(2**100)),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("().__class__", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("(lambda: 1)()", "unsupported syntax"),
        ("'a' * 3", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("print(1)", "unsupported syntax"),
        ("9**9**9", "power too large"),
        ("(2**4000)**1000", "power too large"),
        ("1 +", "not an expression"),
        ("1" * 600, "longer than"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression, message):
    # refused before evaluating: the huge powers would otherwise run until pytest-timeout ends the test
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_calculator_errors_reach_the_model_as_tool_raised():
    outcome = run(Toolbox([calculator]).run(ToolCall("calculator", {"expression": "1/0"})))
    assert outcome.error == "tool_raised" and "ZeroDivisionError" in outcome.text


@pytest.mark.sandbox  # the python tool runs in the sandbox (the rest of this module: unit)
def test_python_tool_runs_in_the_sandbox():
    box = Toolbox([python_tool(SandboxConfig(timeout_s=1.0))])
    assert run(box.run(ToolCall("python", {"code": "print(6 * 7)"}))).text == "42\n"
    failed = run(box.run(ToolCall("python", {"code": "print('before')\nraise KeyError('k')"}))).text
    assert failed.startswith("before\nexit status 1\n") and "KeyError: 'k'" in failed
    # the sandbox has no network: the code's own failure is its result, not a tool error
    net = run(
        box.run(ToolCall("python", {"code": "import socket; socket.create_connection(('1.1.1.1', 53), 1)"}))
    )
    assert net.error is None and "exit status 1" in net.text
    hung = run(box.run(ToolCall("python", {"code": "print('start', flush=True)\nwhile True: pass"})))
    assert hung.error is None and hung.text == "timed out after 1s\nstart\n"


# ------------------------------------------------------------------------------------ ToolEnv


def test_tool_env_episode_counts_calls_and_scores_the_answer():
    env = ToolEnv(
        Toolbox([calculator], ToolsConfig(max_calls_per_turn=2)),
        verify=lambda text, answer: float(f"<answer>{answer}</answer>" in text),
        instructions="Use tools.\n",
    )
    assert run(env.reset(PromptRow(0, "What is 12*12?", "144"))) == "Use tools.\nWhat is 12*12?"
    step = run(
        env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*12"}}</tool_call>')
    )
    assert step == StepResult(
        "<tool_result>144</tool_result>", 0.0, False, {"tool_calls": 1, "tool_calls_ok": 1}
    )
    text = (
        '<tool_call>{"name": "calc"}</tool_call><tool_call>oops</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    )
    step = run(env.step(text))
    assert step.observation == (
        "<tool_result>error: unknown tool 'calc'; available: calculator</tool_result>"
        "<tool_result>error: malformed tool call: not valid JSON (Expecting value at char 0)</tool_result>"
        "<tool_result>error: more than 2 calls in one turn</tool_result>"
    )
    assert step.info == {
        "tool_calls": 3, "tool_calls_ok": 0, "tool_error_unknown_tool": 1, "tool_error_malformed": 1,
        "tool_error_too_many_calls": 1,
    }  # fmt: skip
    final = run(env.step("<answer>144</answer>"))
    assert (final.reward, final.done, final.info) == (1.0, True, {"answered": 1, "correct": 1.0})


def test_call_bonus_is_paid_once_and_only_for_clean_tool_turns():
    env = ToolEnv(Toolbox([calculator]), verify=lambda text, answer: 0.0, call_bonus=0.1)
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    run(env.reset(PromptRow(0, "q", "2")))
    assert run(env.step(good + '<tool_call>{"name": "nope"}</tool_call>')).reward == 0.0  # one call failed
    assert run(env.step(good)).reward == 0.1
    assert run(env.step(good)).reward == 0.0  # once per episode
    run(env.reset(PromptRow(1, "q", "2")))
    assert run(env.step(good)).reward == 0.1  # a new episode pays again
