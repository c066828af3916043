"""A multi-turn tool env with demonstrations: convert units with a tool, then answer from its result.

    prompt:  How many cm in 170 in?
    model:   <tool_call>{"name":"convert","arguments":{}}</tool_call>
    env:     <tool_result>432</tool_result>
    model:   <answer>432</answer>                          reward 1 when it is the row's answer

The tool converts the episode's own question (rounded to a whole number), so the model has to call it, read the
result and copy it into its answer: nothing in the prompt gives the number away (170 x 2.54 is beyond a tiny model).

`python examples/unit_env.py DIR` writes DIR/train.jsonl and DIR/eval.jsonl: one row per problem with its `answer`
and its `messages`, a transcript of the episode above with the tool's real result (the env is run to make it).
Warm-start on the transcripts, then train with RL on the same env:

    loopline train env.name=python:examples/unit_env.py:make_env env.max_turns=3 \
        env.stop=[</tool_call>,</answer>] data.source=jsonl data.train_path=DIR/train.jsonl \
        data.eval_path=DIR/eval.jsonl

SFT trains on the transcripts' assistant messages only, tokenized as the rollout builds an episode.
SFT alone learns the copy, late and suddenly: on a 2-layer, 64-wide tiny model (lr 3e-3, 16 transcripts a step) the
loss sits near 0.09 until step ~200-350, then falls to ~0; after 600 steps all 16 held-out problems were right for
seeds 0, 1 and 2 (tests/loops/test_sft_transcripts.py). lr 5e-3 learnt it later (800 steps: 69%, 100%, 94%), lr 1e-2
and the default tiny model (128 wide, 4 layers; 500 steps) not at all, nor did the 2-digit version of this env with
58 transcripts.
"""

import asyncio
import json
import re
import sys
from pathlib import Path

from loopline.data.rows import PromptRow
from loopline.envs.tasks import answer_match, tool_call_text
from loopline.envs.tools import Toolbox, ToolEnv

# unit -> (the unit it converts to, the factor, the amounts asked about): every result has three digits, so the
# answer's digits sit at a fixed distance after the result's, and 729 problems are too many to learn by heart
UNITS = {"in": ("cm", 2.54, range(40, 394)), "yd": ("ft", 3, range(34, 334)), "ft": ("in", 12, range(9, 84))}
QUESTION = re.compile(r"How many \w+ in (\d+) (\w+)\?")


class UnitEnv(ToolEnv):
    """One episode: the convert tool (on this episode's question) and <answer>...</answer> checked."""

    def __init__(self) -> None:
        super().__init__(Toolbox([self.convert]), answer_match)
        self.question = ""

    async def reset(self, sample: PromptRow) -> str:
        self.question = sample.prompt
        return await super().reset(sample)

    def convert(self) -> int:
        """Convert the amount the question asks about, rounded to a whole number."""
        found = QUESTION.search(self.question)
        if found is None:
            raise ValueError(f"no 'How many X in N Y?' in {self.question!r}")
        return round(int(found[1]) * UNITS[found[2]][1])


def make_env() -> UnitEnv:
    return UnitEnv()


def transcript(prompt: str) -> list[dict[str, str]]:
    """The demonstration of one problem as chat messages: the call, the env's real result, the answer."""
    call = tool_call_text("convert", {})

    async def run() -> str:
        env = make_env()
        await env.reset(PromptRow(0, prompt, ""))
        return (await env.step(call)).observation

    result = asyncio.run(run())
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": result},
        {
            "role": "assistant",
            "content": "<answer>"
            + result.removeprefix("<tool_result>").removesuffix("</tool_result>")
            + "</answer>",
        },
    ]


def write_rows(out: Path, num_eval: int = 16) -> None:
    """train.jsonl and eval.jsonl in `out`: disjoint problems (a fixed shuffle), each with answer and transcript."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = [f"How many {to} in {n} {unit}?\n" for unit, (to, _, ns) in UNITS.items() for n in ns]
    prompts = [prompts[(i * 31) % len(prompts)] for i in range(len(prompts))]  # 31 is prime to 729
    rows = []
    for prompt in prompts:
        messages = transcript(prompt)
        rows.append({"answer": messages[-1]["content"][8:-9], "messages": messages})
    for name, part in (("eval.jsonl", rows[:num_eval]), ("train.jsonl", rows[num_eval:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    write_rows(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
