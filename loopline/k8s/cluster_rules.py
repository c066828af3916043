"""KubeRay's rules for the RayCluster a RayJob embeds (ValidateRayClusterSpec and what it calls, the RayCluster
webhook's unique group names, the upgrade-strategy rule); the RayJob's own rules are in loopline.k8s.rules,
which also holds the sources and the assumptions these are read from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from loopline.k8s.manifest import (
    AUTOSCALER_V2_ENV,
    CLUSTER,
    EXTERNAL_STORAGE_NS_ANNOTATION,
    FT_ENABLED_ANNOTATION,
    HEAD,
    HEAD_POD,
    INT32_MAX,
    RAY_RESOURCE_PARAMS,
    as_int,
    as_list,
    as_map,
    autoscaling_on,
    env_of,
    head_container,
    head_env_path,
    is_label_value,
    is_qualified_name,
    parse_version,
    uses_autoscaler_v2,
    wants_autoscaler_v2,
    worker_groups,
    worker_path,
)


def cluster_spec_problems(cluster: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """ValidateRayClusterSpec on the embedded rayClusterSpec (annotations are the RayJob's)."""
    head = as_map(cluster.get("headGroupSpec"))
    if not as_list(as_map(as_map(head.get("template")).get("spec")).get("containers")):
        yield (
            f"{HEAD_POD}.containers: empty; the head group needs at least one container (the first runs Ray)"
        )
    yield from _group_params(HEAD, head)
    for i, group in worker_groups(cluster):
        yield from _worker_group(worker_path(i), group, cluster)
    yield from _fault_tolerance(cluster, annotations)
    yield from _autoscaler(cluster)
    yield from _gated_features(cluster)
    yield from _auth(cluster)


def _group_params(path: str, group: Mapping[str, Any]) -> Iterator[str]:
    """validateRayGroupResources and validateRayGroupLabels, for the head or a worker group."""
    params = as_map(group.get("rayStartParams"))
    in_params = [p for p in RAY_RESOURCE_PARAMS if params.get(p)]
    if in_params and as_map(group.get("resources")):
        yield (
            f"{path}.resources: set while rayStartParams also sets {', '.join(in_params)}; "
            "declare Ray resources in one of the two places only"
        )
    if "labels" in params:
        yield f"{path}.rayStartParams.labels: not supported; put Ray node labels in {path}.labels instead"
    for key, value in as_map(group.get("labels")).items():
        if not is_qualified_name(str(key)):
            yield (
                f"{path}.labels[{key}]: {key!r} is not a valid label key; "
                "use an optional DNS subdomain prefix and '/', then at most 63 alphanumerics, "
                "'-', '_' or '.', starting and ending alphanumeric"
            )
        if not is_label_value(value):
            yield (
                f"{path}.labels[{key}]: value {value!r} is not a valid label value; use at most 63 "
                "alphanumerics, '-', '_' or '.', starting and ending alphanumeric (or empty)"
            )


def _worker_group(path: str, group: Mapping[str, Any], cluster: Mapping[str, Any]) -> Iterator[str]:
    """The per-worker-group rules of ValidateRayClusterSpec."""
    if not as_list(as_map(as_map(group.get("template")).get("spec")).get("containers")):
        yield f"{path}.template.spec.containers: empty; a worker group needs at least one container"
    low, high = as_int(group.get("minReplicas")), as_int(group.get("maxReplicas"))
    low, high = (0 if low is None else low), (INT32_MAX if high is None else high)  # the CRD's defaults
    if low < 0:
        yield f"{path}.minReplicas: {low} is negative; KubeRay accepts 0 or more"
    if high < 0:
        yield f"{path}.maxReplicas: {high} is negative; KubeRay accepts 0 or more"
    if 0 <= high < low:  # a negative maxReplicas is reported once, above
        yield (
            f"{path}.minReplicas: {low} is greater than maxReplicas {high}; "
            "minReplicas must be <= maxReplicas"
        )
    yield from _group_params(path, group)
    idle = as_int(group.get("idleTimeoutSeconds"))
    if idle is not None and idle < 0:
        yield f"{path}.idleTimeoutSeconds: {idle} is negative; KubeRay accepts 0 or more seconds"
    elif idle is not None and not wants_autoscaler_v2(cluster):
        yield (
            f"{path}.idleTimeoutSeconds: set without autoscaler v2; it is accepted only with "
            "spec.rayClusterSpec.autoscalerOptions.version: v2"
        )
    yield from _worker_priority(path, group, cluster)
    if group.get("suspend") is True and autoscaling_on(cluster):
        yield (
            f"{path}.suspend: true with enableInTreeAutoscaling: true; "
            "a worker group can be suspended only without autoscaling"
        )


def _worker_priority(path: str, group: Mapping[str, Any], cluster: Mapping[str, Any]) -> Iterator[str]:
    """validateWorkerGroupPriority: a non-zero priority needs Ray >= 2.56.0 and autoscaler v2."""
    priority = as_int(group.get("priority"))
    if not priority:
        return
    version = parse_version(cluster.get("rayVersion"))
    if version is None or version < (2, 56, 0):
        yield (
            f"{path}.priority: set with rayVersion {cluster.get('rayVersion')!r}; "
            "a worker group priority needs spec.rayClusterSpec.rayVersion 2.56.0 or later"
        )
    elif not wants_autoscaler_v2(cluster):
        yield (
            f"{path}.priority: {priority} without autoscaler v2; "
            "a worker group priority is accepted only with spec.rayClusterSpec.autoscalerOptions.version: v2"
        )


def _fault_tolerance(cluster: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """GCS fault tolerance: configured through gcsFaultToleranceOptions only, never through env or params."""
    options = cluster.get("gcsFaultToleranceOptions")
    head_params = as_map(as_map(cluster.get("headGroupSpec")).get("rayStartParams"))
    env = env_of(head_container(cluster))
    ft_annotation = annotations.get(FT_ENABLED_ANNOTATION)
    if ft_annotation and options is not None:
        yield (
            f"metadata.annotations[{FT_ENABLED_ANNOTATION}]: set together with gcsFaultToleranceOptions; "
            "configure GCS fault tolerance with gcsFaultToleranceOptions only"
        )
    ft_enabled = options is not None or str(ft_annotation).lower() == "true"
    if not ft_enabled and "RAY_REDIS_ADDRESS" in env:
        yield (
            f"{head_env_path(env['RAY_REDIS_ADDRESS'][0])}: RAY_REDIS_ADDRESS turns on GCS fault tolerance "
            "implicitly; set spec.rayClusterSpec.gcsFaultToleranceOptions instead"
        )
    if options is not None:
        yield from _fault_tolerance_options(as_map(options), head_params, env, annotations)
    if head_params.get("redis-username"):
        yield (
            f"{HEAD}.rayStartParams.redis-username: not accepted; "
            "set gcsFaultToleranceOptions.redisUsername instead"
        )
    if "REDIS_USERNAME" in env:
        yield (
            f"{head_env_path(env['REDIS_USERNAME'][0])}: REDIS_USERNAME is not accepted; "
            "set gcsFaultToleranceOptions.redisUsername instead"
        )


def _fault_tolerance_options(
    options: Mapping[str, Any],
    head_params: Mapping[str, Any],
    env: Mapping[str, tuple[int, Any]],
    annotations: Mapping[str, Any],
) -> Iterator[str]:
    """With gcsFaultToleranceOptions set: what they replace, and their backend (rocksdb is gated)."""
    if head_params.get("redis-password"):
        yield (
            f"{HEAD}.rayStartParams.redis-password: set with gcsFaultToleranceOptions; use its redisPassword"
        )
    for name, replacement in (("REDIS_PASSWORD", "redisPassword"), ("RAY_REDIS_ADDRESS", "redisAddress")):
        if name in env:
            yield (
                f"{head_env_path(env[name][0])}: {name} set with gcsFaultToleranceOptions; "
                f"use its {replacement}"
            )
    if annotations.get(EXTERNAL_STORAGE_NS_ANNOTATION):
        yield (
            f"metadata.annotations[{EXTERNAL_STORAGE_NS_ANNOTATION}]: set with gcsFaultToleranceOptions; "
            "use its externalStorageNamespace"
        )
    path = f"{CLUSTER}.gcsFaultToleranceOptions"
    if options.get("backend") == "rocksdb":
        yield (
            f"{path}.backend: rocksdb needs KubeRay's GCSFaultToleranceEmbeddedStorage feature gate, "
            "off by default; use the redis backend"
        )
    elif options.get("storage") is not None:
        yield f"{path}.storage: set with the redis backend; it applies only to the rocksdb backend"


def _autoscaler(cluster: Mapping[str, Any]) -> Iterator[str]:
    """The autoscaler's switches: v2 by env or by options, restart policies under v2, autoscalerOptions."""
    env = env_of(head_container(cluster))
    options = as_map(cluster.get("autoscalerOptions"))
    v2_env = env.get(AUTOSCALER_V2_ENV)
    if not autoscaling_on(cluster) and v2_env and v2_env[1] in ("1", "true"):
        yield (
            f"{head_env_path(v2_env[0])}: {AUTOSCALER_V2_ENV}={v2_env[1]} without autoscaling; "
            "set enableInTreeAutoscaling: true to use autoscaler v2, or drop the variable"
        )
    if autoscaling_on(cluster):
        if options.get("version") is not None and v2_env:
            yield (
                f"{head_env_path(v2_env[0])}: {AUTOSCALER_V2_ENV} set together with "
                "autoscalerOptions.version; choose the autoscaler with autoscalerOptions.version only"
            )
        if uses_autoscaler_v2(cluster):
            yield from _v2_restart_policies(cluster)
    idle = as_int(options.get("idleTimeoutSeconds"))
    if idle is not None and idle < 0:
        yield (
            f"{CLUSTER}.autoscalerOptions.idleTimeoutSeconds: {idle} is negative; KubeRay accepts 0 or more"
        )
    for k, var in enumerate(as_list(options.get("env"))):
        if as_map(var).get("name") == "KUBERAY_GEN_AUTOSCALER_START_CMD":
            yield (
                f"{CLUSTER}.autoscalerOptions.env[{k}]: "
                "KUBERAY_GEN_AUTOSCALER_START_CMD is managed by KubeRay; remove it"
            )


def _v2_restart_policies(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Under autoscaler v2 every pod must use restartPolicy Never (or leave it unset)."""
    groups = [(HEAD, as_map(cluster.get("headGroupSpec")))] + [
        (worker_path(i), g) for i, g in worker_groups(cluster)
    ]
    for path, group in groups:
        policy = as_map(as_map(group.get("template")).get("spec")).get("restartPolicy")
        if policy not in (None, "", "Never"):
            yield (
                f"{path}.template.spec.restartPolicy: {policy} with autoscaler v2; "
                "use Never or leave it unset"
            )


# Cluster features behind KubeRay feature gates that are off by default: field -> gate.
_GATED_FIELDS = {
    "historyServerOptions": "RayClusterHistoryServer",
    "networkPolicy": "RayClusterNetworkPolicy",
    "tlsOptions": "RayClusterMTLS",
}


def _gated_features(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Fields that KubeRay refuses unless a feature gate, off by default, is turned on."""
    for key, gate in _GATED_FIELDS.items():
        if cluster.get(key) is not None:
            yield f"{CLUSTER}.{key}: needs KubeRay's {gate} feature gate, off by default; remove it"


def _auth(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Token authentication needs a known Ray version >= 2.52.0; Kubernetes token auth is not for RayJobs."""
    auth = as_map(cluster.get("authOptions"))
    if auth.get("enableK8sTokenAuth") is True:
        yield (
            f"{CLUSTER}.authOptions.enableK8sTokenAuth: not supported for a RayJob; leave it unset or false"
        )
        return  # KubeRay stops here for a RayJob
    if auth.get("mode") == "token":
        version = parse_version(cluster.get("rayVersion"))
        if version is None or version < (2, 52, 0):
            yield (
                f"{CLUSTER}.rayVersion: {cluster.get('rayVersion')!r} with authOptions.mode token; "
                "token authentication needs rayVersion 2.52.0 or later"
            )


def cluster_created_by_rayjob(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Rules KubeRay applies to the RayCluster the RayJob creates: its webhook and its controller."""
    seen: set[Any] = set()
    for i, group in worker_groups(cluster):
        name = group.get("groupName")
        if name in seen:
            yield (
                f"{worker_path(i)}.groupName: {name!r} repeats an earlier worker group's name; "
                "names must be unique"
            )
        seen.add(name)
    if as_map(cluster.get("upgradeStrategy")).get("type") is not None:
        yield (
            f"{CLUSTER}.upgradeStrategy.type: set on a RayJob's cluster; "
            "an upgrade strategy is accepted only on a RayCluster created directly"
        )
