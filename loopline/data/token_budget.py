"""Token-budget micro-batches (`max_tokens_per_micro_batch` of sft, grpo, dpo, rm, critic): rows grouped by their
real token count so that each micro-batch's padded tokens stay within a budget.

Pure functions: `plan_micro_batches` bins row lengths first-fit decreasing; `even_out` splits bins until a rank
has as many as its peers (collectives line up); `select_rows` / `select_pairs` cut one bin out of a batch, its
padding trimmed to the bin's own longest prompt and response.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

import torch

from loopline.data.batches import TokenBatch
from loopline.data.preference import PairBatch
from loopline.errors import UserError

B = TypeVar("B", bound=TokenBatch)
FIELD = "max_tokens_per_micro_batch"


def row_lengths(batch: TokenBatch) -> tuple[list[int], list[int]]:
    """(prompt tokens, response tokens) of each row, padding left out."""
    p = batch.prompt_len
    mask = batch.attention_mask
    return mask[:, :p].sum(dim=1).tolist(), mask[:, p:].sum(dim=1).tolist()


def pair_lengths(pairs: PairBatch) -> tuple[list[int], list[int]]:
    """A pair's (prompt, response) tokens: the longer of its chosen and rejected rows' (each is its own forward)."""
    (pc, rc), (pr, rr) = row_lengths(pairs.chosen), row_lengths(pairs.rejected)
    return [max(a, b) for a, b in zip(pc, pr)], [max(a, b) for a, b in zip(rc, rr)]


def padded_tokens(prompts: list[int], responses: list[int], packed: bool = False) -> int:
    """Tokens one forward of these rows holds: rows x (longest prompt + longest response) once trimmed (at least
    one of each, as a batch lays them out); packed (model.packing): the packed length, the sum of the rows'."""
    if packed:
        return sum(prompts) + sum(responses)
    return len(prompts) * (max(1, *prompts) + max(1, *responses))


def longest_row(prompts: list[int], responses: list[int], packed: bool = False) -> int:
    """The most tokens any single row needs alone (0 for no rows): what a budget must hold at least."""
    return max((padded_tokens([p], [r], packed) for p, r in zip(prompts, responses)), default=0)


def row_over_budget(field: str, budget: int, longest: int) -> UserError:
    """The error of a row that fits no micro-batch: one line naming the field (the CLI exits 2 on it)."""
    return UserError(
        f"{field}={budget} is smaller than a row of {longest} tokens: raise it to {longest} or more"
    )


def plan_micro_batches(
    prompts: list[int], responses: list[int], budget: int, packed: bool = False, field: str = FIELD
) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most `budget` padded tokens (padded_tokens), first-fit
    decreasing: rows by total length, longest first (ties by index), each into the first bin it fits. Each bin's
    indices ascend. Deterministic; a UserError naming `field` when one row alone exceeds the budget."""
    longest = longest_row(prompts, responses, packed)
    if longest > budget:
        raise row_over_budget(field, budget, longest)
    order = sorted(range(len(prompts)), key=lambda i: (-(prompts[i] + responses[i]), i))
    bins: list[list[int]] = []
    for i in order:
        for rows in bins:
            if (
                padded_tokens([prompts[j] for j in rows + [i]], [responses[j] for j in rows + [i]], packed)
                <= budget
            ):
                rows.append(i)
                break
        else:
            bins.append([i])
    return [sorted(rows) for rows in bins]


def even_out(bins: list[list[int]], count: int) -> list[list[int]]:
    """`bins` split until there are `count` of them (so every data-parallel rank runs as many micro-batches): the
    bin with the most rows (the first of equals) halves, its first half in its place. A part of a bin stays
    within the bin's budget. ValueError when the rows cannot make `count` bins."""
    out = [list(rows) for rows in bins]
    if sum(len(rows) for rows in out) < count:
        raise ValueError(f"{sum(map(len, out))} rows cannot make {count} micro-batches")
    while len(out) < count:
        at = max(range(len(out)), key=lambda k: (len(out[k]), -k))
        rows = out[at]
        out[at : at + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return out


def select_rows(batch: B, rows: list[int]) -> B:
    """The rows `rows` of `batch` (of its own type), with the columns that are padding in every one of them cut:
    prompt columns on the left, response columns on the right. Position ids come from the attention mask, so the
    real tokens' forward is unchanged."""
    p, c = batch.prompt_len, batch.response_mask.shape[1]
    prompts, responses = row_lengths(batch)
    keep_p = max(1, *(prompts[i] for i in rows))
    keep_c = max(1, *(responses[i] for i in rows))
    index = torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device)

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.index_select(0, index)
        if value.dim() >= 2 and value.shape[1] == p + c:  # (B, P + C): tokens and attention
            return value[:, p - keep_p : p + keep_c]
        if value.dim() >= 2 and value.shape[1] == c:  # (B, C): per response token
            return value[:, :keep_c]
        return value  # (B,) per row

    return replace(batch, **{f.name: cut(getattr(batch, f.name)) for f in fields(batch)})


def select_pairs(pairs: PairBatch, rows: list[int]) -> PairBatch:
    """The pairs `rows` of `pairs`, each side's padding trimmed as select_rows does."""
    index = torch.tensor(rows, dtype=torch.long, device=pairs.margin.device)
    ref_c = None if pairs.ref_chosen is None else pairs.ref_chosen.index_select(0, index)
    ref_r = None if pairs.ref_rejected is None else pairs.ref_rejected.index_select(0, index)
    return PairBatch(
        select_rows(pairs.chosen, rows), select_rows(pairs.rejected, rows), pairs.margin.index_select(0, index),
        ref_c, ref_r,
    )  # fmt: skip
