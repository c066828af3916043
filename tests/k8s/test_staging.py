"""A run's local files and the cluster: every config field that names a file is found from the models (LocalPath),
`loopline k8s render` refuses those that exist on this machine only (one line per field, and the stage command),
and `loopline k8s stage` plans their copies onto the run's volume: which local path goes where, a config that
points at the copies (and renders), a pod that mounts the volume the RayJob mounts, and a kubectl script, run
here against a stand-in kubectl whose pod is a local directory.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from loopline.cli import main
from loopline.config import RunConfig, load_config
from loopline.errors import UserError
from loopline.k8s.render import render
from loopline.k8s.staging import on_volume, path_fields, stage_plan, staged_config
from loopline.section import LocalPath

# Fields that read like paths but name no file of the user's machine, each with why.
NOT_STAGED = {
    "out_dir": "the run's own directory: render moves it onto the volume (<mount_path>/<name>)",
    "env.sandbox.ro_binds": "paths of the pods' own filesystem, bound into the sandbox: nothing to copy",
    "k8s.storage.mount_path": "where the pods mount the volume",
}


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """{dotted key: FieldInfo} of every leaf field of a config model (sections opened, by their type)."""
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out.update(_leaves(kind, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info
    return out


def _reads_like_a_path(key: str, info: FieldInfo) -> bool:
    """A text field named *path, *_dir, *_file (or plurals), or described as a path, directory or .py file."""
    if info.annotation not in (str, list[str]) and "str" not in str(info.annotation):
        return False
    name, description = key.rsplit(".", 1)[-1], (info.description or "").lower()
    return bool(
        re.search(r"(^|_)(path|dir|file)s?$", name)
        or re.search(r"\bpaths?\b|\bdirectory\b|\.py\b", description)
    )


def test_every_field_that_names_a_file_is_marked_or_said_why_not():
    """A new path field without LocalPath fails here, unless NOT_STAGED says why it names no local file."""
    leaves = _leaves(RunConfig)
    marked = {k for k, info in leaves.items() if any(isinstance(m, LocalPath) for m in info.metadata)}
    assert marked == {
        "model.path",
        "model.config",
        "model.tokenizer",
        "data.train_path",
        "data.eval_path",
        "preference.train_path",
        "preference.eval_path",
        "reward.model_path",
        "env.name",
    }
    pathlike = {k for k, info in leaves.items() if _reads_like_a_path(k, info)}
    assert pathlike - marked == set(NOT_STAGED), (
        "mark the new path field with LocalPath, or say in NOT_STAGED why not"
    )


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    """A user's directory with a model, a dataset and an env file; the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my model").mkdir()
    (tmp_path / "my model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "my_env.py").write_text("def make():\n    return None\n")
    return tmp_path


LOCAL = [
    "model.path=my model",
    "data.source=jsonl",
    "data.train_path=train.jsonl",
    "data.eval_path=train.jsonl",
    "env.name=python:my_env.py:make",
    "out_dir=runs/mine",
    "k8s.head.memory=4Gi",  # the stand-in model.json is empty: memory is not what this file tests
]


def test_path_fields_names_each_file_and_leaves_the_rest(files):
    cfg = load_config(None, LOCAL)
    found = {f.key: f.path for f in path_fields(cfg)}
    assert found == {
        "model.path": "my model",
        "data.train_path": "train.jsonl",
        "data.eval_path": "train.jsonl",
        "env.name": str(files / "my_env.py"),  # the env config stores it absolute
    }
    module = load_config(None, ["env.name=python:my_pkg.envs:make"])  # a dotted module: installed, not a file
    assert [f.key for f in path_fields(module)] == []


def test_render_refuses_each_local_file_with_the_command_that_stages_it(files, capsys):
    assert main(["k8s", "render", *LOCAL, "--out", "manifests"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0] == "loopline: the run reads files that exist on this machine only, which the pods cannot read:"
    )
    fields = [line.split(":")[0].strip() for line in err[1:-1]]
    assert fields == ["model.path", "data.train_path", "data.eval_path", "env.name"]
    assert all("put it on the run's volume (/runs) with `loopline k8s stage`" in line for line in err[1:-1])
    command = err[-1].removeprefix("copy them onto the volume with: ").split(" (it writes")[0]
    assert shlex.split(command) == ["loopline", "k8s", "stage", *LOCAL, "--out", "loopline-mine-stage"]
    assert not (files / "manifests").exists()  # nothing written
    with pytest.raises(UserError, match="model.path: 'my model'"):
        render(load_config(None, LOCAL))  # the Python API refuses alike
    assert main(["k8s", "submit", *LOCAL]) == 2  # before any cluster is contacted
    assert "model.path: 'my model'" in capsys.readouterr().err


def test_paths_on_the_volume_urls_and_image_paths_pass(files, capsys):
    on = ["model.path=/runs/shared/qwen", "k8s.head.memory=4Gi", "env.name=python:/runs/x/env.py:make"]
    assert main(["k8s", "render", *on, "data.source=jsonl", "data.train_path=s3://bucket/train.jsonl"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["k8s", "render", "model.path=/opt/models/qwen", "k8s.head.memory=4Gi"]) == 0
    err = capsys.readouterr().err
    assert (
        "note: model.path: '/opt/models/qwen' (Hugging Face model directory) is not on this machine nor"
        in err
    )
    assert on_volume("/runs/a/b", "/runs") and on_volume("/runs", "/runs")
    assert not on_volume("/runsx/a", "/runs") and not on_volume("runs/a", "/runs")


def test_a_relative_path_that_exists_nowhere_is_refused_by_render_and_stage(files, capsys):
    for command in (["render"], ["stage", "--out", "s"]):
        assert main(["k8s", *command, "model.path=no_such_model"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            "loopline: model.path: 'no_such_model' (Hugging Face model directory) does not exist"
        )
        assert len(err.splitlines()) == 1
    assert not (files / "s").exists()


def test_stage_plans_each_copy_and_writes_a_config_that_points_at_them(files, capsys):
    assert main(["k8s", "stage", *LOCAL, "--out", "staged"]) == 0
    inputs = "/runs/loopline-mine/inputs"
    printed = capsys.readouterr().out.splitlines()
    assert printed[:4] == [
        f"model.path: {files / 'my model'} -> {inputs}/model.path/my model",
        f"data.train_path: {files / 'train.jsonl'} -> {inputs}/data.train_path/train.jsonl",
        f"data.eval_path: {files / 'train.jsonl'} -> {inputs}/data.train_path/train.jsonl",  # one copy
        f"env.name: {files / 'my_env.py'} -> {inputs}/env.name/my_env.py",
    ]
    staged = load_config("staged/run.yaml")
    assert staged.model.path == f"{inputs}/model.path/my model"
    assert staged.data.train_path == staged.data.eval_path == f"{inputs}/data.train_path/train.jsonl"
    assert staged.env.name == f"python:{inputs}/env.name/my_env.py:make"
    assert staged.k8s.name == "loopline-mine"  # pinned: the claim is named after it
    same = staged.model_copy(update={"model": staged.model.model_copy(update={"path": "my model"})})
    assert same.model_dump(exclude={"data", "env", "k8s"}) == load_config(None, LOCAL).model_dump(
        exclude={"data", "env", "k8s"}
    )  # nothing else moved
    # render again: it passes, and the pods' config points at the copies
    assert main(["k8s", "render", "staged/run.yaml", "--out", "manifests"]) == 0
    capsys.readouterr()
    configmap, claim, job = (yaml.safe_load(p.read_text()) for p in sorted((files / "manifests").iterdir()))
    run = RunConfig.model_validate(yaml.safe_load(configmap["data"]["run.yaml"]))
    assert run.model.path == staged.model.path and run.env.name == staged.env.name
    # the stage pod mounts the volume the job mounts, where the job mounts it
    objects = list(yaml.safe_load_all((files / "staged" / "stage-objects.yaml").read_text()))
    assert [o["kind"] for o in objects] == ["PersistentVolumeClaim", "Pod"]
    assert objects[0] == claim
    pod, head = objects[1]["spec"], job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert pod["volumes"] == [v for v in head["volumes"] if v["name"] == "runs"]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "runs", "mountPath": "/runs"}]


def test_stage_with_an_existing_claim_makes_only_the_pod(files, capsys):
    assert main(["k8s", "stage", *LOCAL, "k8s.storage.claim=team-runs", "--out", "staged"]) == 0
    objects = list(yaml.safe_load_all((files / "staged" / "stage-objects.yaml").read_text()))
    assert [o["kind"] for o in objects] == ["Pod"]
    assert objects[0]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "team-runs"


def test_stage_bad_input(files, capsys):
    (files / "a_file").write_text("x")
    assert main(["k8s", "stage", *LOCAL, "--out", "a_file"]) == 2
    assert capsys.readouterr().err == "loopline: --out: 'a_file' is a file, not a directory\n"
    with pytest.raises(SystemExit) as e:
        main(["k8s", "stage", *LOCAL])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert main(["k8s", "stage", "--out", "nothing"]) == 0  # the default run reads no file
    assert "nothing to stage" in capsys.readouterr().out and not (files / "nothing").exists()
    assert main(["k8s", "stage", *LOCAL, "k8s.storage.mount_path=runs", "--out", "s"]) == 2
    assert "'k8s.storage.mount_path'" in capsys.readouterr().err and not (files / "s").exists()


FAKE_KUBECTL = """#!/bin/sh
# kubectl as stage.sh uses it, with the stage pod as this machine: exec runs its command here, on stdin
echo "$*" >> "$KUBECTL_LOG"
case "$1" in
  exec) shift 5; shift; exec "$@" ;;
  *) exit 0 ;;
esac
"""


def test_the_stage_script_copies_each_file_to_its_place_and_runs_again(files, tmp_path, capsys):
    """stage.sh against a kubectl whose pod is this machine (the volume: a local directory): every file lands at
    the path the staged config names, paths with spaces included, symbolic links as the files they point at (a
    Hugging Face cache's snapshot), and a second run replaces, not nests."""
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_text("weights")
    (files / "my model" / "model.safetensors").symlink_to(blob)
    volume = tmp_path / "volume"
    volume.mkdir()
    args = [*LOCAL, f"k8s.storage.mount_path={volume}"]
    assert main(["k8s", "stage", *args, "--out", "staged"]) == 0
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "KUBECTL": str(kubectl), "KUBECTL_LOG": str(tmp_path / "log")}
    for _ in range(2):
        subprocess.run(["sh", "staged/stage.sh"], env=env, check=True, capture_output=True)
    staged = load_config("staged/run.yaml")
    model = Path(staged.model.path)
    assert (model / "config.json").read_text() == "{}"
    weights = model / "model.safetensors"
    assert not weights.is_symlink() and weights.read_text() == "weights"
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]  # not nested
    assert Path(staged.data.train_path).read_text() == (files / "train.jsonl").read_text()
    env_file = staged.env.name.split(":")[1]
    assert Path(env_file).read_text() == (files / "my_env.py").read_text()
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0] == "apply -f staged/stage-objects.yaml" and log[-1].startswith("delete -n default pod/")
    assert sum(line.startswith("exec -i ") for line in log) == 2 * 3  # 3 files (eval shares train's), twice


def test_stage_plan_and_staged_config_as_functions(files):
    cfg = load_config(None, LOCAL)
    plan = stage_plan(cfg, "job")
    assert [(s.field.key, s.volume) for s in plan][0] == (
        "model.path",
        "/runs/job/inputs/model.path/my model",
    )
    staged = staged_config(cfg, plan, "job")
    assert [f.path for f in path_fields(staged)] == [s.volume for s in plan]
    assert stage_plan(staged, "job") == []  # staged once: nothing left to stage
