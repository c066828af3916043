"""A run as Kubernetes objects: a ConfigMap with its config, a PersistentVolumeClaim for out_dir and a KubeRay
RayJob whose entrypoint is `loopline train ... --resume` (or sft, dpo: the resumable commands), so that a job
retried after a lost pod continues from its last checkpoint. Pure: config in, manifest dicts out; nothing is read
from or sent to a cluster.

Each placement pool (runtime.placement, or the default one pool per role) becomes a worker group: its bundles
are packed k8s.groups.<pool>.bundles_per_pod to a pod, CPU and GPU become the pod's requests and Ray's
num-cpus/num-gpus, other resources (custom ones such as {env_node: 1}) Ray resources through rayStartParams.
A pod's memory is k8s.head.memory / k8s.groups.<pool>.memory, or estimated from the model (loopline.k8s.memory).

The pods see the image and the run's volume only: a config field naming a file on this machine is refused
(loopline.k8s.staging, which plans the copies `loopline k8s stage` makes). The config travels in the ConfigMap as
a YAML file, printed as a literal block so that it reads as the pod reads it.
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

import yaml

from loopline.checkpoint.run_dir import RESUMED_PHASES
from loopline.config import RunConfig
from loopline.distributed.placement import PoolConfig
from loopline.errors import UserError
from loopline.k8s.config import MAX_NAME, K8sConfig, PodPlacement, WorkerGroupConfig, is_dns_label
from loopline.k8s.memory import group_memory, head_memory
from loopline.k8s.staging import refuse_local

CONFIG_MOUNT = "/etc/loopline"
CONFIG_FILE = "run.yaml"
# Pools whose roles are only these may autoscale: env workers come and go (`loopline scale`), a trainer
# or an engine pool is reserved whole by its placement group when the run starts.
AUTOSCALED_ROLES = {"env"}


def job_name(cfg: RunConfig) -> str:
    """k8s.name, or loopline-<last part of out_dir> made into a DNS label."""
    if cfg.k8s.name:
        return cfg.k8s.name
    tail = PurePosixPath(cfg.out_dir).name.lower()
    tail = "".join(c if c.isalnum() else "-" for c in tail).strip("-")
    return f"loopline-{tail}"[:MAX_NAME].rstrip("-") if tail else "loopline"


def pod_config(cfg: RunConfig, name: str) -> RunConfig:
    """The run's config as the head pod runs it: out_dir on the volume, Ray joined rather than started,
    no progress bar in the logs, and no resource check on a cluster that autoscales."""
    k8s = cfg.k8s
    update: dict[str, Any] = {"out_dir": f"{k8s.storage.mount_path}/{name}", "progress": False}
    runtime = cfg.runtime
    if runtime.backend == "ray":
        placement = runtime.pools()
        if _autoscaled(k8s, placement.pools):
            placement = placement.model_copy(update={"check_resources": False})
        runtime = runtime.model_copy(
            update={"cluster": runtime.cluster.model_copy(update={"address": "auto"}), "placement": placement}
        )
        update["runtime"] = runtime
    return cfg.model_copy(update=update)


def _autoscaled(k8s: K8sConfig, pools: list[PoolConfig]) -> bool:
    return any(k8s.groups.get(p.name, WorkerGroupConfig()).max_replicas is not None for p in pools)


class _ManifestDumper(yaml.SafeDumper):
    """YAML for people: a multi-line string (the ConfigMap's run.yaml) as a literal block, as written."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # PyYAML falls back to quotes where a block cannot hold the text
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _str)


def manifests_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as one YAML stream, multi-line strings (the run's config) kept readable as literal blocks."""
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False)


def manifest_yaml(obj: dict[str, Any]) -> str:
    """One object as YAML, as manifests_yaml writes it."""
    return yaml.dump(obj, Dumper=_ManifestDumper, sort_keys=False)


def _entrypoint(command: str) -> str:
    return f"loopline {command} {CONFIG_MOUNT}/{CONFIG_FILE} --resume --restart-unsaved"


def run_yaml(cfg: RunConfig, name: str, command: str) -> str:
    """The config file the head pod runs (pod_config), with a header that says what it is."""
    header = (
        f"# The config of run {name} as its pods run it: `{_entrypoint(command)}`.\n"
        "# Written by `loopline k8s render`; every field, defaults included, so the run does not depend on the\n"
        "# defaults of the loopline in the image.\n"
    )
    return header + yaml.safe_dump(pod_config(cfg, name).model_dump(mode="json"), sort_keys=False)


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loopline", "app.kubernetes.io/instance": name}


def _amount(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _number(x: float) -> str:
    return str(_amount(x))


# Ray's raylet starts a worker process per CPU when a driver connects, for tasks loopline never sends (its roles
# are actors): off, as on the local Ray (distributed/cluster.py), so a pod's memory goes to the roles
NO_PRESTART_ENV = {"name": "RAY_prestart_worker_first_driver", "value": "0"}


def _container(
    role: str, image: str, k8s: K8sConfig, resources: dict[str, str], mounts: list[dict]
) -> dict[str, Any]:
    return {
        "name": f"ray-{role}",
        "image": image or k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "env": [dict(NO_PRESTART_ENV)],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "volumeMounts": mounts,
    }


def _pod_spec(k8s: K8sConfig, pods: PodPlacement, container: dict, volumes: list[dict]) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [container], "volumes": volumes}
    if pods.node_selector:
        spec["nodeSelector"] = dict(pods.node_selector)
    if pods.tolerations:
        spec["tolerations"] = [dict(t) for t in pods.tolerations]
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    return spec


def claim_name(k8s: K8sConfig, name: str) -> str:
    """The run volume's PersistentVolumeClaim: k8s.storage.claim, or <name>-runs (rendered)."""
    return k8s.storage.claim or f"{name}-runs"


def claim_objects(cfg: RunConfig, name: str) -> list[dict[str, Any]]:
    """The run volume's PersistentVolumeClaim to create, or none when k8s.storage.claim names an existing one."""
    k8s = cfg.k8s
    if k8s.storage.claim:
        return []
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],  # every pod mounts it: checkpoints written by all trainer ranks
        "resources": {"requests": {"storage": k8s.storage.size}},
    }
    if k8s.storage.storage_class:
        claim["storageClassName"] = k8s.storage.storage_class
    meta = {"name": f"{name}-runs", "namespace": k8s.namespace, "labels": _labels(name)}
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}]


def _volumes(k8s: K8sConfig, name: str, config: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the run volume and /dev/shm on every pod; the config only where the driver runs."""
    claim = claim_name(k8s, name)
    # /dev/shm in memory: Ray's object store and torch's shared tensors outgrow a container's default 64 MiB
    volumes: list[dict] = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts: list[dict] = [
        {"name": "runs", "mountPath": k8s.storage.mount_path},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if config:
        volumes.append({"name": "config", "configMap": {"name": f"{name}-config"}})
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
    return volumes, mounts


def _head(cfg: RunConfig, name: str) -> dict[str, Any]:
    k8s, head = cfg.k8s, cfg.k8s.head
    resources = {"cpu": _number(head.cpu), "memory": head.memory or head_memory(cfg)}
    if head.gpu:
        resources["nvidia.com/gpu"] = str(head.gpu)
    volumes, mounts = _volumes(k8s, name, config=True)
    # on ray the roles run on the worker groups: the head (GCS, driver) takes no actor of the placement
    params = {"num-cpus": "0"} if cfg.runtime.backend == "ray" else {}
    return {
        "rayStartParams": params,
        "template": {
            "metadata": {"labels": _labels(name)},
            "spec": _pod_spec(k8s, head, _container("head", head.image, k8s, resources, mounts), volumes),
        },
    }


def _whole(pool: PoolConfig, key: str, per_pod: int, field: str) -> int:
    amount = pool.resources.get(key, 0.0) * per_pod
    if not float(amount).is_integer():
        raise UserError(
            f"k8s.groups.{pool.name}.bundles_per_pod: {per_pod} bundle(s) of {pool.resources} make {amount:g} {key} "
            f"per pod, and a pod's {field} must be whole: choose bundles_per_pod so that it is"
        )
    return int(amount)


def _worker_group(cfg: RunConfig, pool: PoolConfig, roles: tuple[str, ...], name: str) -> dict[str, Any]:
    k8s = cfg.k8s
    group = k8s.groups.get(pool.name, WorkerGroupConfig())
    per_pod = group.bundles_per_pod
    if pool.bundles % per_pod:
        raise UserError(
            f"k8s.groups.{pool.name}.bundles_per_pod={per_pod} does not divide pool '{pool.name}' "
            f"({pool.bundles} bundles): every pod holds the same number of bundles"
        )
    replicas = pool.bundles // per_pod
    cpus = _whole(pool, "CPU", per_pod, "CPU count (Ray's num-cpus)")
    gpus = _whole(pool, "GPU", per_pod, "GPU count")
    memory = group.memory or group_memory(cfg, pool.name, per_pod, gpu=gpus > 0)
    resources = {"cpu": str(max(cpus, 1)), "memory": memory}
    params = {"num-cpus": str(cpus)}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
        params["num-gpus"] = str(gpus)
    if "memory" in pool.resources:  # Ray's memory resource, in bytes
        params["memory"] = str(int(pool.resources["memory"] * per_pod))
    custom = {k: _amount(v * per_pod) for k, v in pool.resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        # a JSON object inside quotes: KubeRay pastes the value into `ray start --resources=...`
        params["resources"] = '"' + json.dumps(custom).replace('"', '\\"') + '"'
    low, high = replicas, replicas
    if group.max_replicas is not None:
        if set(roles) - AUTOSCALED_ROLES:
            raise UserError(
                f"k8s.groups.{pool.name}: only the env workers' pool may autoscale; pool '{pool.name}' holds "
                f"{', '.join(roles)}, whose placement group is reserved whole when the run starts"
            )
        low, high = group.min_replicas or 0, group.max_replicas
        if not low <= replicas <= high:
            raise UserError(
                f"k8s.groups.{pool.name}: the pool starts with {replicas} pod(s), outside min_replicas..max_replicas "
                f"({low}..{high})"
            )
    volumes, mounts = _volumes(k8s, name, config=False)
    return {
        "groupName": pool.name,
        "replicas": replicas,
        "minReplicas": low,
        "maxReplicas": high,
        "rayStartParams": params,
        "template": {
            "metadata": {"labels": _labels(name)},
            "spec": _pod_spec(k8s, group, _container("worker", group.image, k8s, resources, mounts), volumes),
        },
    }


def _check_groups(cfg: RunConfig) -> list[PoolConfig]:
    """The pools that become worker groups (none on the local backend); k8s.groups may name only those."""
    pools = cfg.runtime.pools().pools if cfg.runtime.backend == "ray" else []
    names = [p.name for p in pools]
    unknown = sorted(set(cfg.k8s.groups) - set(names))
    if unknown:
        where = (
            f"the pools are: {', '.join(names)}"
            if names
            else "runtime.backend=local has no worker groups (the head pod runs the whole run: size it with k8s.head)"
        )
        raise UserError(f"k8s.groups names no placement pool: {', '.join(unknown)}; {where}")
    for i, pool in enumerate(pools):
        if not is_dns_label(pool.name):
            raise UserError(
                f"runtime.placement.pools[{i}].name: {pool.name!r} becomes a KubeRay worker group name, which "
                "must be a DNS label (lowercase letters, digits and '-')"
            )
    return pools


# The commands a job can run: those that resume, so that a retried job continues
JOB_COMMANDS = tuple(RESUMED_PHASES)


# What render's refusal of a local file says to run when it does not know the command line (render() called
# from Python; the CLI passes the user's own arguments)
STAGE_HINT = "loopline k8s stage CONFIG [OVERRIDES] --out DIR"


def render(cfg: RunConfig, command: str = "train", stage_command: str = STAGE_HINT) -> list[dict[str, Any]]:
    """The run's objects, in the order to create them: ConfigMap, PersistentVolumeClaim (unless
    k8s.storage.claim names one), RayJob running `loopline <command>`. Raises UserError naming the config field
    that cannot be rendered, one line per file the config names on this machine only (with `stage_command`, which
    copies them onto the run's volume)."""
    if command not in JOB_COMMANDS:
        raise UserError(
            f"a job runs one of {', '.join(JOB_COMMANDS)} (they resume when retried), not {command!r}"
        )
    refuse_local(cfg, stage_command)
    k8s = cfg.k8s
    name = job_name(cfg)
    pools = _check_groups(cfg)
    placement = cfg.runtime.pools()
    meta = {"namespace": k8s.namespace, "labels": _labels(name)}
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", **meta},
            "data": {CONFIG_FILE: run_yaml(cfg, name, command)},
        }
    ]
    objects += claim_objects(cfg, name)
    job_labels = _labels(name)
    if k8s.queue:
        job_labels["kueue.x-k8s.io/queue-name"] = k8s.queue
    if k8s.priority_class:
        job_labels["kueue.x-k8s.io/priority-class"] = k8s.priority_class
    spec: dict[str, Any] = {
        # a retried job (a lost pod) reruns this: it continues from the newest checkpoint, or starts again
        # from step 0 if the first attempt died before its first save
        "entrypoint": _entrypoint(command),
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": k8s.ttl_after_finished_s,
        "backoffLimit": k8s.backoff_limit,
        "submissionMode": "K8sJobMode",
    }
    if k8s.active_deadline_s:
        spec["activeDeadlineSeconds"] = k8s.active_deadline_s
    if k8s.queue:
        spec["suspend"] = True  # Kueue unsuspends it when the queue admits it
    spec["rayClusterSpec"] = {
        "rayVersion": k8s.ray_version,
        "enableInTreeAutoscaling": _autoscaled(k8s, pools),
        "headGroupSpec": _head(cfg, name),
        "workerGroupSpecs": [_worker_group(cfg, p, placement.roles_on(p.name), name) for p in pools],
    }
    objects.append(
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": name, "namespace": k8s.namespace, "labels": job_labels},
            "spec": spec,
        }
    )
    return objects
