"""`loopline k8s render`: golden manifests for the default config and the README's heterogeneous example, every
rendered object through the schema and rule checks, and what render derives from the run's config (worker
groups from the placement pools, the config the pod runs, Kueue, storage, autoscaling) or refuses, naming the field.

LOOPLINE_UPDATE_GOLDEN=1 rewrites the golden files (then read the diff: it is the change to what users submit).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from loopline.cli import main
from loopline.config import RunConfig, load_config
from loopline.errors import UserError
from loopline.k8s.checks import check, problems
from loopline.k8s.render import manifests_yaml, render

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
EXAMPLE = str(ROOT / "examples" / "k8s.yaml")


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def _groups(objects: list[dict]) -> dict[str, dict]:
    spec = _by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def _pod_resources(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize(
    "name, config, overrides",
    [("default", None, []), ("heterogeneous", EXAMPLE, [])],
)
def test_rendered_manifests_match_the_golden_files_and_pass_every_check(name, config, overrides):
    objects = render(load_config(config, overrides))
    text = manifests_yaml(objects)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LOOPLINE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs from the render (LOOPLINE_UPDATE_GOLDEN=1 rewrites it)"
    assert problems(objects) == []


def test_the_default_job_runs_on_the_head_pod_alone():
    objects = render(load_config())
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", "RayJob"]
    job = _by_kind(objects)["RayJob"]
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"] == []  # backend local: no Ray worker groups
    assert job["spec"]["entrypoint"] == "loopline train /etc/loopline/run.yaml --resume --restart-unsaved"
    assert job["spec"]["shutdownAfterJobFinishes"] is True and "suspend" not in job["spec"]
    claim = _by_kind(objects)["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_pod_runs_the_same_config_with_out_dir_on_the_volume_and_ray_joined():
    cfg = load_config(EXAMPLE, ["seed=7", "grpo.steps=12"])
    objects = render(cfg)
    run = _load(_by_kind(objects)["ConfigMap"]["data"]["run.yaml"])
    assert run.out_dir == "/runs/loopline-code-k8s"
    assert run.runtime.cluster.address == "auto" and run.progress is False
    same = run.model_copy(update={"out_dir": cfg.out_dir, "progress": cfg.progress, "runtime": cfg.runtime})
    assert same == cfg  # nothing else differs: the run is the one configured
    assert run.runtime.placement == cfg.runtime.placement


def _load(text: str) -> RunConfig:
    return RunConfig.model_validate(yaml.safe_load(text))


def _example(edit) -> RunConfig:
    """The example with its YAML tree edited (for list items, which dotted overrides cannot reach)."""
    tree = yaml.safe_load(Path(EXAMPLE).read_text())
    edit(tree)
    return RunConfig.model_validate(tree)


def _fractional_gpu(tree: dict) -> None:
    tree["runtime"]["placement"]["pools"][0]["resources"]["GPU"] = 0.3


def test_pools_become_worker_groups_with_their_resources():
    objects = render(load_config(EXAMPLE))
    groups = _groups(objects)
    assert list(groups) == ["trainer", "engines", "env"]
    trainer, env = groups["trainer"], groups["env"]
    # 16 bundles of {CPU 8, GPU 1}, 8 to a pod: 2 pods of 64 CPUs and 8 GPUs
    assert trainer["replicas"] == trainer["minReplicas"] == trainer["maxReplicas"] == 2
    assert _pod_resources(trainer) == {"cpu": "64", "memory": "900Gi", "nvidia.com/gpu": "8"}
    assert trainer["rayStartParams"] == {"num-cpus": "64", "num-gpus": "8"}
    assert trainer["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert trainer["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert trainer["template"]["spec"]["containers"][0]["image"].endswith("-cuda")
    # the custom resource reaches `ray start --resources=...` as JSON inside quotes
    assert env["replicas"] == 4 and _pod_resources(env) == {"cpu": "16", "memory": "32Gi"}
    raw = env["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"')
    assert json.loads(raw[1:-1].replace('\\"', '"')) == {"env_node": 8}
    assert "nvidia.com/gpu" not in _pod_resources(env)
    head = _by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0"}  # no role lands on the head


def test_every_pod_mounts_the_run_volume_and_the_head_the_config():
    objects = render(load_config(EXAMPLE))
    cluster = _by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        spec = pod["template"]["spec"]
        claims = [
            v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v
        ]
        assert claims == ["loopline-code-k8s-runs"]
        assert {"name": "runs", "mountPath": "/runs"} in spec["containers"][0]["volumeMounts"]
    head_mounts = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "config", "mountPath": "/etc/loopline", "readOnly": True} in head_mounts


def test_no_ray_pod_prestarts_task_workers():
    """loopline sends Ray no tasks: the raylets start no worker per CPU for them, as on the local Ray."""
    cluster = _by_kind(render(load_config(EXAMPLE)))["RayJob"]["spec"]["rayClusterSpec"]
    for pod in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = pod["template"]["spec"]["containers"][0]["env"]
        assert {"name": "RAY_prestart_worker_first_driver", "value": "0"} in env


def test_kueue_queue_suspends_the_job_and_labels_it():
    job = _by_kind(render(load_config(EXAMPLE)))["RayJob"]
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "rl-team-queue"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is False
    plain = _by_kind(render(load_config(EXAMPLE, ["k8s.queue=", "k8s.priority_class="])))["RayJob"]
    assert "suspend" not in plain["spec"] and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]


def test_an_existing_claim_is_used_and_none_rendered():
    objects = render(load_config(EXAMPLE, ["k8s.storage.claim=shared-runs"]))
    assert [o["kind"] for o in objects] == ["ConfigMap", "RayJob"]
    head = _by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["volumes"][0]["persistentVolumeClaim"]["claimName"] == "shared-runs"


def test_env_workers_may_autoscale_without_kueue():
    cfg = load_config(
        EXAMPLE,
        [
            "k8s.queue=",
            "k8s.priority_class=",
            "k8s.groups.env.min_replicas=1",
            "k8s.groups.env.max_replicas=10",
        ],
    )
    objects = render(cfg)
    check(objects)
    env = _groups(objects)["env"]
    assert (env["minReplicas"], env["replicas"], env["maxReplicas"]) == (1, 4, 10)
    assert _by_kind(objects)["RayJob"]["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True
    run = _load(_by_kind(objects)["ConfigMap"]["data"]["run.yaml"])
    assert run.runtime.placement.check_resources is False  # pods come as the autoscaler adds them


NO_KUEUE = ["k8s.queue=", "k8s.priority_class="]


@pytest.mark.parametrize(
    "config, field",
    [
        (["k8s.groups.trainer.bundles_per_pod=3"], "k8s.groups.trainer.bundles_per_pod=3 does not divide"),
        (
            _fractional_gpu,
            "k8s.groups.trainer.bundles_per_pod: 8 bundle(s) of {'CPU': 8.0, 'GPU': 0.3} make 2.4 GPU",
        ),
        (["k8s.groups.gpus.memory=1Gi"], "k8s.groups names no placement pool: gpus; the pools are: trainer,"),
        (
            [*NO_KUEUE, "k8s.groups.trainer.min_replicas=1", "k8s.groups.trainer.max_replicas=3"],
            "k8s.groups.trainer: only the env workers' pool may autoscale",
        ),
        (
            [*NO_KUEUE, "k8s.groups.env.min_replicas=5", "k8s.groups.env.max_replicas=9"],
            "k8s.groups.env: the pool starts with 4 pod(s), outside min_replicas..max_replicas (5..9)",
        ),
    ],
)
def test_what_cannot_be_rendered_names_the_field(config, field):
    cfg = _example(config) if callable(config) else load_config(EXAMPLE, config)
    with pytest.raises(UserError) as e:
        render(cfg)
    assert field in str(e.value)


def test_no_worker_groups_on_the_local_backend():
    with pytest.raises(UserError, match="runtime.backend=local has no worker groups"):
        render(load_config(None, ["k8s.groups.actor.memory=1Gi"]))


@pytest.mark.parametrize(
    "override, key",
    [
        ("k8s.head.memory=8GB", "k8s.head.memory"),
        ("k8s.name=My_Job", "k8s.name"),
        ("k8s.priority_class=high", "k8s"),  # needs a queue
        ("k8s.storage.mount_path=runs", "k8s.storage.mount_path"),
        ("k8s.groups.env.min_replicas=2", "k8s.groups.env"),  # min without max
        ("k8s.image_pull_policy=Sometimes", "k8s.image_pull_policy"),
    ],
)
def test_bad_k8s_config_fails_at_load_naming_the_key(override, key, capsys):
    assert main(["k8s", "render", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loopline: bad config") and f"'{key}" in err


def _bad_pool_name(tree: dict) -> None:
    tree["runtime"]["placement"]["pools"][0]["name"] = "GPU_pool"
    tree["runtime"]["placement"]["roles"]["actor"] = "GPU_pool"
    tree["k8s"]["groups"]["GPU_pool"] = tree["k8s"]["groups"].pop("trainer")


def test_a_pool_name_that_is_no_dns_label_is_refused():
    with pytest.raises(UserError, match=r"runtime.placement.pools\[0\].name: 'GPU_pool'"):
        render(_example(_bad_pool_name))


def test_render_cli_writes_one_file_per_object(tmp_path, capsys):
    out = tmp_path / "manifests"
    assert main(["k8s", "render", EXAMPLE, "seed=3", "--out", str(out)]) == 0
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["00-configmap.yaml", "01-persistentvolumeclaim.yaml", "02-rayjob.yaml"]
    assert capsys.readouterr().out.split() == [str(f) for f in files]
    assert yaml.safe_load(files[2].read_text()) == render(load_config(EXAMPLE, ["seed=3"]))[2]
    assert main(["k8s", "render"]) == 0  # no config: the default job, printed
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == render(load_config())
    (tmp_path / "file").write_text("x")
    assert main(["k8s", "render", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_a_job_runs_train_sft_dpo_or_rm_each_resumed_when_retried(capsys):
    """`--command sft|dpo|rm` renders the same objects with that command as the entrypoint (each resumes, so a
    retried job continues); others are refused, and what `loopline dpo` refuses at once is refused before the job
    exists."""
    for command in ("sft", "dpo", "rm"):
        assert main(["k8s", "render", "--command", command]) == 0
        job = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
        assert (
            job["spec"]["entrypoint"]
            == f"loopline {command} /etc/loopline/run.yaml --resume --restart-unsaved"
        )
        assert job["spec"]["rayClusterSpec"] == render(load_config())[-1]["spec"]["rayClusterSpec"]
    with pytest.raises(SystemExit):
        main(["k8s", "render", "--command", "eval"])  # writes no checkpoint: nothing for a retry to resume
    assert "invalid choice: 'eval'" in capsys.readouterr().err
    with pytest.raises(UserError, match="not 'eval'"):
        render(load_config(), "eval")
    pipelined = ["runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_pp=2"]
    assert main(["k8s", "render", *pipelined]) == 0  # train runs pipelined
    capsys.readouterr()
    assert main(["k8s", "render", "--command", "dpo", *pipelined]) == 2
    assert "does not run through the pipeline" in capsys.readouterr().err


def test_the_config_travels_as_a_readable_yaml_file_that_the_pod_loads(tmp_path, capsys):
    """The ConfigMap's run.yaml is printed as a literal block (the file as the pod reads it, line by line, not one
    escaped string), with a header saying what it is; mounted as a file, `load_config` reads it back whole."""
    assert main(["k8s", "render", "--out", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "00-configmap.yaml").read_text()
    assert "  run.yaml: |\n    # The config of run loopline-default as its pods run it" in text
    assert "\n    out_dir: /runs/loopline-default\n" in text and "\\n" not in text
    run = yaml.safe_load(text)["data"]["run.yaml"]
    mounted = tmp_path / "run.yaml"
    mounted.write_text(run)
    assert load_config(str(mounted)) == _load(run)
    printed = main(["k8s", "render"]) == 0 and capsys.readouterr().out
    assert "  run.yaml: |\n" in printed
