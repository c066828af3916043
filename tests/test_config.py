"""Config: YAML + dotted overrides, errors that name the dotted key, partial sections keep defaults."""

from __future__ import annotations

import pytest

from loopline.config import ConfigError, RunConfig, describe, load_config, parse_overrides, save_config


def test_defaults_load_without_a_file():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.eval.sampling.temperature == 0.0  # eval is greedy by default


@pytest.mark.parametrize(
    "override,key",
    [("grpo.stepz=1", "grpo.stepz"), ("model.tiny.widht=3", "model.tiny.widht"), ("nope=1", "nope")],
)
def test_unknown_key_names_the_dotted_key(override, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    "override,key,hint",
    [
        ("grpo.group_size=1", "grpo.group_size", "greater than 1"),
        ("grpo.loss_agg=sum", "grpo.loss_agg", "seq_mean"),
        ("sft.steps=abc", "sft.steps", "integer"),
        ("grpo.sampling.top_p=1.5", "grpo.sampling.top_p", "less than or equal to 1"),
        ("model.tiny.num_heads=3", "model.tiny.num_heads", "divisible by num_heads"),
        ("runtime.trainer_tp=2", "runtime.trainer_tp", "trainer_ranks=1 must be divisible by trainer_tp=2"),
        ("data.task.min_digits=4", "data.task.min_digits", "min_digits"),
        ("seed.x=1", "seed", "integer"),
        (
            "runtime.engine_max_rows=4",
            "runtime.engine_max_rows",
            "runtime.engine_max_rows (4) must hold one prompt's grpo.group_size",
        ),
        ("runtime.engine_max_rows=-1", "runtime.engine_max_rows", "greater than or equal to 0"),
        ("model.packing=maybe", "model.packing", "valid boolean"),
        ("runtime.restart_scope=rank", "runtime.restart_scope", "'role' or 'all'"),
        ("runtime.trainer_standby=true", "runtime.trainer_standby", "trainer_standby=true needs backend=ray"),
        ("runtime.trainer_warm=true", "runtime.trainer_warm", "trainer_warm=true needs backend=ray"),
    ],
)
def test_bad_value_names_the_key_and_the_rule(override, key, hint):
    """A check across fields (a section's, or RunConfig's across sections) names the field it is about, the one
    the user set among those its message names, never the section or '<root>' alone."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert f"config key '{key}':" in str(err.value)
    assert hint in str(err.value)
    assert "<root>" not in str(err.value) and "Value error" not in str(err.value)


def test_a_cross_field_error_names_the_field_the_user_set(tmp_path):
    """The same check named by what was set, in a file or as an override: hidden_size (the first field its message
    names) when it was set, num_heads when that was."""
    (tmp_path / "heads.yaml").write_text("model:\n  tiny:\n    num_heads: 3\n")
    with pytest.raises(ConfigError, match=r"^config key 'model.tiny.num_heads': hidden_size \(128\)"):
        load_config(tmp_path / "heads.yaml")
    with pytest.raises(ConfigError, match=r"^config key 'model.tiny.hidden_size': hidden_size \(130\)"):
        load_config(overrides=["model.tiny.hidden_size=130"])
    with pytest.raises(
        ConfigError, match=r"^config key 'runtime.engine_max_rows': runtime.engine_max_rows \(4\)"
    ):
        load_config(overrides=["grpo.group_size=8", "runtime.engine_max_rows=4"])


@pytest.mark.parametrize(
    "overrides,hint",
    [
        (["runtime.trainer_replicas=2"], "trainer_replicas=2 needs backend=ray"),
        (["runtime.trainer_replicas=0"], "greater than 0"),
        (
            ["runtime.backend=ray", "runtime.trainer_ranks=3", "runtime.trainer_replicas=2"],
            "trainer_ranks=3 must be divisible by trainer_replicas * trainer_tp = 2 * 1",
        ),
        (
            [
                "runtime.backend=ray",
                "runtime.trainer_ranks=4",
                "runtime.trainer_replicas=2",
                "runtime.trainer_pp=2",
            ],
            "replicas of a pipelined trainer are not built",
        ),
    ],
)
def test_trainer_replicas_that_cannot_be_laid_out_are_refused(overrides, hint):
    with pytest.raises(ConfigError, match="runtime") as err:
        load_config(overrides=overrides)
    assert hint in str(err.value)


def test_a_trainer_rank_has_one_kind_of_spare():
    spares = ["runtime.backend=ray", "runtime.trainer_standby=true", "runtime.trainer_warm=true"]
    with pytest.raises(ConfigError, match="a rank has one spare, built .standby. or a warm process"):
        load_config(overrides=spares)


@pytest.mark.parametrize(
    "overrides,warm",
    [
        ([], False),  # local
        (["runtime.backend=ray"], False),  # no restarts: nothing would use them
        (["runtime.backend=ray", "runtime.max_restarts=1"], True),  # a per-role restart builds its ranks there
        (["runtime.backend=ray", "runtime.max_restarts=1", "runtime.restart_scope=all"], False),
        (
            ["runtime.backend=ray", "runtime.max_restarts=1", "runtime.restart_scope=all", "runtime.trainer_ranks=2",
             "runtime.trainer_replicas=2"],
            True,
        ),  # a heal builds the lost rank there
        (["runtime.backend=ray", "runtime.max_restarts=1", "runtime.trainer_standby=true"], False),  # built spares
        (["runtime.backend=ray", "runtime.max_restarts=1", "runtime.trainer_warm=false"], False),
        (["runtime.backend=ray", "runtime.trainer_warm=true"], True),
        (
            ["runtime.backend=ray", "runtime.max_restarts=1",
             "runtime.placement.pools=[{name: gpu, bundles: 1, resources: {CPU: 1, GPU: 1}}, "
             "{name: cpu, bundles: 2, resources: {CPU: 1}}]",
             "runtime.placement.roles={actor: gpu, rollout: cpu, env: cpu}"],
            False,
        ),  # a spare could not see the pool's GPUs
    ],
)  # fmt: skip
def test_warm_processes_are_on_by_default_where_a_rank_is_replaced_alone(overrides, warm):
    assert load_config(overrides=overrides).runtime.warm_processes() is warm


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["grpo.stepz=1", "sft.steps=-1"])
    assert "grpo.stepz" in str(err.value) and "sft.steps" in str(err.value)


def test_yaml_file_and_overrides_merge(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\ngrpo:\n  steps: 11\n  group_size: 4\n  sampling:\n    stop: [\"\\n\", '###']\n")
    cfg = load_config(path, ["grpo.steps=3", "grpo.optim.lr=1e-3", "out_dir=/tmp/x"])
    assert cfg.seed == 7  # file only
    assert cfg.grpo.group_size == 4  # file only
    assert cfg.grpo.steps == 3  # the override wins over the file
    assert cfg.grpo.sampling.stop == ["\n", "###"]  # a list from YAML
    assert cfg.grpo.optim.lr == pytest.approx(1e-3)  # "1e-3"-style text is a float
    assert cfg.out_dir == "/tmp/x"
    assert cfg.sft == RunConfig().sft  # untouched sections keep their defaults


def test_a_partial_section_keeps_its_own_defaults(tmp_path):
    # SFT's optimizer defaults differ from OptimConfig's (cosine, 30 warmup steps), and eval samples
    # greedily unlike SamplingConfig's default: overriding one field must not reset the others.
    cfg = load_config(
        overrides=["sft.optim.lr=0.01", "eval.sampling.max_new_tokens=16", "grpo.optim.lr=1e-3"]
    )
    default = RunConfig()
    assert cfg.sft.optim.lr == 0.01
    assert cfg.sft.optim.model_dump(exclude={"lr"}) == default.sft.optim.model_dump(exclude={"lr"})
    assert cfg.eval.sampling.max_new_tokens == 16
    assert cfg.eval.sampling.temperature == default.eval.sampling.temperature == 0.0
    assert cfg.grpo.optim.warmup_steps == default.grpo.optim.warmup_steps
    # the same through a YAML file
    path = tmp_path / "run.yaml"
    path.write_text("eval:\n  sampling:\n    max_new_tokens: 4\n")
    assert load_config(path).eval.sampling.temperature == 0.0


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_config(bad)
    assert "\n" not in str(e.value) and "line 2, column 1" in str(e.value)  # one line, where it went wrong
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"grpo:\n  steps: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not text \\(UTF-8\\): byte 15 is 0xff"):
        load_config(binary)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("grpo:\n  stepz: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'grpo.stepz'"):
        load_config(unknown)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_overrides(["grpo.steps"])
    with pytest.raises(ConfigError, match="empty key"):
        parse_overrides(["=3"])
    with pytest.raises(ConfigError, match="'seed' is a value, not a section"):
        parse_overrides(["seed=1", "seed.x=2"])
    assert parse_overrides(["model.path=", "a.b=[1, 2]"]) == {"model": {"path": ""}, "a": {"b": [1, 2]}}


def test_save_then_load_round_trip(tmp_path):
    cfg = load_config(
        overrides=["grpo.steps=3", "grpo.sampling.stop=['\\n', 'END']", "sft.optim.betas=[0.8, 0.9]"]
    )
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_describe_lists_every_leaf_with_value_and_description():
    lines = describe(load_config(overrides=["grpo.steps=3"]))
    keys = {line.split(" = ")[0] for line in lines}
    assert {"grpo.steps", "grpo.optim.lr", "model.tiny.hidden_size", "eval.sampling.temperature"} <= keys
    assert "grpo.steps = 3  # RL steps (one rollout + update each; at most, with stop_at_accuracy)." in lines
    # every leaf field has a description
    assert all(not line.endswith("# ") for line in lines), [line for line in lines if line.endswith("# ")]


@pytest.mark.parametrize(
    "override,hint",
    [
        ("grpo.stepz=4", "unknown config key 'grpo.stepz': did you mean grpo.steps?"),
        ("grpo.max_new_tokens=4", "did you mean grpo.sampling.max_new_tokens?"),  # a level too high
        ("sed=1", "did you mean seed?"),
    ],
)
def test_unknown_key_names_the_nearest_valid_one(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert hint in str(err.value)
    with pytest.raises(ConfigError) as err:  # nothing close: no guess is better than a wrong one
        load_config(overrides=["model.tiny.widht=3"])
    assert "did you mean" not in str(err.value)


def test_a_bare_word_for_a_list_shows_the_list_syntax():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["model.lora.target_modules=q_proj"])
    assert "write a list as model.lora.target_modules=[q_proj]" in str(err.value)
    assert load_config(overrides=["model.lora.target_modules=[q_proj]"]).model.lora.target_modules == [
        "q_proj"
    ]


def test_a_space_for_the_equals_sign_says_so():
    with pytest.raises(ConfigError, match="override 'grpo.steps' looks like a setting: write grpo.steps=4"):
        parse_overrides(["sft.steps=2", "grpo.steps", "4"])


def test_every_local_path_field_is_made_absolute_in_a_saved_run_config():
    # PATH_KEYS (made absolute when a run's config is saved, so it resumes from any directory) must name every
    # plain path field marked LocalPath; env.name's python:FILE spec is resolved where envs load it.
    from loopline.config import PATH_KEYS, RunConfig
    from loopline.k8s.staging import path_fields

    cfg = RunConfig.model_validate(
        {
            "model": {"path": "m", "tokenizer": "t"},
            "data": {"source": "jsonl", "train_path": "a.jsonl", "eval_path": "b.jsonl"},
            "preference": {"train_path": "p.jsonl", "eval_path": "q.jsonl"},
            "reward": {"model_path": "r"},
        }
    )
    marked = {f.key for f in path_fields(cfg) if f.key != "env.name"}
    assert marked <= set(PATH_KEYS), marked - set(PATH_KEYS)
    assert {"model.config", "model.tokenizer"} <= set(PATH_KEYS)
