"""The schema checks of rendered objects: KubeRay's RayJob CRD (unknown fields rejected, which the API server
would prune without a word) and Kubernetes' own schemas for the ConfigMap and the claim; check() lists every
problem with the object and the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from loopline.config import load_config
from loopline.errors import UserError
from loopline.k8s.checks import check, problems, schema_problems
from loopline.k8s.render import render

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "k8s.yaml")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(load_config(EXAMPLE))


def _edited(objects: list[dict], kind: str, edit) -> dict:
    obj = copy.deepcopy(next(o for o in objects if o["kind"] == kind))
    edit(obj)
    return obj


def _group(obj: dict) -> dict:
    return obj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


@pytest.mark.parametrize(
    "kind, edit, expected",
    [
        (
            "RayJob",
            lambda o: _group(o).update(replica=2),  # a typo of replicas
            "spec.rayClusterSpec.workerGroupSpecs[0]: Additional properties are not allowed ('replica' was unexpected)",
        ),
        (
            "RayJob",
            lambda o: _group(o).update(replicas="2"),
            "spec.rayClusterSpec.workerGroupSpecs[0].replicas: '2' is not of type 'integer'",
        ),
        (
            "RayJob",
            lambda o: _group(o).pop("groupName"),
            "spec.rayClusterSpec.workerGroupSpecs[0]: 'groupName' is a required property",
        ),
        (
            "RayJob",
            lambda o: _group(o)["template"]["spec"]["containers"][0].update(imagePullPolicy=3),
            "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].imagePullPolicy: 3 is not of type",
        ),
        ("RayJob", lambda o: o["metadata"].pop("name"), "metadata.name: a RayJob needs a name"),
        (
            "ConfigMap",
            lambda o: o.update(datta={}),
            "<root>: Additional properties are not allowed ('datta' was unexpected)",
        ),
        (
            "PersistentVolumeClaim",
            lambda o: o["spec"].update(accessModes="ReadWriteMany"),
            "spec.accessModes: 'ReadWriteMany' is not of type 'array', 'null'",
        ),
    ],
)
def test_a_schema_violation_is_named_by_its_field(objects, kind, edit, expected):
    bad = _edited(objects, kind, edit)
    found = schema_problems(bad)
    assert any(p.startswith(expected) for p in found), found


def test_check_lists_every_problem_of_every_object(objects):
    assert problems(objects) == []
    check(objects)  # the rendered example passes
    broken = [
        _edited(objects, "ConfigMap", lambda o: o.update(datta={})),
        _edited(objects, "RayJob", lambda o: o["metadata"].update(name="x" * 48)),  # KubeRay's 47-char limit
    ]
    with pytest.raises(UserError) as e:
        check(broken)
    lines = str(e.value).splitlines()
    assert lines[0] == "the rendered manifests would be refused by the cluster:"
    assert lines[1].startswith("  - configmap/loopline-code-k8s-config: <root>: Additional properties")
    assert lines[2].startswith(f"  - rayjob/{'x' * 48}: metadata.name:") and "47" in lines[2]


def test_a_long_run_name_is_refused_before_submission(capsys):
    from loopline.cli import main

    assert main(["k8s", "render", EXAMPLE, f"k8s.name={'a' * 48}"]) == 2
    err = capsys.readouterr().err
    assert "config key 'k8s.name'" in err and "at most 47" in err
    assert main(["k8s", "render", EXAMPLE, "out_dir=runs/" + "b" * 60]) == 0  # a derived name is cut to fit
    assert f"name: loopline-{'b' * 38}\n" in capsys.readouterr().out
