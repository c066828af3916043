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

`EnvSteps` decides where the envs step: `WorkerEnvs` on the env workers (the RL loop: runtime.scorer replays each
episode's history there, envs.episodes), `LocalEnvs` as Env objects in this process (tests, small tools).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Sequence
from typing import Literal, Protocol, TypeVar

import torch
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from loopline.data.batches import TokenBatch, collate
from loopline.data.datasets import PromptRow
from loopline.data.transcripts import transcript_turns
from loopline.envs.base import Env, StepResult
from loopline.rollout.engine import Engine, SamplingParams
from loopline.rollout.trajectory import Trajectory
from loopline.section import Section

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


class EnvSteps(Protocol):
    """Where a rollout's envs step: every episode is reset once, then the active ones step with their new action."""

    def reset(self, samples: Sequence[PromptRow]) -> list[str]:
        """Start one episode per sample; the first observations."""
        ...

    def step(self, indices: list[int], actions: list[str]) -> list[StepResult | None]:
        """Step episodes `indices` with one action each; None where that episode's env failed (it ends)."""
        ...


async def _gather(aws: Iterable[Awaitable[T]]) -> list[T]:
    return list(await asyncio.gather(*aws))


class LocalEnvs:
    """Env objects in this process, one per episode, stepped concurrently on one event loop. An env that raises
    ends its own episode (logged, finish 'env_error'), not the rollout."""

    def __init__(self, envs: Sequence[Env]) -> None:
        self.envs = list(envs)

    def reset(self, samples: Sequence[PromptRow]) -> list[str]:
        if len(self.envs) != len(samples):
            raise ValueError(f"{len(self.envs)} envs for {len(samples)} samples: give one env per trajectory")
        self.samples = list(samples)
        # one loop for the whole rollout: envs may hold loop-bound state from reset to their last step
        self._loop = asyncio.new_event_loop()
        return list(self._loop.run_until_complete(_gather(e.reset(s) for e, s in zip(self.envs, samples))))

    def step(self, indices: list[int], actions: list[str]) -> list[StepResult | None]:
        return self._loop.run_until_complete(_gather(self._step(i, a) for i, a in zip(indices, actions)))

    async def _step(self, i: int, action: str) -> StepResult | None:
        try:
            return await self.envs[i].step(action)
        except Exception:
            logger.exception("env step failed on sample %s; ending that trajectory", self.samples[i].index)
            return None

    def close(self) -> None:
        if hasattr(self, "_loop"):
            self._loop.close()


class Stepper(Protocol):
    """runtime.protocols.Scorer's step: histories in, last results out (on the env workers)."""

    def step(self, rows: list[PromptRow], actions: list[list[str]]) -> list[StepResult]: ...


class WorkerEnvs:
    """Episodes on the env workers: each turn sends every active episode's row and whole history to `scorer`,
    whose workers replay it on a fresh env (envs.episodes). An env that misbehaves fails the call (EnvError)."""

    def __init__(self, scorer: Stepper) -> None:
        self.scorer = scorer

    def reset(self, samples: Sequence[PromptRow]) -> list[str]:
        self.rows = list(samples)
        self.actions: list[list[str]] = [[] for _ in self.rows]
        return [r.observation for r in self.scorer.step(self.rows, self.actions)]

    def step(self, indices: list[int], actions: list[str]) -> list[StepResult | None]:
        for i, action in zip(indices, actions, strict=True):
            self.actions[i].append(action)
        return list(
            self.scorer.step([self.rows[i] for i in indices], [list(self.actions[i]) for i in indices])
        )


def run_rollout(
    engine: Engine,
    envs: Sequence[Env] | EnvSteps,
    samples: Sequence[PromptRow],
    fmt: TurnFormat,
    cfg: MultiTurnConfig,
    seed: int | None = None,
) -> list[Trajectory]:
    """Run one episode per sample to the end; trajectories come back in input order. envs: one Env per sample
    (stepped here, LocalEnvs), or where they step (WorkerEnvs)."""
    steps = LocalEnvs(envs) if isinstance(envs, Sequence) else envs
    try:
        return _rollout(engine, steps, samples, fmt, cfg, seed)
    finally:
        if isinstance(steps, LocalEnvs):
            steps.close()


def _rollout(
    engine: Engine,
    envs: EnvSteps,
    samples: Sequence[PromptRow],
    fmt: TurnFormat,
    cfg: MultiTurnConfig,
    seed: int | None,
) -> list[Trajectory]:
    first = envs.reset(samples)
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
            versions[i].update(c.token_versions[:budget] or [c.policy_version])
        actions = [fmt.action_text(turns[i]) for i in active]

        # 2. Every env steps at once (tools, sandboxes and services overlap their waits).
        results = envs.step(active, actions)

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
        traj.partial = len(seen) > 1
    return trajs


def demonstrations(
    envs: Sequence[Env] | EnvSteps,
    samples: Sequence[PromptRow],
    actions: Sequence[Sequence[str]],
    fmt: TurnFormat,
    tokenizer: PreTrainedTokenizerBase,
) -> list[Trajectory]:
    """Trajectories from given action texts (e.g. SFT demonstrations): the envs answer them for real.

    The actions are tokenized here (they are text, not samples); the log-probs are left at 0."""
    steps = LocalEnvs(envs) if isinstance(envs, Sequence) else envs
    try:
        trajs = [Trajectory(s, fmt.prompt_ids(obs)) for s, obs in zip(samples, steps.reset(samples))]
        for turn in range(max((len(a) for a in actions), default=0)):
            active = [i for i, t in enumerate(trajs) if not t.done and turn < len(actions[i])]
            if not active:
                break
            ids = {
                i: list(tokenizer(actions[i][turn], add_special_tokens=False)["input_ids"]) for i in active
            }
            for i in active:
                trajs[i].add_model_turn(ids[i], [0.0] * len(ids[i]))
            for i, result in zip(active, steps.step(active, [actions[i][turn] for i in active])):
                traj = trajs[i]
                if result is None:
                    raise ValueError(f"the env failed on demonstration {samples[i].index}")
                traj.record(result.reward, result.info)
                if result.done:
                    traj.finish = "done"
                elif turn + 1 < len(actions[i]):
                    traj.add_observation(fmt.observation_ids(result.observation, ids[i]))
                else:
                    traj.finish = "max_turns"  # the demonstration ends before the env does
        return trajs
    finally:
        if isinstance(steps, LocalEnvs):
            steps.close()


def transcript_trajectory(row: PromptRow, fmt: TurnFormat, tokenizer: PreTrainedTokenizerBase) -> Trajectory:
    """The episode a transcript row records (data.transcripts), as the rollout would have built it: the first
    observation through `fmt.prompt_ids`, each assistant message's text as one model turn (mask 1), each observation
    through `fmt.observation_ids` (mask 0). The last model turn ends with EOS, so the model learns to stop; the
    log-probs are left at 0."""
    episode = transcript_turns(row.messages)
    traj = Trajectory(row, fmt.prompt_ids(episode.first))
    for action, observation in episode.turns:
        ids = list(tokenizer(action, add_special_tokens=False)["input_ids"])
        if observation is None and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        traj.add_model_turn(ids, [0.0] * len(ids))
        if observation is not None:
            traj.add_observation(fmt.observation_ids(observation, ids))
    traj.finish = "done"
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
