"""The OpenAI-compatible server over real HTTP on 127.0.0.1: the response format, what it records
(prompt ids, completion ids, log-probs equal to the trainer's), stop strings, n, batching of
concurrent requests, errors, chat templates, and an agent program's tool loop through it."""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from loopline.config import OptimConfig
from loopline.data.batches import collate
from loopline.envs.tools import Toolbox, calculator
from loopline.models.load import build_tiny_model
from loopline.rollout.engine import TorchEngine
from loopline.rollout.openai_server import OpenAIServer, ServerConfig, builtin_chat_format, to_trajectories
from loopline.training.policy import PolicyTrainer, response_logprobs
from tests.conftest import need_module

QUESTION = "What is 2+3?"
CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'


def post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(server: OpenAIServer, messages: list[dict], traj: str = "", **extra) -> dict:
    headers = {"X-Trajectory-Id": traj} if traj else {}
    status, body = post(server.base_url + "/chat/completions", {"messages": messages, **extra}, headers)
    assert status == 200, body
    return body


@pytest.fixture
def server(tokenizer, small_model):
    with OpenAIServer(TorchEngine(small_model, tokenizer), tokenizer) as s:
        yield s


def test_models_and_a_completion_in_openai_format(server, tokenizer, small_model):
    status, models = 0, None
    with urllib.request.urlopen(server.base_url + "/models", timeout=10) as r:
        status, models = r.status, json.loads(r.read())
    assert status == 200 and models["data"][0]["id"] == "loopline"
    assert server.cfg.host == "127.0.0.1" and server.port > 0

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = chat(server, messages, traj="t1", max_tokens=12, seed=0, logprobs=True)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")

    (record,) = server.trajectories()["t1"]
    assert (
        record.prompt_ids
        == tokenizer(builtin_chat_format(messages, "<eos>"), add_special_tokens=False)["input_ids"]
    )
    assert tokenizer.decode(record.completion_ids, skip_special_tokens=True) == choice["message"]["content"]
    assert body["usage"] == {
        "prompt_tokens": len(record.prompt_ids),
        "completion_tokens": len(record.completion_ids),
        "total_tokens": len(record.prompt_ids) + len(record.completion_ids),
    }
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(record.logprobs)
    # the recorded log-probs are the trainer's log-probs of those tokens
    batch = collate([record.prompt_ids], [record.completion_ids], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer_logprobs = response_logprobs(small_model, batch)[0][0]
    torch.testing.assert_close(trainer_logprobs, torch.tensor(record.logprobs), atol=2e-5, rtol=0)


def test_n_stop_and_the_user_field(server):
    body = chat(server, [{"role": "user", "content": "x"}], n=3, temperature=0, max_tokens=8, user="u7")
    texts = [c["message"]["content"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len(set(texts)) == 1  # greedy: all alike
    records = server.trajectories()["u7"]
    assert [r.choice for r in records] == [0, 1, 2] and len({r.request_id for r in records}) == 1

    # stop on the greedy text's 3rd character: returned without it, recorded with it
    stop = texts[0][2]
    body = chat(
        server, [{"role": "user", "content": "x"}], temperature=0, max_tokens=8, stop=[stop], user="u8"
    )
    (record,) = server.trajectories()["u8"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == texts[0][: texts[0].index(stop)]
    assert record.content + stop == server.tokenizer.decode(record.completion_ids, skip_special_tokens=True)
    assert server.pop_trajectories().keys() == {"u7", "u8"} and server.trajectories() == {}


class HeldEngine(TorchEngine):
    """The real engine, whose first generate call waits until the test lets it go."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.release, self.first_size = threading.Event(), threading.Event(), 0

    def generate(self, prompts, *args, **kwargs):
        if not self.entered.is_set():
            self.first_size = len(prompts)
            self.entered.set()
            assert self.release.wait(120), "the test never released the engine"
        return super().generate(prompts, *args, **kwargs)


def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_concurrent_requests_are_batched_and_recorded_apart(tokenizer, small_model):
    # The first batch is held inside the engine until every other request is queued behind it: then they
    # must all go out together in one second batch (whatever the timing of their arrival).
    engine = HeldEngine(small_model, tokenizer)
    with OpenAIServer(engine, tokenizer, ServerConfig()) as server:
        results: dict[int, dict] = {}

        def one(i: int) -> None:
            results[i] = chat(
                server, [{"role": "user", "content": f"question {i}"}], traj=f"q{i}", max_tokens=6
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        _until(engine.entered.is_set, "the first batch")
        _until(lambda: server._queue.qsize() == 6 - engine.first_size, "the other requests to queue")
        engine.release.set()
        for t in threads:
            t.join()
        first = engine.first_size
        assert len(results) == 6 and server.batch_sizes == ([first, 6 - first] if first < 6 else [6])
        recorded = server.trajectories()
        assert sorted(recorded) == [f"q{i}" for i in range(6)]
        for i in range(6):
            (record,) = recorded[f"q{i}"]
            assert tokenizer.decode(record.prompt_ids).startswith(f"<|user|>\nquestion {i}")
            assert record.content == results[i]["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        ([1, 2], 400, "must be a JSON object"),
        ({"messages": []}, 400, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "role in system"),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "content must be"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "'max_tokens' must be"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "'n' must be"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "'temperature' must be",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, 400, "'stop' must be"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": True}, 400, "stream"),
        ({"messages": [{"role": "assistant", "tool_calls": [1]}]}, 400, "a tool call must be"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, message):
    got, answer = post(server.base_url + "/chat/completions", body)
    assert got == status and message in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert post(server.base_url + "/nowhere", {})[0] == 404
    assert chat(server, [{"role": "user", "content": "still there?"}], max_tokens=2)["choices"]


def test_the_chat_template_is_used_when_there_is_one(tokenizer, small_model):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    with OpenAIServer(TorchEngine(small_model, tok), tok) as server:
        chat(server, [{"role": "user", "content": "hello"}], traj="c", max_tokens=3)
        (record,) = server.trajectories()["c"]
    assert tok.decode(record.prompt_ids) == "[user]hello[assistant]"


# ------------------------------------------------------------------------------------ an agent through it


@pytest.fixture(scope="module")
def agent_model(tokenizer, small_cfg):
    """A small model taught one episode: call the calculator on 2+3, then answer from its result."""
    model = build_tiny_model(small_cfg, tokenizer, seed=0)
    turn1 = builtin_chat_format([{"role": "user", "content": QUESTION}], "<eos>")
    turn2 = builtin_chat_format(
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "5"},
        ],
        "<eos>",
    )
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (turn1, turn2)]
    targets = [
        tokenizer(t + "<eos>", add_special_tokens=False)["input_ids"] for t in (CALL, "<answer>5</answer>")
    ]
    batch = collate(ids, targets, tokenizer.pad_token_id)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=300)
    for _ in range(300):
        if trainer.sft_step(batch, 2).loss < 0.005:
            break
    return model.eval()


def agent_program(base_url: str, question: str, trajectory: str, use_tools: bool) -> str:
    """A plain OpenAI-API tool loop (urllib only): ask, run the calls it gets back, ask again."""
    toolbox = Toolbox([calculator])
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(4):
        body: dict = {
            "model": "any",
            "messages": messages,
            "temperature": 0,
            "max_tokens": 80,
            "user": trajectory,
        }
        if use_tools:
            body["tools"] = toolbox.schemas()
        status, answer = post(base_url + "/chat/completions", body)
        assert status == 200, answer
        message = answer["choices"][0]["message"]
        messages.append(message)
        if use_tools and message.get("tool_calls"):
            for call in message["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                result = calculator(**args)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        elif not use_tools and "<tool_call>" in (message["content"] or ""):
            expression = message["content"].split('"expression":"')[1].split('"')[0]
            messages.append({"role": "tool", "content": calculator(expression)})
        else:
            return message["content"]
    raise AssertionError("the agent did not finish")


@pytest.mark.parametrize("use_tools", [True, False])
def test_an_agent_program_is_recorded_as_one_trainable_sequence(tokenizer, agent_model, use_tools):
    with OpenAIServer(TorchEngine(agent_model, tokenizer), tokenizer) as server:
        assert agent_program(server.base_url, QUESTION, "ep1", use_tools) == "<answer>5</answer>"
        calls = server.trajectories()["ep1"]
    assert len(calls) == 2
    assert tokenizer.decode(calls[0].completion_ids) == CALL + "<eos>"
    # the second prompt continues the first call token for token, so the episode is one sequence
    (traj,) = to_trajectories(calls)
    assert traj.prompt_ids == calls[0].prompt_ids
    assert traj.tokens == calls[1].prompt_ids[len(calls[0].prompt_ids) :] + calls[1].completion_ids
    tool_turn = tokenizer("<|tool|>\n5<eos><|assistant|>\n", add_special_tokens=False)["input_ids"]
    assert traj.mask == [1] * len(calls[0].completion_ids) + [0] * len(tool_turn) + [1] * len(
        calls[1].completion_ids
    )
    assert traj.logprobs == calls[0].logprobs + [0.0] * len(tool_turn) + calls[1].logprobs


def test_calls_that_do_not_continue_start_new_sequences(server):
    chat(server, [{"role": "user", "content": "a"}], traj="x", max_tokens=4)
    chat(server, [{"role": "user", "content": "b"}], traj="x", max_tokens=4)
    trajs = to_trajectories(server.trajectories()["x"])
    assert len(trajs) == 2 and all(t.mask == [1] * len(t.tokens) for t in trajs)


def test_the_openai_client_talks_to_the_server(server):
    openai = need_module("openai", "the openai client is not installed (pip install loopline[dev])")
    assert server.base_url.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    reply = client.chat.completions.create(
        model="loopline",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_headers={"X-Trajectory-Id": "oa"},
    )
    assert reply.choices[0].message.role == "assistant" and "oa" in server.trajectories()
