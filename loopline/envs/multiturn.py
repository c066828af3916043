"""Multi-turn rollouts: engine generation interleaved with env steps, one token sequence per trajectory.

Each turn, every trajectory still active is extended in ONE batched `engine.generate` call (its
prompt plus everything so far is the prefix), then all their envs step concurrently. A trajectory is

    prompt ids | model turn 1 | observation 1 | model turn 2 | observation 2 | ... | model turn k
                 mask 1         mask 0          mask 1         mask 0                 mask 1

Tokens in, tokens out: the model's tokens are appended exactly as sampled (never decoded and
re-encoded), with the engine's log-probs; only observation text is tokenized. So the sequence the
trainer sees is the one the engine produced, and its log-probs line up token for token.

Limits (MultiTurnConfig): a trajectory ends when its env says done, after `max_turns` model turns,
or when its response (model and observation tokens) would pass `max_total_tokens`; each model turn
samples at most `max_turn_tokens`. The return is the sum of the per-turn rewards, or the last one.

`TurnFormat` decides how observations become tokens: `PlainFormat` appends the text as it is (the
built-in byte model), `ChatFormat` wraps each in the tokenizer's chat template as a tool message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Literal, Protocol

import torch
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from loopline.data.batches import TokenBatch, collate
from loopline.data.datasets import PromptRow
from loopline.envs.base import Env, StepResult
from loopline.rollout.engine import Engine, SamplingParams
from loopline.rollout.trajectory import Trajectory
from loopline.section import Section

logger = logging.getLogger(__name__)


class MultiTurnConfig(Section):
    """Limits and sampling of multi-turn rollouts."""

    max_turns: int = Field(4, gt=0, description="Model turns per trajectory at most.")
    max_turn_tokens: int = Field(64, gt=0, description="Tokens the model may sample in one turn.")
    max_total_tokens: int = Field(
        256, gt=0, description="Response tokens per trajectory (model and observation) at most."
    )
    returns: Literal["sum", "final"] = Field(
        "sum", description="Trajectory return: sum of the per-turn rewards, or the last turn's reward."
    )
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    stop: list[str] = Field(default_factory=list, description="Stop strings that end a model turn (kept).")


# ---------------------------------------------------------------------------------------------
# Observation text -> tokens
# ---------------------------------------------------------------------------------------------


class TurnFormat(Protocol):
    """Text <-> tokens for a rollout: the first observation into a prompt, later ones into a
    continuation after a model turn, and a model turn's tokens into the action text the env reads."""

    def prompt_ids(self, observation: str) -> list[int]: ...

    def observation_ids(self, observation: str, model_turn: Sequence[int]) -> list[int]: ...

    def action_text(self, model_turn: Sequence[int]) -> str: ...


class PlainFormat:
    """Text as it is: the prompt is encoded with the tokenizer's specials, observations without."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, observation: str) -> list[int]:
        return list(self.tokenizer(observation)["input_ids"])

    def observation_ids(self, observation: str, model_turn: Sequence[int]) -> list[int]:
        return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])

    def action_text(self, model_turn: Sequence[int]) -> str:
        return self.tokenizer.decode(list(model_turn), skip_special_tokens=True)


class ChatFormat:
    """The tokenizer's chat template: the prompt is a user message, each observation a `role` message.

    The text between an assistant message and the next generation prompt is read off the template
    once, by rendering placeholder messages. When the model ended its turn with EOS and the template
    closes assistant messages with that same token, it is not added a second time.
    """

    _A, _O = "\x00ASSISTANT\x00", "\x00OBSERVATION\x00"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, role: str = "tool", system: str = "") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatFormat needs a tokenizer with a chat template; use PlainFormat")
        self.tokenizer, self.role, self.system = tokenizer, role, system
        head = self._messages("u")
        rendered = tokenizer.apply_chat_template(
            [*head, {"role": "assistant", "content": self._A}, {"role": role, "content": self._O}],
            add_generation_prompt=True,
            tokenize=False,
        )
        after = rendered.split(self._A, 1)[1]
        self._close, self._open_next = after.split(self._O, 1)[0], after.split(self._O, 1)[1]
        self._eos = tokenizer.eos_token or ""

    def _messages(self, user: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": user}]

    def prompt_ids(self, observation: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            self._messages(observation), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def observation_ids(self, observation: str, model_turn: Sequence[int]) -> list[int]:
        close = self._close
        ended_with_eos = bool(model_turn) and model_turn[-1] == self.tokenizer.eos_token_id
        if ended_with_eos and self._eos and close.startswith(self._eos):
            close = close[len(self._eos) :]
        text = close + observation + self._open_next
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def action_text(self, model_turn: Sequence[int]) -> str:
        return self.tokenizer.decode(list(model_turn), skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# The driver (Trajectory, the record it fills, is rollout.trajectory's)
# ---------------------------------------------------------------------------------------------


def _sampling(cfg: MultiTurnConfig, max_new_tokens: int, seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        stop=tuple(cfg.stop),
        seed=seed,
    )


async def _step(env: Env, action: str, traj: Trajectory) -> StepResult | None:
    """env.step, with a failing env ending its own trajectory instead of the whole rollout."""
    try:
        return await env.step(action)
    except Exception:
        logger.exception("env step failed on sample %s; ending that trajectory", traj.sample.index)
        return None


async def rollout(
    engine: Engine,
    envs: Sequence[Env],
    samples: Sequence[PromptRow],
    fmt: TurnFormat,
    cfg: MultiTurnConfig,
    seed: int | None = None,
) -> list[Trajectory]:
    """Run one episode per (env, sample) pair to the end; trajectories come back in input order."""
    if len(envs) != len(samples):
        raise ValueError(f"{len(envs)} envs for {len(samples)} samples: give one env per trajectory")
    first = await asyncio.gather(*(env.reset(s) for env, s in zip(envs, samples)))
    trajs = [Trajectory(s, fmt.prompt_ids(obs)) for s, obs in zip(samples, first)]
    versions: list[set[int]] = [set() for _ in trajs]
    turn = 0
    while active := [i for i, t in enumerate(trajs) if not t.done]:
        # 1. One batched generation for every active trajectory, each up to its own budget.
        budgets = [min(cfg.max_turn_tokens, cfg.max_total_tokens - len(trajs[i].tokens)) for i in active]
        turn_seed = None if seed is None else seed + turn
        completions = engine.generate(
            [trajs[i].prompt_ids + trajs[i].tokens for i in active], _sampling(cfg, max(budgets), turn_seed)
        )
        turns: dict[int, list[int]] = {}
        for i, budget, c in zip(active, budgets, completions):
            # sampling a longer batch and cutting at this row's budget is a sample of that budget
            turns[i] = c.token_ids[:budget]
            trajs[i].add_model_turn(turns[i], c.logprobs[:budget])
            versions[i].add(c.policy_version)
        actions = [fmt.action_text(turns[i]) for i in active]

        # 2. Every env steps at once (tools, sandboxes and services overlap their waits).
        results = await asyncio.gather(*(_step(envs[i], a, trajs[i]) for i, a in zip(active, actions)))

        # 3. Record rewards; end trajectories or append their observation tokens.
        for i, result in zip(active, results):
            traj = trajs[i]
            if result is None:
                traj.rewards.append(0.0)
                traj.info["env_error"] = 1
                traj.finish = "env_error"
                continue
            traj.record(result.reward, result.info)
            if result.done:
                traj.finish = "done"
            elif traj.turns >= cfg.max_turns:
                traj.finish = "max_turns"
            else:
                obs = fmt.observation_ids(result.observation, turns[i])
                # the next turn needs at least one token of room after the observation
                if len(traj.tokens) + len(obs) >= cfg.max_total_tokens:
                    traj.finish = "max_tokens"
                else:
                    traj.add_observation(obs)
        turn += 1
    for traj, seen in zip(trajs, versions):
        traj.policy_version = min(seen) if seen else 0
    return trajs


def run_rollout(
    engine: Engine,
    envs: Sequence[Env],
    samples: Sequence[PromptRow],
    fmt: TurnFormat,
    cfg: MultiTurnConfig,
    seed: int | None = None,
) -> list[Trajectory]:
    """`rollout` from synchronous code (starts and ends an event loop)."""
    return asyncio.run(rollout(engine, envs, samples, fmt, cfg, seed))


async def scripted(
    env: Env, sample: PromptRow, actions: Sequence[str], fmt: TurnFormat, tokenizer: PreTrainedTokenizerBase
) -> Trajectory:
    """A trajectory from given action texts (e.g. SFT demonstrations): the env answers them for real.

    The actions are tokenized here (they are text, not samples); the log-probs are left at 0."""
    traj = Trajectory(sample, fmt.prompt_ids(await env.reset(sample)))
    for n, action in enumerate(actions):
        ids = list(tokenizer(action, add_special_tokens=False)["input_ids"])
        traj.add_model_turn(ids, [0.0] * len(ids))
        result = await env.step(action)
        traj.record(result.reward, result.info)
        if result.done:
            traj.finish = "done"
            break
        if n + 1 < len(actions):
            traj.add_observation(fmt.observation_ids(result.observation, ids))
    return traj


# ---------------------------------------------------------------------------------------------
# To a training batch
# ---------------------------------------------------------------------------------------------


def to_batch(trajs: Sequence[Trajectory], pad_id: int) -> tuple[TokenBatch, torch.Tensor]:
    """TokenBatch (prompt = first observation, response = the rest, mask 1 on model tokens only)
    and the engine's log-probs aligned to its response columns, (B, C), 0 off the mask."""
    tokens = collate([t.prompt_ids for t in trajs], [t.tokens for t in trajs], pad_id)
    width = tokens.response_mask.shape[1]
    mask = torch.zeros((len(trajs), width), dtype=torch.float32)  # (B, C)
    logprobs = torch.zeros((len(trajs), width), dtype=torch.float32)  # (B, C)
    for row, t in enumerate(trajs):
        mask[row, : len(t.mask)] = torch.tensor(t.mask, dtype=torch.float32)
        logprobs[row, : len(t.logprobs)] = torch.tensor(t.logprobs, dtype=torch.float32)
    return TokenBatch(tokens.input_ids, tokens.attention_mask, mask), logprobs * mask


def rollout_metrics(
    trajs: Sequence[Trajectory], returns: Literal["sum", "final"] = "sum"
) -> dict[str, float]:
    """Means over trajectories: return, turns, token counts, how they ended, and every numeric info key."""
    n = max(1, len(trajs))
    out: dict[str, float] = {
        "return_mean": sum(t.total_return(returns) for t in trajs) / n,
        "turns_mean": sum(t.turns for t in trajs) / n,
        "model_tokens_mean": sum(sum(t.mask) for t in trajs) / n,
        "response_tokens_mean": sum(len(t.tokens) for t in trajs) / n,
    }
    for finish in ("done", "max_turns", "max_tokens", "env_error"):
        out[f"finish_{finish}"] = sum(t.finish == finish for t in trajs) / n
    keys = sorted({k for t in trajs for k, v in t.info.items() if isinstance(v, int | float)})
    for key in keys:
        out[key] = sum(float(t.info.get(key, 0)) for t in trajs) / n
    return out
