"""The `loopline` command line: config printing, and bad configs failing fast with exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loopline.cli import agent_argv, main


def test_config_prints_every_field(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "grpo.group_size = 8  # Completions per prompt." in out
    assert any(line.startswith("eval.sampling.temperature = 0.0  # ") for line in out)
    assert len(out) > 50


def test_config_applies_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("grpo:\n  group_size: 4\n")
    assert main(["config", str(path), "grpo.steps=3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("grpo.group_size = 4  #") for line in out)
    assert any(line.startswith("grpo.steps = 3  #") for line in out)
    # with no file, the first positional argument is an override, not a path
    assert main(["config", "grpo.steps=5"]) == 0
    assert any(line.startswith("grpo.steps = 5  #") for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("command", ["train", "sft", "eval", "config"])
def test_bad_config_exits_2_with_the_key(command, tmp_path, capsys):
    assert main([command, "grpo.stepz=1", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'grpo.stepz'" in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_train_subprocess_fails_before_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "train", "grpo.stepz=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown config key 'grpo.stepz'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no checkpoint, no metrics


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["generate"])  # --prompt is required
    assert e.value.code == 2


def test_unknown_benchmark_exits_2(capsys):
    assert main(["bench", "no_such_bench"]) == 2
    assert "unknown benchmark 'no_such_bench'" in capsys.readouterr().err


def test_overrides_may_follow_options(capsys):
    # argparse alone stops collecting positionals at `--resume`; both overrides must still be read
    assert main(["train", "grpo.stepz=1", "--resume", "sft.steps=x"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'grpo.stepz'" in err and "config key 'sft.steps'" in err
    with pytest.raises(SystemExit) as e:
        main(["train", "grpo.steps=1", "--resume", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_agent_is_train_with_the_calculator_settings(capsys):
    # `agent` stands for `train env.name=calculator` with the example's settings; the words given win, and
    # --print-config shows the config it resolves to (in any order)
    with pytest.raises(SystemExit) as e:
        main(["agent", "--help"])
    assert e.value.code == 0
    assert "usage: loopline train" in capsys.readouterr().out
    assert main(["agent", "grpo.steps=3", "--print-config", "sft.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "grpo.steps = 3" in out and "sft.steps = 7" in out and "env.name = 'calculator'" in out
    assert "sft.optim.lr = 0.001" in out and "grpo.sampling.temperature = 0.7" in out
    # --resume takes the run as it was saved: the example's settings are not laid over it again
    assert agent_argv(["--resume"]) == ["train", "out_dir=runs/agent", "--resume"]
    assert agent_argv(["--resume", "out_dir=x"])[-1] == "out_dir=x"
    assert main(["agent", "--print-config", "grpo.stepz=1"]) == 2
    assert "unknown config key 'grpo.stepz'" in capsys.readouterr().err


def test_sandbox_help_lists_its_subcommands(capsys):
    # `loopline sandbox -h` is the sandbox's own help (run, check), not the top-level stub
    with pytest.raises(SystemExit) as e:
        main(["sandbox", "-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "{run,check}" in out and "passed: N/M" in out


@pytest.mark.parametrize(
    "argv,said",
    [
        (
            ["train", "grpo.steps", "4"],
            "'grpo.steps' looks like a setting, not a config file: write grpo.steps=4",
        ),
        (["eval", "sft.optim.lr", "1e-3"], "write sft.optim.lr=1e-3"),
        (["train", "seed", "3"], "write seed=3"),
        (
            ["train", "sft.steps=1", "grpo.steps", "4"],
            "override 'grpo.steps' looks like a setting: write grpo.steps=4",
        ),
        (["train", "run.yaml"], "config file 'run.yaml' does not exist"),  # a file name stays a file name
    ],
)
def test_a_setting_written_with_a_space_is_named_as_one(argv, said, capsys, tmp_path, monkeypatch):
    # was: "config file 'grpo.steps' does not exist"
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert said in capsys.readouterr().err
