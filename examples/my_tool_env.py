"""Your own multi-turn environment with a tool, in about 30 lines: train on it with

    loopline train env.name=python:examples/my_tool_env.py:make_env env.max_turns=3 \
        grpo.sampling.stop=[] env.stop=[</tool_call>,</answer>]

The model may call `digit_sum` (<tool_call>{"name": "digit_sum", "arguments": {"n": 1234}}</tool_call>); the env
runs it and shows <tool_result>10</tool_result>; a turn without a call is the answer, <answer>...</answer>,
which ends the episode: reward 1 when it is the row's answer. The loop makes one env per episode, on an env
worker, and replays its history there every turn: a tool must answer the same call the same way.
"""

from loopline.envs.tasks import answer_match
from loopline.envs.tools import Toolbox, ToolEnv


def digit_sum(n: int) -> int:
    """The sum of the decimal digits of n."""
    return sum(int(d) for d in str(abs(n)))


def make_env() -> ToolEnv:
    # the tool's schema comes from its signature and docstring; answer_match reads <answer>...</answer>
    return ToolEnv(Toolbox([digit_sum]), answer_match)
