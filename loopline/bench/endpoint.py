"""`loopline bench endpoint`: the OpenAI-compatible endpoint (rollout.openai_server) under concurrent agents.

The server runs here on the built-in tiny model (random weights, byte tokenizer); the agents run in a second
process, so that their own CPU work (HTTP, JSON, the openai client's models) does not share this one's GIL.
For each N of `--clients`: N concurrent `openai` clients (AsyncOpenAI, each with its own connections and its
own trajectory id), each making `--requests` chat requests one after another (every other one streamed),
sampling `--max-tokens` tokens at temperature 1 (so every agent's text is its own). A warm-up request goes
first. The engine runs on `--torch-threads` threads: on a 2-core machine the agents' process takes a core, and
two torch threads contending with it spin-wait (generate ran ~3x slower so, measured). Then the server's records are checked against what the clients received:
- lost: requests answered to a client with no turn recorded for them (must be 0);
- crossed: trajectories whose recorded prompts or tokens are not what their client sent and received, or whose
  recorded log-probs are not the model's (recomputed, teacher-forced), and recorded trajectories no client
  asked for (must be 0).
Prints `name: value` lines (requests per second, p50/p99 latency, sequences per engine call, errors, lost,
crossed, the largest recorded-vs-recomputed log-prob difference), ending with the headline: the most clients
over the fewest, in requests per second. Exits 1 when a request failed or was lost or crossed.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the agents' process imports this module: it stays free of torch and the server
    from loopline.rollout.openai_server import ServedCompletion


@dataclass
class Agent:
    """What one client sent and got back."""

    trajectory: str
    texts: list[tuple[int, str]]  # (request number, text received) per request answered
    latencies_s: list[float]
    errors: list[str]


def ask(trajectory: str, j: int) -> str:
    """The user message of request j of an agent: it names both, so a crossed prompt shows."""
    return f"{trajectory} request {j}: go on"


async def _agent(client: Any, trajectory: str, requests: int, max_tokens: int) -> Agent:
    import openai

    agent = Agent(trajectory, [], [], [])
    for j in range(requests):
        body = {
            "model": "loopline",
            "messages": [{"role": "user", "content": ask(trajectory, j)}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "extra_headers": {"X-Trajectory-Id": trajectory},
        }
        start = time.perf_counter()
        try:
            if j % 2:
                stream = await client.chat.completions.create(stream=True, **body)
                text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            else:
                reply = await client.chat.completions.create(**body)
                text = reply.choices[0].message.content or ""
        except openai.APIError as e:
            agent.errors.append(f"{type(e).__name__}: {e}")
            continue
        agent.latencies_s.append(time.perf_counter() - start)
        agent.texts.append((j, text))
    return agent


def drive(base_url: str, tag: str, clients: int, requests: int, max_tokens: int) -> tuple[float, list[Agent]]:
    """(wall seconds, the agents) for `clients` concurrent agents; runs in the agents' process.

    The clients are made before the clock starts, sharing one SSL context (an openai client loads the
    CA bundle into a new one otherwise: ~60 ms each, unused over plain http), each with its own connections.
    """
    import ssl

    import openai

    async def run() -> tuple[float, list[Agent]]:
        context = ssl.create_default_context()
        agents = [
            openai.AsyncOpenAI(
                base_url=base_url,
                api_key="unused",
                max_retries=0,  # a retried request would be recorded twice
                timeout=600,
                http_client=openai.DefaultAsyncHttpxClient(verify=context),
            )
            for _ in range(clients)
        ]
        start = time.perf_counter()
        done = await asyncio.gather(
            *(_agent(client, f"{tag}-{i}", requests, max_tokens) for i, client in enumerate(agents))
        )
        wall_s = time.perf_counter() - start
        for client in agents:
            await client.close()
        return wall_s, list(done)

    return asyncio.run(run())


LOGPROB_TOL = 1e-3  # recorded vs recomputed log-prob; float noise between batch shapes is ~1e-5


def check(
    agents: list[Agent],
    records: Mapping[str, list[ServedCompletion]],
    decode: Callable[[list[int]], str],
    model_logprobs: Callable[[list[ServedCompletion]], list[list[float]]],
) -> tuple[int, int, float]:
    """(lost, crossed, the largest log-prob difference): the server's records against what the agents got.

    A trajectory is crossed when a turn's prompt is not its agent's, its tokens do not decode to the text the
    agent received, or its log-probs are not the model's for those tokens after that prompt (recomputed by
    `model_logprobs`: a completion handed to another request would still match that request's text).
    """
    records = dict(records)
    served = [r for agent in agents for r in records.get(agent.trajectory, [])]
    recomputed = dict(zip(map(id, served), model_logprobs(served))) if served else {}
    lost = crossed = 0
    worst = 0.0
    for agent in agents:
        turns = records.pop(agent.trajectory, [])
        lost += max(0, len(agent.texts) - len(turns))
        got = [(ask(agent.trajectory, j), text) for j, text in agent.texts]
        seen = [(decode(r.prompt_ids), decode(r.completion_ids)) for r in turns]
        diffs = [abs(a - b) for r in turns for a, b in zip(r.logprobs, recomputed[id(r)])]
        worst = max([worst, *diffs])
        same = len(seen) <= len(got) and all(
            sent in prompt and text == recorded for (sent, text), (prompt, recorded) in zip(got, seen)
        )
        crossed += int(not same or any(d > LOGPROB_TOL for d in diffs))
    return lost, crossed + len(records), worst  # a trajectory left over was asked for by no client


def main(argv: list[str]) -> int:
    """Entry point of `loopline bench endpoint`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="loopline bench endpoint", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1, 64], help="concurrent client counts to try"
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per request")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="the engine's torch threads (the agents take a core)"
    )
    args = parser.parse_args(argv)
    if (
        args.requests < 1
        or args.torch_threads < 1
        or min(args.clients) < 1
        or not 1 <= args.max_tokens <= 256
    ):
        parser.error(
            "--requests, --torch-threads and every --clients count must be >= 1, --max-tokens in [1, 256]"
        )

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return _bench(args)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (a test) keeps its own setting


def _bench(args: argparse.Namespace) -> int:
    """The server here, the agents in a second process, one round per client count."""
    import numpy as np
    import torch

    from loopline.data.batches import collate
    from loopline.models.config import ModelConfig
    from loopline.models.load import load_policy
    from loopline.rollout.engine import TorchEngine
    from loopline.rollout.openai_server import OpenAIServer, ServerConfig
    from loopline.training.policy import response_logprobs

    model_cfg = ModelConfig()
    model, tokenizer = load_policy(model_cfg)
    print(f"model: builtin tiny (hidden {model_cfg.tiny.hidden_size}, {model_cfg.tiny.num_layers} layers)")
    print(f"requests_per_client: {args.requests}")
    print(f"max_tokens: {args.max_tokens}")
    print(f"torch_threads: {torch.get_num_threads()}")

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    def model_logprobs(served: list[ServedCompletion]) -> list[list[float]]:
        """Each turn's completion log-probs under the model, teacher-forced after its prompt."""
        out = []
        for k in range(0, len(served), 64):
            chunk = served[k : k + 64]
            batch = collate(
                [r.prompt_ids for r in chunk], [r.completion_ids for r in chunk], tokenizer.pad_token_id
            )
            with torch.no_grad():
                logprobs = response_logprobs(model, batch)[0]  # (B, C)
            out += [logprobs[i, : len(r.completion_ids)].tolist() for i, r in enumerate(chunk)]
        return out

    failed = 0
    rates: dict[int, float] = {}
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads or locks inherited
    with (
        OpenAIServer(TorchEngine(model, tokenizer), tokenizer, ServerConfig()) as server,
        ProcessPoolExecutor(max_workers=1, mp_context=spawn) as clients_process,
    ):
        clients_process.submit(drive, server.base_url, "warmup", 1, 1, args.max_tokens).result()
        for n in args.clients:
            server.pop_trajectories()
            server.batch_sizes.clear()
            wall_s, agents = clients_process.submit(
                drive, server.base_url, f"c{n}", n, args.requests, args.max_tokens
            ).result()
            lost, crossed, worst = check(agents, server.pop_trajectories(), decode, model_logprobs)
            latencies_ms = 1000 * np.array([s for a in agents for s in a.latencies_s] or [float("nan")])
            errors = [e for a in agents for e in a.errors]
            answered = sum(len(a.texts) for a in agents)
            rates[n] = answered / wall_s
            print(f"concurrent_{n}.requests: {answered}")
            print(f"concurrent_{n}.requests_per_s: {rates[n]:.1f}")
            print(f"concurrent_{n}.p50_ms: {np.percentile(latencies_ms, 50):.1f}")
            print(f"concurrent_{n}.p99_ms: {np.percentile(latencies_ms, 99):.1f}")
            print(f"concurrent_{n}.mean_batch: {np.mean(server.batch_sizes or [0]):.1f}")
            print(
                f"concurrent_{n}.errors: {len(errors)}"
                + (f" (first: {' '.join(errors[0].split())})" if errors else "")
            )
            print(f"concurrent_{n}.lost: {lost}")
            print(f"concurrent_{n}.crossed: {crossed}")
            print(f"concurrent_{n}.max_logprob_diff: {worst:.1e}")
            failed += len(errors) + lost + crossed
    most, fewest = max(args.clients), min(args.clients)
    print(f"concurrent_{most}_over_{fewest}.requests_per_s: {rates[most] / rates[fewest]:.2f}")
    return int(failed > 0)
