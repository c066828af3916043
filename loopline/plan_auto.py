"""The auto settings, resolved from the config before a run starts: training.mixed_precision=auto (bf16 compute
where this CPU multiplies bf16 natively fast) and training.memory=auto (the memory switches the plan needs).

Memory: the plan (loopline.plan) of the run as configured is checked against each node's memory (or
training.memory_budget_gib) with a margin (MARGIN: the plan is calibrated to within about 25%, and other work shares
a machine). Where it fits, nothing changes. Where it does not, the switches go on in the order of their cost, each
kept only where it shrinks the plan, until it fits: chunked log-probs (model.logits_chunk_tokens: the head's
logits recomputed a chunk at a time, a few percent more compute at a large vocabulary), activation checkpointing
selective then full (a third more compute on the checkpointed layers), then token-budget micro-batches of half as
many rows each time down to one (smaller matmuls). Where even all of them do not fit, they stay on and the check
before the run says what else would shrink it.

A field the config file or an override set (pydantic's model_fields_set, kept through the loader) is never
changed, whatever its value: `training.activation_checkpointing=none` keeps it off. The built-in model's default
job fits with room to spare and under 100M parameters, so it resolves to exactly its old settings and numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from loopline import plan
from loopline.config import RunConfig
from loopline.section import given_keys, given_tree, mark_given, merge_trees

MARGIN = 0.8  # auto wants the plan at most this share of a node's memory
# model.logits_chunk_tokens auto picks: within 256-1024, where the chunking cost flattens out
CHUNK_TOKENS = 512
BF16_MIN_PARAMS = 100_000_000  # below this, auto keeps float32: the default job and the tiny test models
# bf16 matmuls at least this much faster than float32 (the probe) for auto to pick bf16
BF16_MIN_SPEEDUP = 1.5


@dataclass(frozen=True)
class Resolved:
    """A config with its auto settings resolved, and the one line that says what was chosen and why."""

    cfg: RunConfig
    line: str


def _nested(changes: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def with_changes(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig | None:
    """`cfg` with dotted `changes`, validated as a whole (None where the result is refused); the fields that were
    given stay given, and the changed ones count as given too (a resolved config resolves to itself)."""
    tree = _nested(changes)
    try:
        out = RunConfig.model_validate(merge_trees(cfg.model_dump(), tree))
    except ValidationError:
        return None
    mark_given(out, merge_trees(given_tree(cfg), tree))
    return out


# ---------------------------------------------------------------------------------------------------------
# training.mixed_precision=auto
# ---------------------------------------------------------------------------------------------------------


def _bf16_refused(cfg: RunConfig, command: str) -> str:
    """Why bf16 compute cannot or should not run here, besides the CPU ('' when nothing stops it)."""
    rt = cfg.runtime
    if cfg.model.builtin:
        return "the built-in model: its default job's numbers stay as they are"
    params = plan.model_shape(cfg).params
    if params < BF16_MIN_PARAMS:
        return (
            f"{params / 1e6:.1f}M parameters, under {BF16_MIN_PARAMS / 1e6:.0f}M: float32 costs little there"
        )
    reasons = {
        f"model.dtype={cfg.model.dtype}": cfg.model.dtype != "float32",
        "grpo.advantage=gae (the critic)": command == "train" and cfg.grpo.advantage == "gae",
        "loopline rm": command == "rm",
        f"runtime.trainer_tp={rt.trainer_tp}": rt.trainer_tp > 1,
        f"runtime.trainer_pp={rt.trainer_pp}": rt.trainer_pp > 1,
        f"runtime.trainer_ep={rt.trainer_ep}": rt.trainer_ep > 1,
    }
    return next((f"not built with {k}" for k, on in reasons.items() if on), "")


def resolve_precision(
    cfg: RunConfig, command: str, probe: dict[str, Any] | None = None
) -> tuple[RunConfig, str]:
    """training.mixed_precision=auto as bf16 or none, and why in a few words ('' where it was not auto). probe:
    the bf16 probe's result (training.bf16_probe), measured or read from its cache when needed and not given."""
    if cfg.training.mixed_precision != "auto":
        return cfg, ""
    why = _bf16_refused(cfg, command)
    choice = "none"
    if not why:
        if probe is None:
            from loopline.training.bf16_probe import probe as run_probe

            probe = run_probe()
        speedup = probe["speedup"]
        fast = speedup >= BF16_MIN_SPEEDUP
        choice = "bf16" if fast else "none"
        why = f"bf16 matmuls {speedup:.2f}x float32 on this CPU, {'at least' if fast else 'under'} {BF16_MIN_SPEEDUP}x"
    resolved = with_changes(cfg, {"training.mixed_precision": choice})
    if resolved is None:  # a combination the config refuses with bf16
        resolved, choice, why = (
            with_changes(cfg, {"training.mixed_precision": "none"}),
            "none",
            "refused with bf16",
        )
    assert resolved is not None
    return resolved, f"training.mixed_precision={choice} ({why})"


# ---------------------------------------------------------------------------------------------------------
# training.memory=auto
# ---------------------------------------------------------------------------------------------------------


def _worst(cfg: RunConfig, command: str) -> tuple[int, int, str]:
    """(planned bytes, memory auto plans against, where) of the node nearest its limit (the largest share)."""
    budget = int(cfg.training.memory_budget_gib * plan.GIB)
    worst = (0, 0, "")
    for node in plan.nodes(cfg, command):
        capacity = budget or node.capacity
        if capacity is None:
            continue
        what = "training.memory_budget_gib" if budget else node.capacity_from
        if not worst[1] or node.nbytes / capacity > worst[0] / worst[1]:
            worst = (node.nbytes, capacity, f"{node.name}, {what}")
    return worst


def _ladder(cfg: RunConfig, command: str) -> list[dict[str, Any]]:
    """The switches auto may turn on, cheapest first, skipping every field the config set."""
    given = given_keys(cfg)
    steps: list[dict[str, Any]] = []
    if "model.logits_chunk_tokens" not in given and not cfg.model.logits_chunk_tokens:
        steps.append({"model.logits_chunk_tokens": CHUNK_TOKENS})
    if "training.activation_checkpointing" not in given and cfg.training.activation_checkpointing == "none":
        steps += [
            {"training.activation_checkpointing": "selective"},
            {"training.activation_checkpointing": "full"},
        ]
    if cfg.runtime.trainer_pp > 1:  # the pipeline runs micro-batches of one shape: no token budget
        return steps
    shape = plan.model_shape(cfg)
    free = [
        p
        for p in plan.phases(cfg, command, shape)
        if not {f"{p.name}.micro_batch_size", f"{p.name}.max_tokens_per_micro_batch"} & given
        and not getattr(cfg, p.name).max_tokens_per_micro_batch
    ]
    if not free:
        return steps
    # the phase whose step holds the most: the others' micro-batches do not set the peak
    top = max(free, key=lambda p: sum(t.nbytes for t in plan.trainer_terms(cfg, shape, p)))
    rows = top.micro_rows
    while rows > 1:  # its micro-batch halved, as a budget of its longest row's tokens
        rows //= 2
        steps.append({f"{top.name}.max_tokens_per_micro_batch": rows * top.seq})
    return steps


def _gib(n: float) -> str:
    return f"{n / plan.GIB:.2f} GiB"


def resolve_memory(cfg: RunConfig, command: str) -> tuple[RunConfig, str]:
    """training.memory=auto: the switches (model.logits_chunk_tokens, training.activation_checkpointing, token
    budgets) the run needs to fit its nodes with MARGIN, none where it fits; and why in a few words."""
    if cfg.training.memory != "auto":
        return cfg, ""
    need, capacity, where = _worst(cfg, command)
    if not capacity:
        return cfg, "training.memory=auto: no node's memory is declared, so no switch"
    limit = int(MARGIN * capacity)
    head = f"training.memory=auto: the plan needs {_gib(need)} of {_gib(capacity)} ({where})"
    if need <= limit:
        return cfg, f"{head}, within {MARGIN:.0%}: no memory switch"
    chosen: dict[str, Any] = {}
    for step in _ladder(cfg, command):
        trial = with_changes(cfg, {**chosen, **step})
        if trial is None:
            continue
        trial_need = _worst(trial, command)[0]
        if trial_need < need:
            chosen, need = {**chosen, **step}, trial_need
        if need <= limit:
            break
    out = with_changes(cfg, chosen) if chosen else cfg
    assert out is not None
    picked = (
        ", ".join(f"{k}={v}" for k, v in chosen.items()) or "nothing (every switch that shrinks it is set)"
    )
    fits = "fits" if need <= limit else f"still over {MARGIN:.0%}: `loopline plan` shows the largest terms"
    return out, f"{head}, over {MARGIN:.0%}: chose {picked} ({_gib(need)}, {fits})"


def resolve(cfg: RunConfig, command: str, probe: dict[str, Any] | None = None) -> Resolved:
    """Every auto setting of `cfg` for `command` (train, sft, dpo, rm), bf16 first (it changes the plan), and
    the line to print: `loopline: auto: ...`."""
    cfg, precision = resolve_precision(cfg, command, probe)
    cfg, memory = resolve_memory(cfg, command)
    said = "; ".join(part for part in (memory, precision) if part)
    return Resolved(cfg, f"loopline: auto: {said}" if said else "")
