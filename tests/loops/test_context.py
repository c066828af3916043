"""What the loops share: prompt encoding (plain and chat template), SFT pairs, held-out eval."""

from __future__ import annotations

import pytest
import torch

from loopline.config import load_config
from loopline.data.datasets import PromptRow
from loopline.errors import UserError
from loopline.loops.context import build_context, encode_prompt, encode_prompts, evaluate, sync_engine
from loopline.loops.sft import sft_pair

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    from loopline.models.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_plain_prompt_is_bos_then_bytes(tokenizer):
    ids = encode_prompt(tokenizer, PromptRow(0, "12+3="), use_chat_template=True)  # no template: plain
    assert ids == [tokenizer.bos_token_id] + tokenizer("12+3=", add_special_tokens=False)["input_ids"]


def test_chat_template_gives_token_ids(chat_tokenizer):
    ids = encode_prompt(chat_tokenizer, PromptRow(0, "12+3="), use_chat_template=True)
    assert all(isinstance(i, int) for i in ids)
    expected = chat_tokenizer("<user>12+3=\n<assistant>", add_special_tokens=False)["input_ids"]
    assert ids == expected
    # not asked for: the plain text even though the tokenizer has a template
    plain = encode_prompt(chat_tokenizer, PromptRow(0, "12+3="), use_chat_template=False)
    assert plain == chat_tokenizer("12+3=")["input_ids"]


def test_chat_row_drops_the_assistant_turn_it_would_learn(chat_tokenizer):
    row = PromptRow(
        0, "", messages=({"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"})
    )
    ids = encode_prompt(chat_tokenizer, row, use_chat_template=False)  # messages always use the template
    assert chat_tokenizer.decode(ids) == "<user>2+2=\n<assistant>"


def test_encode_prompts_is_encode_prompt_of_each_row(tokenizer, chat_tokenizer):
    chat = PromptRow(2, "", messages=({"role": "user", "content": "5+5="},))
    rows = [PromptRow(0, "12+3="), PromptRow(1, "1+22222=")]
    for tok, rows_, template in [
        (tokenizer, rows, True),  # no template: plain, in one tokenizer call
        (chat_tokenizer, rows, False),
        (chat_tokenizer, rows, True),
        (chat_tokenizer, [*rows, chat], False),  # a chat row takes the template, the others not
    ]:
        assert encode_prompts(tok, rows_, template) == [encode_prompt(tok, r, template) for r in rows_]
    assert encode_prompts(tokenizer, [], True) == []
    with pytest.raises(UserError, match="chat template"):
        encode_prompts(tokenizer, [*rows, chat], False)


@pytest.fixture
def ctx(tmp_path, small_cfg):
    tiny = [f"model.tiny.{k}={v}" for k, v in small_cfg.model_dump().items()]
    cfg = load_config(
        overrides=[
            f"out_dir={tmp_path}",
            "data.task.num_train=50",
            "data.task.num_eval=6",
            "tensorboard=false",
            *tiny,
        ]
    )
    return build_context(cfg)


def test_sft_pair_targets_end_with_eos(ctx):
    tok = ctx.tokenizer
    row = ctx.train_rows[0]
    prompt, target = sft_pair(ctx, row)
    assert prompt == tok(row.prompt)["input_ids"]
    assert target == tok(row.completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # no completion: learn the answer; a chat row: learn its last assistant message
    assert sft_pair(ctx, PromptRow(0, "1+1=", answer="2"))[1] == tok("2", add_special_tokens=False)[
        "input_ids"
    ] + [2]
    with pytest.raises(ValueError, match="no completion"):
        sft_pair(ctx, PromptRow(7, "1+1="))


def test_evaluate_scores_held_out_rows_and_keeps_the_rng(ctx):
    sync_engine(ctx, version=0)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    result = evaluate(ctx)
    assert torch.equal(torch.get_rng_state(), rng)
    assert set(result) == {"eval_accuracy", "eval_reward_mean", "eval_response_len"}
    assert (
        result["eval_reward_mean"] == result["eval_accuracy"]
    )  # the addition task pays 1 exactly when correct
    assert 0 < result["eval_response_len"] <= ctx.cfg.eval.sampling.max_new_tokens
    assert evaluate(ctx) == result  # greedy: the same model gives the same score
