"""A run's local files on its Kubernetes volume: which config fields name files on this machine, where
`loopline k8s stage` puts each on the run's volume, and the config that points at them there.

The fields are found from the config models (every field annotated with section.LocalPath), never from a list
of names. A path is one of: empty, a URL or a dotted module (names no file); on the volume (under
k8s.storage.mount_path: passes); local (it exists here: the pods cannot read it, so render refuses it and stage
copies it); or an absolute path that does not exist here (passes: the pods' image may hold it). A relative path
that does not exist here is refused: it means nothing on the pods either. Pure: nothing touches a cluster.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel

from loopline.config import RunConfig
from loopline.errors import UserError
from loopline.k8s.config import WorkerGroupConfig
from loopline.k8s.memory import group_memory, head_memory
from loopline.section import LocalPath

INPUTS = "inputs"  # under the run's directory on the volume: <mount_path>/<name>/inputs/<field>/<file name>
STAGE_CONFIG = "run.yaml"
STAGE_OBJECTS = "stage-objects.yaml"
STAGE_SCRIPT = "stage.sh"


@dataclass(frozen=True)
class PathField:
    """A config field marked LocalPath that names a file: its dotted key, whole value and the path within it."""

    key: str
    value: str
    path: str
    what: str
    span: tuple[int, int]

    def with_path(self, path: str) -> str:
        """The field's value with its path replaced by `path` (env.name keeps its python: and :FACTORY)."""
        return self.value[: self.span[0]] + path + self.value[self.span[1] :]


def path_fields(section: BaseModel, prefix: str = "") -> Iterator[PathField]:
    """Every field of `section` and its subsections (also inside dicts and lists) annotated with LocalPath whose
    value names a file, in the models' field order."""
    for name, info in type(section).model_fields.items():
        value = getattr(section, name)
        key = f"{prefix}{name}"
        marker = next((m for m in info.metadata if isinstance(m, LocalPath)), None)
        if marker is not None and isinstance(value, str):
            span = marker.find(value)
            if span is not None:
                yield PathField(key, value, value[span[0] : span[1]], marker.what, span)
        yield from _nested(value, key)


def _nested(value: Any, key: str) -> Iterator[PathField]:
    if isinstance(value, BaseModel):
        yield from path_fields(value, key + ".")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _nested(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _nested(v, f"{key}.{i}")


def on_volume(path: str, mount_path: str) -> bool:
    """Whether `path` lies on the run's volume as the pods mount it."""
    p = PurePosixPath(path)
    return p.is_absolute() and PurePosixPath(mount_path) in (p, *p.parents)


@dataclass(frozen=True)
class Staged:
    """One local file or directory and where `loopline k8s stage` puts it on the run's volume."""

    field: PathField
    local: Path  # resolved on this machine
    volume: str  # absolute path inside the pods


def _local_fields(cfg: RunConfig) -> list[PathField]:
    """The path fields that name files on this machine only; UserError for a relative path that exists nowhere."""
    mount = cfg.k8s.storage.mount_path
    local, missing = [], []
    for f in path_fields(cfg):
        if on_volume(f.path, mount):
            continue
        if Path(f.path).exists():
            local.append(f)
        elif not Path(f.path).is_absolute():
            missing.append(
                f"{f.key}: {f.path!r} ({f.what}) does not exist here (relative to {Path.cwd()}), and the pods "
                f"would look for it relative to their own working directory: give a path on the run's volume "
                f"({mount}/...) or an existing local path to stage"
            )
    if missing:
        raise UserError("\n".join(missing))
    return local


def image_paths(cfg: RunConfig) -> list[str]:
    """A note per absolute path that is neither on this machine nor on the run's volume: left as it is (the pods
    may find it in their image), but most often a typo, which the pods would only report when the run starts."""
    mount = cfg.k8s.storage.mount_path
    return [
        f"{f.key}: {f.path!r} ({f.what}) is not on this machine nor on the run's volume ({mount}): left as it is, "
        "for the pods to find in their image"
        for f in path_fields(cfg)
        if Path(f.path).is_absolute() and not on_volume(f.path, mount) and not Path(f.path).exists()
    ]


def stage_plan(cfg: RunConfig, name: str) -> list[Staged]:
    """Where each local file of the run goes: <mount_path>/<name>/inputs/<field>/<file name>. Fields naming the
    same local file share one copy."""
    base = f"{cfg.k8s.storage.mount_path}/{name}/{INPUTS}"
    plan: list[Staged] = []
    seen: dict[Path, str] = {}
    for f in _local_fields(cfg):
        local = Path(f.path).resolve()
        volume = seen.setdefault(local, f"{base}/{f.key}/{local.name}")
        plan.append(Staged(f, local, volume))
    return plan


def staged_config(cfg: RunConfig, plan: list[Staged], name: str) -> RunConfig:
    """The run's config with every staged field pointing at its copy on the volume, k8s.name pinned to `name`
    (the volume's claim is named after the job: a config that renders another name would mount another volume),
    and the pods' memory estimated now, while the model's config.json is still readable here."""
    tree = cfg.model_dump(mode="json")
    k8s = tree["k8s"]
    k8s["head"]["memory"] = cfg.k8s.head.memory or head_memory(cfg)
    for pool in cfg.runtime.pools().pools if cfg.runtime.backend == "ray" else []:
        group = cfg.k8s.groups.get(pool.name, WorkerGroupConfig())
        gpu = pool.resources.get("GPU", 0.0) > 0
        memory = group.memory or group_memory(cfg, pool.name, group.bundles_per_pod, gpu)
        k8s["groups"][pool.name] = {**group.model_dump(mode="json"), "memory": memory}
    for s in plan:
        *parents, last = s.field.key.split(".")
        node: Any = tree
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = s.field.with_path(s.volume)
    k8s["name"] = name
    return RunConfig.model_validate(tree)


def refuse_local(cfg: RunConfig, stage_command: str) -> None:
    """UserError with one line per field that names a file on this machine only (the pods cannot read it), and
    the command that copies them onto the run's volume."""
    mount = cfg.k8s.storage.mount_path
    lines = [
        f"  {f.key}: {f.path!r} ({f.what}): put it on the run's volume ({mount}) with `loopline k8s stage`"
        for f in _local_fields(cfg)
    ]
    if lines:
        raise UserError(
            "the run reads files that exist on this machine only, which the pods cannot read:\n"
            + "\n".join(lines)
            + f"\ncopy them onto the volume with: {stage_command} (it writes the config that points at the copies: "
            "render that one)"
        )


def stage_pod(cfg: RunConfig, name: str, claim: str) -> dict[str, Any]:
    """A pod that only mounts the run's volume, for stage.sh to copy into; deleted once the copies are done."""
    k8s = cfg.k8s
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-stage",
            "namespace": k8s.namespace,
            "labels": {"app.kubernetes.io/name": "loopline", "app.kubernetes.io/instance": name},
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "stage",
                    # the run's image: it has the sh and tar that stage.sh runs in the pod
                    "image": k8s.head.image or k8s.image,
                    "imagePullPolicy": k8s.image_pull_policy,
                    "command": ["sleep", "86400"],
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                    "volumeMounts": [{"name": "runs", "mountPath": k8s.storage.mount_path}],
                }
            ],
            "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }


def stage_script(cfg: RunConfig, name: str, plan: list[Staged]) -> str:
    """The commands that copy the plan's files onto the volume through the stage pod: each file or directory as a
    tar stream into `kubectl exec` (symbolic links followed: a Hugging Face cache's snapshot is links into its blobs,
    which would dangle on the volume). Idempotent: each target is replaced, so the script can run again after a
    local file changed."""
    ns, pod = cfg.k8s.namespace, f"{name}-stage"
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        f"# Copies the local files of run {name} onto its volume through the pod {pod}, then deletes the pod.",
        "# KUBECTL='kubectl --context other' picks another cluster than kubectl's current context.",
        "set -eu",
        'KUBECTL="${KUBECTL:-kubectl}"',
        "export COPYFILE_DISABLE=1  # macOS tar: no ._ resource-fork files in the copies",
        'here="$(dirname "$0")"',
        f'$KUBECTL apply -f "$here/{STAGE_OBJECTS}"',
        f"$KUBECTL wait -n {ns} --for=condition=Ready pod/{pod} --timeout=600s",
    ]
    done: set[str] = set()
    for s in plan:
        if s.volume in done:
            continue
        done.add(s.volume)
        parent = str(PurePosixPath(s.volume).parent)  # the copy keeps the local name: <parent>/<local name>
        unpack = f"rm -rf {q(s.volume)} && mkdir -p {q(parent)} && tar -C {q(parent)} -xf -"
        lines.append(f"# {s.field.key}")
        lines.append(
            f"tar -C {q(str(s.local.parent))} -chf - {q(s.local.name)} | "
            f"$KUBECTL exec -i -n {ns} {pod} -- sh -c {q(unpack)}"
        )
    lines.append(f"$KUBECTL delete -n {ns} pod/{pod} --wait=false")
    lines.append(f'echo "staged; now: loopline k8s render $here/{STAGE_CONFIG} (or submit it)"')
    return "\n".join(lines) + "\n"


def write_stage(
    out: Path, cfg: RunConfig, plan: list[Staged], name: str, objects: list[dict[str, Any]]
) -> list[Path]:
    """Write the staged config, the stage pod (after the volume's claim when render makes one) and the script
    into `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    config, manifests, script = out / STAGE_CONFIG, out / STAGE_OBJECTS, out / STAGE_SCRIPT
    header = f"# Run {name} with its local files on its volume (`loopline k8s stage`): render this file.\n"
    config.write_text(
        header + yaml.safe_dump(staged_config(cfg, plan, name).model_dump(mode="json"), sort_keys=False)
    )
    manifests.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    script.write_text(stage_script(cfg, name, plan))
    script.chmod(0o755)
    return [config, manifests, script]
