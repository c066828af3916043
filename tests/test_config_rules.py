"""Settings that another setting makes meaningless (loopline.config_rules): each rule refuses or warns, naming both
fields; a config without such a pair passes every rule in silence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopline import config_rules
from loopline.cli import main
from loopline.config import ConfigError, load_config

TINY = [
    "sft.steps=1", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "data.task.num_train=64", "data.task.num_eval=8", "eval.num_prompts=8",
    "progress=false", "tensorboard=false", "threads=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip


def _check(*overrides: str, command: str = "train") -> list[str]:
    return config_rules.check(load_config(overrides=list(overrides)), command)


def test_the_defaults_and_the_agent_example_pass_every_rule():
    from loopline.cli import AGENT

    assert _check() == []
    assert _check(*AGENT) == []
    assert _check(*TINY) == []  # the tiny model's shape, on the tiny model: nothing to say


@pytest.mark.parametrize(
    "overrides,command,names",
    [
        # was: trains on the built-in addition task without a word
        (
            ["data.train_path=rows.jsonl"],
            "train",
            ["data.train_path=rows.jsonl", "data.source", "data.source=jsonl"],
        ),
        (["data.eval_path=rows.jsonl"], "eval", ["data.eval_path", "data.source"]),
        (["preference.train_path=p.jsonl"], "dpo", ["preference.train_path", "preference.source=jsonl"]),
        (["model.use_chat_template=true"], "train", ["model.use_chat_template=true", "model.path"]),
        (["reward.model_path=rm"], "train", ["reward.model_path=rm", "reward.source"]),
        # the built-in rows: 9 prompt tokens (bos, '007+420='), 6 of SFT target ('0427\n', eos), 8 new tokens
        (["sft.max_tokens_per_micro_batch=14"], "sft", ["sft.max_tokens_per_micro_batch=14", "15 tokens"]),
        (
            ["grpo.max_tokens_per_micro_batch=16"],
            "train",
            ["grpo.max_tokens_per_micro_batch=16", "17 tokens"],
        ),
        (["rm.max_tokens_per_micro_batch=8"], "rm", ["rm.max_tokens_per_micro_batch=8", "15 tokens"]),
        (
            [
                "data.source=jsonl",
                "data.train_path=r.jsonl",
                "data.max_prompt_tokens=100",
                "critic.max_tokens_per_micro_batch=64",
                "grpo.advantage=gae",
            ],
            "train",
            ["critic.max_tokens_per_micro_batch=64", "108 tokens"],
        ),  # fmt: skip
        (
            [
                "runtime.backend=ray",
                "runtime.trainer_ranks=2",
                "runtime.trainer_pp=2",
                "sft.max_tokens_per_micro_batch=64",
            ],
            "sft",
            ["sft.max_tokens_per_micro_batch=64", "runtime.trainer_pp=2"],
        ),  # fmt: skip
    ],
)
def test_refused_pairs_name_both_fields(overrides, command, names):
    with pytest.raises(ConfigError) as err:
        _check(*overrides, command=command)
    assert "\n" not in str(err.value)
    for name in names:
        assert name in str(err.value)


def test_the_refused_pairs_pass_once_the_other_field_agrees():
    assert _check("data.source=jsonl", "data.train_path=rows.jsonl") == []
    assert _check("preference.source=jsonl", "preference.train_path=p.jsonl", command="dpo") == []
    assert _check("model.path=m", "model.use_chat_template=true") == []  # the tokenizer is checked at start
    assert _check("reward.source=model", "reward.model_path=rm") == []
    assert _check("reward.model_path=rm", command="sft") == []  # sft scores no rewards: nothing is ignored
    assert _check("sft.max_tokens_per_micro_batch=15", "grpo.max_tokens_per_micro_batch=17") == []
    assert _check("dpo.max_tokens_per_micro_batch=8", command="rm") == []  # rm trains no DPO step
    assert (
        _check("data.source=jsonl", "data.train_path=r.jsonl", "grpo.max_tokens_per_micro_batch=8") == []
    )  # unknown


@pytest.mark.parametrize(
    "overrides,command,names",
    [
        (["model.path=m", "model.tiny.num_layers=2"], "train", ["model.tiny.num_layers", "model.path=m"]),
        (
            ["data.source=jsonl", "data.train_path=r", "data.task.max_digits=5"],
            "train",
            ["data.task.max_digits"],
        ),
        (
            ["rollout.vllm.memory_fraction=0.5"],
            "train",
            ["rollout.vllm.memory_fraction", "rollout.engine=torch"],
        ),
        (["critic.optim.lr=0.1"], "train", ["critic.optim.lr", "grpo.advantage=gae"]),
        (["model.lora.alpha=32"], "train", ["model.lora.alpha", "model.lora.r=0"]),
        (
            ["data.source=jsonl", "data.train_path=r", "sft.stop_at_accuracy=0.5"],
            "train",
            ["sft.stop_at_accuracy", "data.source=jsonl"],
        ),
    ],
)
def test_warned_pairs_name_both_fields(overrides, command, names):
    (warning,) = _check(*overrides, command=command)
    for name in names:
        assert name in warning


def test_every_rule_is_tested():
    tested = {
        "data_path_without_source", "preference_path_without_source", "chat_template_on_the_builtin_model",
        "reward_model_with_the_verifier", "tiny_shape_with_a_model", "task_with_a_file_source",
        "vllm_with_the_torch_engine", "critic_without_gae", "lora_settings_without_a_rank",
        "stop_at_accuracy_without_a_validation_split", "token_budget_under_a_row", "token_budget_with_the_pipeline",
    }  # fmt: skip
    assert {rule.name for rule in config_rules.RULES} == tested


def test_cli_refuses_before_torch_and_warns_in_one_line(tmp_path, capsys):
    assert main(["train", "data.train_path=rows.jsonl", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopline: bad config: data.train_path=rows.jsonl") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
    assert main(["config", "data.train_path=rows.jsonl"]) == 0  # `loopline config` shows any config
    capsys.readouterr()


@pytest.mark.parametrize(
    "override,message",
    [
        ("grpo.max_tokens_per_micro_batch=-1", "grpo.max_tokens_per_micro_batch"),
        (
            "sft.max_tokens_per_micro_batch=3",
            "sft.max_tokens_per_micro_batch=3 is smaller than the longest row",
        ),
    ],
)
def test_cli_refuses_a_bad_token_budget_in_one_line(tmp_path, capsys, override, message):
    assert main(["train", override, f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_targets_longer_than_the_generation_budget_are_warned():
    cfg = load_config(overrides=["grpo.sampling.max_new_tokens=4"])
    warning = config_rules.targets_fit(cfg, [3, 5, 6, 6])
    assert "grpo.sampling.max_new_tokens=4 cut 3 of 4 SFT targets" in warning
    assert "up to 6 tokens, median 5.5" in warning and "eval.sampling" not in warning
    assert config_rules.targets_fit(cfg, [3, 4]) == ""
    multi = load_config(overrides=["env.name=calculator", "grpo.sampling.max_new_tokens=4"])
    assert config_rules.targets_fit(multi, [9]) == ""  # per turn: episodes have their own budget


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    """The tiny model saved as a Hugging Face directory; its tokenizer has no chat template."""
    from loopline.models import load_policy

    path = tmp_path_factory.mktemp("plain") / "model"
    model, tokenizer = load_policy(load_config(None, [t for t in TINY if t.startswith("model.")]).model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_start_checks_the_tokenizer_and_the_targets(tmp_path, plain_model, capsys):
    # was: model.use_chat_template=true silently ignored
    args = ["eval", *TINY, f"model.path={plain_model}"]
    assert main([*args, "model.use_chat_template=true"]) == 2
    err = capsys.readouterr().err
    assert f"model.use_chat_template=true but the tokenizer of model.path '{plain_model}'" in err
    # was: every answer cut at 8 tokens (eval response length 8.0) without a word
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": "x" * 12}) + "\n" for i in range(8)))
    assert main([*args, "data.source=jsonl", f"data.train_path={rows}", f"data.eval_path={rows}"]) == 0
    err = capsys.readouterr().err
    assert "grpo.sampling.max_new_tokens=8 and eval.sampling.max_new_tokens=8 cut 8 of 8 SFT targets" in err
    assert "up to 13 tokens" in err  # 12 bytes and the EOS
