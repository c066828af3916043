"""The OpenAI-compatible server over real HTTP on 127.0.0.1: the response format, what it records
(prompt ids, completion ids, log-probs equal to the trainer's), stop strings, n, batching of
concurrent requests, errors, chat templates, and an agent program's tool loop through it; with the
real `openai` client: streamed chat (tool calls too) and completions recording what the plain answer
records, and 40 concurrent clients whose trajectories stay apart; shutdown with requests queued."""

from __future__ import annotations

import asyncio
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
from loopline.rollout.engine import Completion, TorchEngine
from loopline.rollout.openai_server import (
    OpenAIServer,
    ServerConfig,
    builtin_chat_format,
    text_deltas,
    text_offsets,
    to_trajectories,
)
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
        _until(lambda: server._engine_queue.queued() == 6 - engine.first_size, "the other requests to queue")
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
        (
            {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            400,
            "'stream' must be a boolean",
        ),
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

    # a template that refuses the messages: the client is told why
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with OpenAIServer(TorchEngine(small_model, tok), tok) as server:
        status, answer = post(
            server.base_url + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
    assert (
        status == 400
        and "chat template refused the messages: roles must alternate" in answer["error"]["message"]
    )


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


# ------------------------------------------------------------------------------- the openai client: streaming


def openai_client(server: OpenAIServer):
    openai = need_module("openai", "the openai client is not installed (pip install loopline[dev])")
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_a_streamed_chat_is_the_plain_answer_in_pieces_and_records_the_same_tokens(server, tokenizer):
    client = openai_client(server)
    messages = [{"role": "user", "content": "tell me"}]
    plain = client.chat.completions.create(
        model="loopline", messages=messages, temperature=0, max_tokens=24, logprobs=True, user="plain"
    )
    chunks = list(
        client.chat.completions.create(
            model="loopline",
            messages=messages,
            temperature=0,
            max_tokens=24,
            logprobs=True,
            user="streamed",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *events, usage_chunk = chunks
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert events[0].choices[0].delta.role == "assistant"
    assert len(events) > 3  # role, several pieces of text, the finish
    text = "".join(c.choices[0].delta.content or "" for c in events)
    assert text == plain.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in events] == [None] * (len(events) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == plain.usage.model_dump()

    (plain_record,) = server.trajectories()["plain"]
    (streamed_record,) = server.trajectories()["streamed"]
    assert streamed_record.prompt_ids == plain_record.prompt_ids
    assert streamed_record.completion_ids == plain_record.completion_ids
    assert streamed_record.logprobs == plain_record.logprobs
    assert tokenizer.decode(streamed_record.completion_ids, skip_special_tokens=True) == text
    # the pieces' log-probs, joined, are the recorded ones: every token is sent once
    streamed_logprobs = [t.logprob for c in events for t in (c.choices[0].logprobs.content or [])]
    assert streamed_logprobs == pytest.approx(streamed_record.logprobs)

    # a stop string: cut from the streamed text as from the plain one, kept in the record
    stop = text[3]
    streamed = client.chat.completions.create(
        model="loopline", messages=messages, temperature=0, max_tokens=24, stop=[stop], user="s", stream=True
    )
    pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in streamed]
    assert "".join(p for p, _ in pieces) == text[: text.index(stop)] and pieces[-1][1] == "stop"
    (record,) = server.trajectories()["s"]
    assert tokenizer.decode(record.completion_ids, skip_special_tokens=True) == text[: text.index(stop) + 1]


def test_the_stream_is_server_sent_events_ending_with_done(server):
    request = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = r.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"][0]["delta"] == {}


def test_text_deltas_never_split_a_character_and_join_to_the_content(tokenizer):
    ids = tokenizer("héllo €5", add_special_tokens=False)["input_ids"]  # é and € are 2 and 3 byte tokens
    deltas = text_deltas(tokenizer, ids, "héllo €5")
    assert [p for p, _ in deltas] == ["h", "é", "l", "l", "o", " ", "€", "5"]
    assert [k for _, k in deltas] == [1, 3, 4, 5, 6, 7, 10, 11]
    # a stop string cut from the content: the pieces stop where the content does
    assert "".join(p for p, _ in text_deltas(tokenizer, ids, "héllo")) == "héllo"
    # the legacy completions API's text_offset: where each token starts (é's two tokens both at 1)
    completion = Completion(0, 0, ids, [0.0] * len(ids), "héllo €5", "length")
    assert text_offsets(tokenizer, completion) == [0, 1, 1, 2, 3, 4, 5, 6, 6, 6, 7]


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(tokenizer, agent_model):
    toolbox = Toolbox([calculator])
    with OpenAIServer(TorchEngine(agent_model, tokenizer), tokenizer) as server:
        client = openai_client(server)
        ask = {
            "model": "x",
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 80,
            "tools": toolbox.schemas(),
        }
        plain = client.chat.completions.create(**ask, user="plain")
        chunks = list(client.chat.completions.create(**ask, user="streamed", stream=True))
        records = server.trajectories()
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.type, t.function.name) for t in calls] == [(0, "function", "calculator")]
    assert json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    assert json.loads(calls[0].function.arguments) == json.loads(
        plain.choices[0].message.tool_calls[0].function.arguments
    )
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        plain.choices[0].message.content or ""
    )
    assert records["streamed"][0].completion_ids == records["plain"][0].completion_ids


# ------------------------------------------------------------------------------------ the completions endpoint


def test_completions_plain_streamed_and_from_token_ids(server, tokenizer):
    client = openai_client(server)
    prompt = "Once upon a time"
    plain = client.completions.create(
        model="loopline", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, user="p"
    )
    (choice,) = plain.choices
    assert (
        plain.object == "text_completion"
        and plain.id.startswith("cmpl-")
        and choice.finish_reason == "length"
    )
    (record,) = server.trajectories()["p"]
    assert record.prompt_ids == tokenizer(prompt)["input_ids"]  # the tokenizer's own encoding (with <bos>)
    assert tokenizer.decode(record.completion_ids, skip_special_tokens=True) == choice.text
    assert choice.logprobs.token_logprobs == pytest.approx(record.logprobs)
    offsets = choice.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice.text)
    assert plain.usage.completion_tokens == len(record.completion_ids) == 12

    chunks = list(
        client.completions.create(
            model="loopline", prompt=prompt, max_tokens=12, temperature=0, logprobs=0, user="s", stream=True
        )
    )
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs] == pytest.approx(
        record.logprobs
    )
    (streamed,) = server.trajectories()["s"]
    assert streamed.completion_ids == record.completion_ids and streamed.logprobs == record.logprobs

    ids = client.completions.create(
        model="loopline", prompt=record.prompt_ids, max_tokens=12, temperature=0, user="i"
    )
    assert (
        ids.choices[0].text == choice.text and server.trajectories()["i"][0].prompt_ids == record.prompt_ids
    )


def test_without_max_tokens_a_long_prompt_gets_what_the_context_leaves(server):
    status, answer = post(server.base_url + "/completions", {"prompt": "x" * 500, "temperature": 0})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 501
    assert answer["usage"]["completion_tokens"] <= 11 and len(server.trajectories()) == 1


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'prompt' must be a string or a non-empty list of token ids"),
        ({"prompt": ["a", "b"]}, "'prompt' must be"),
        ({"prompt": [1, 10**6]}, "'prompt' token ids must be in [0, "),
        ({"prompt": "x", "echo": True}, "'echo' is not supported"),
        ({"prompt": "x", "logprobs": 9}, "'logprobs' must be an integer in [0, 5]"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only given with stream=true"),
        ({"prompt": "x" * 600, "max_tokens": 4}, "(601 tokens) leaves no room in the model's context (512"),
        (
            {"prompt": "x" * 500, "max_tokens": 20},
            "plus max_tokens (20) is longer than the model's context (512",
        ),
        ({"prompt": "x", "model": 3}, "'model' must be a string"),
    ],
)
def test_bad_completions_requests_are_refused_by_name(server, body, message):
    status, answer = post(server.base_url + "/completions", body)
    assert status == 400 and message in answer["error"]["message"], answer


def test_wrong_method_too_large_and_timed_out_requests_get_json_errors(tokenizer, small_model):
    engine = HeldEngine(small_model, tokenizer)
    cfg = ServerConfig(max_body_bytes=1000, request_timeout_s=0.5)
    with OpenAIServer(engine, tokenizer, cfg) as server:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.base_url + "/completions", timeout=10)
        assert e.value.code == 405 and "GET is not allowed" in json.loads(e.value.read())["error"]["message"]
        status, answer = post(server.base_url + "/completions", {"prompt": "x" * 2000})
        assert status == 413 and answer["error"]["type"] == "invalid_request_error"
        # the engine is held: the request times out with 503, and the server serves again once it is free
        status, answer = post(server.base_url + "/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and "did not answer in time" in answer["error"]["message"]
        engine.release.set()
        assert post(server.base_url + "/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


# ----------------------------------------------------------------------------------- many concurrent clients


def test_concurrent_clients_each_get_their_own_trajectory(server, tokenizer, small_model):
    openai = need_module("openai", "the openai client is not installed (pip install loopline[dev])")
    clients = 40

    async def one(i: int) -> str:
        # a client of its own per agent (its own connections); chat and completions, streamed and not
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as client:
            ask = {
                "model": "m",
                "max_tokens": 6,
                "temperature": 1.0,
                "extra_headers": {"X-Trajectory-Id": f"a{i}"},
            }
            if i % 2 == 0:
                messages = [{"role": "user", "content": f"agent {i}"}]
                if i % 4 == 0:
                    reply = await client.chat.completions.create(messages=messages, **ask)
                    return reply.choices[0].message.content
                stream = await client.chat.completions.create(messages=messages, stream=True, **ask)
                return "".join([c.choices[0].delta.content or "" async for c in stream])
            if i % 4 == 1:
                reply = await client.completions.create(prompt=f"agent {i}", **ask)
                return reply.choices[0].text
            stream = await client.completions.create(prompt=f"agent {i}", stream=True, **ask)
            return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(clients)))

    texts = asyncio.run(all_of_them())
    recorded = server.trajectories()
    assert sorted(recorded) == sorted(f"a{i}" for i in range(clients))
    for i, text in enumerate(texts):
        (record,) = recorded[f"a{i}"]
        assert f"agent {i}" in tokenizer.decode(record.prompt_ids)
        assert tokenizer.decode(record.completion_ids, skip_special_tokens=True) == text
    assert sum(server.batch_sizes) == clients  # every sequence generated once
    assert len(set(texts)) > clients // 2  # sampled apart (not one answer copied to all)
    # the recorded log-probs are the model's for the recorded prompt: no completion was handed to another
    # request (the text check alone would not see that, as the record is made from what was handed over)
    records = [recorded[f"a{i}"][0] for i in range(clients)]
    batch = collate(
        [r.prompt_ids for r in records], [r.completion_ids for r in records], tokenizer.pad_token_id
    )
    with torch.no_grad():
        trainer_logprobs = response_logprobs(small_model, batch)[0]
    for i, r in enumerate(records):
        got = trainer_logprobs[i, : len(r.logprobs)]
        torch.testing.assert_close(got, torch.tensor(r.logprobs), atol=1e-4, rtol=0)


def test_closing_answers_the_queued_requests_instead_of_leaving_them_hanging(tokenizer, small_model):
    engine = HeldEngine(small_model, tokenizer)
    server = OpenAIServer(engine, tokenizer).start()
    answers: dict[str, tuple[int, dict]] = {}

    def ask(name: str) -> None:
        answers[name] = post(server.base_url + "/completions", {"prompt": name, "max_tokens": 2})

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    _until(engine.entered.is_set, "the first request in the engine")
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    _until(lambda: server._engine_queue.queued() == 1, "the second request to queue")
    closing = threading.Thread(target=server.close)
    closing.start()
    _until(lambda: server._engine_queue.closing, "close to begin")
    engine.release.set()  # the batch in the engine finishes; what is queued behind it is told the server closed
    for t in (first, second, closing):
        t.join(timeout=60)
        assert not t.is_alive()
    assert answers["first"][0] == 200
    assert answers["second"][0] == 503 and "shutting down" in answers["second"][1]["error"]["message"]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.base_url + "/models", timeout=5)
