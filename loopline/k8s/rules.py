"""The admission rules that KubeRay and Kueue apply to a RayJob and that its CRD schema cannot express.

A rendered RayJob (a plain dict, as it would be submitted) is checked here before submission, so that what the
operator or the webhook would refuse is refused locally, naming the field. Each problem is one line:
``<dotted field path>: <what is wrong>; <what is accepted>``. Unlike the Go code, which stops at the first
error, every problem is reported. The CRD schema itself (types, enums, CEL rules, minimums) is checked
elsewhere (loopline.k8s.checks); a few schema rules that the Go code repeats are repeated here too.

Reimplemented (not translated) from:

- KubeRay ``ray-project/kuberay@feeaf72facab4881ba2b179248bb67315634e229``:
  ``ray-operator/controllers/ray/utils/validation.go`` (ValidateRayJobMetadata, ValidateRayJobSpec and what it
  calls: validateDeletionConfiguration, validateLegacyDeletionPolicies, validateDeletionRules,
  ValidateRayClusterSpec, validateRayGroupResources, validateRayGroupLabels, validateWorkerGroupIdleTimeout,
  validateWorkerGroupPriority, validateGcsFaultToleranceBackend; ValidateRayClusterUpgradeOptions, which the
  RayCluster controller applies to the cluster a RayJob creates), ``ray-operator/pkg/webhooks/v1/
  raycluster_webhook.go`` (unique worker group names, checked on the RayCluster the RayJob creates) and the
  feature-gate defaults in ``ray-operator/pkg/features/features.go``. KubeRay's RayJob webhook checks only the
  metadata; the spec rules run when the operator first reconciles the job, which then fails.
- Kueue ``kubernetes-sigs/kueue@ff69552e79ad21652c36caa97038382e55625cf7``:
  ``pkg/controller/jobs/rayjob/rayjob_webhook.go`` (validateCreate),
  ``pkg/controller/jobs/raycluster/common.go`` (ValidateCreate),
  ``pkg/controller/jobframework/validation.go`` (ValidateJobOnCreate) and
  ``pkg/controller/jobframework/constants.go`` (MaxPodSets = 18).

One rule is loopline's own, stricter than Kueue's webhook: the pod-set limit counts the submitter Job of
K8sJobMode, which Kueue's Workload holds but the webhook does not count (such a job would pass the webhook and
then never get a Workload).

Both operators are assumed to run with their default feature gates: in KubeRay RayJobDeletionPolicy is on and
RayClusterHistoryServer, RayClusterNetworkPolicy, RayClusterMTLS and GCSFaultToleranceEmbeddedStorage are off;
in Kueue ElasticJobsViaWorkloadSlices, TopologyAwareScheduling and WorkloadIdentifierAnnotations are on.

Deliberately left out:

- Update-only rules (immutable fields, queue-name and priority-class changes, elastic-job toggling) and the
  RayJob status rule: a manifest about to be created has no old version and no status.
- Rules that need a live cluster: whether the LocalQueue or WorkloadPriorityClass exists, the pod-set checks
  of Kueue's topology-aware scheduling (they read the job's pod sets through the client).
- The rules behind a gate that is off by default: they are reported as "needs feature gate X" and go no
  further (GCS storage on rocksdb, network policy and TLS details, history-server collector options).
- Rules the CRD schema already enforces through CEL, enums or minimums (deletion strategy shape, a deletion
  condition's exclusive fields, negative deletion TTLs), and KubeRay's "minReplicas and maxReplicas must be
  set without autoscaling": the API server defaults them to 0 and 2147483647 first, so it can never fire.
- A rule that replicas lie within [minReplicas, maxReplicas]: KubeRay has none, it clamps replicas instead.
- Kueue's checks of TAS pod-set annotations and of the admission-gated-by annotation: loopline sets neither.
- Kueue has no creation-time rule on the priority-class label, nor on the submission mode.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any

import yaml

MAX_RAYJOB_NAME = 47  # KubeRay: 53 (RayCluster names) minus the 6-character suffix of the generated cluster
MAX_KUEUE_POD_SETS = 18  # Kueue's jobframework.MaxPodSets: the head group counts as one
INT32_MAX = 2**31 - 1

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MAX_EXEC_TIME_LABEL = "kueue.x-k8s.io/max-exec-time-seconds"
PREBUILT_WORKLOAD_KEY = "kueue.x-k8s.io/prebuilt-workload-name"  # a label, or (preferred) an annotation
ELASTIC_JOB_ANNOTATION = "kueue.x-k8s.io/elastic-job"
FT_ENABLED_ANNOTATION = "ray.io/ft-enabled"
EXTERNAL_STORAGE_NS_ANNOTATION = "ray.io/external-storage-namespace"
CLUSTER_SELECTOR_KEY = "ray.io/cluster"
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
RAY_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")

_CLUSTER = "spec.rayClusterSpec"
_HEAD = f"{_CLUSTER}.headGroupSpec"
_HEAD_POD = f"{_HEAD}.template.spec"

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_GENERIC_VERSION = re.compile(r"\s*v?(\d+(?:\.\d+)+)")


# ---------------------------------------------------------------------------------------------------------
# Small helpers over the plain-dict manifest
# ---------------------------------------------------------------------------------------------------------


def _map(value: Any) -> Mapping[str, Any]:
    """`value` if it is a mapping, else an empty one (a wrong type is the schema check's business)."""
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    """`value` if it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    """`value` if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _worker(i: int) -> str:
    """The field path of worker group `i`."""
    return f"{_CLUSTER}.workerGroupSpecs[{i}]"


def _is_dns1123_subdomain(value: str) -> bool:
    """Kubernetes' DNS-1123 subdomain: dot-separated lowercase labels, at most 253 characters."""
    return len(value) <= 253 and all(_DNS1123_LABEL.fullmatch(part) for part in value.split("."))


def _is_dns1035_label(value: str) -> bool:
    """Kubernetes' DNS-1035 label: lowercase alphanumerics and '-', starting with a letter, at most 63."""
    return len(value) <= 63 and bool(_DNS1035_LABEL.fullmatch(value))


def _is_qualified_name(key: str) -> bool:
    """A label key: an optional DNS-1123 subdomain prefix and '/', then a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if "/" in prefix or (key.count("/") == 1 and not (prefix and _is_dns1123_subdomain(prefix))):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def _is_label_value(value: Any) -> bool:
    """A label value: empty, or a name of at most 63 characters."""
    return isinstance(value, str) and (
        value == "" or (len(value) <= 63 and bool(_LABEL_NAME.fullmatch(value)))
    )


def _version(value: Any) -> tuple[int, ...] | None:
    """The numeric part of a "generic" version ("2.52.0", "v2.52"); None when it has fewer than two parts."""
    match = _GENERIC_VERSION.match(value) if isinstance(value, str) else None
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def _env(container: Mapping[str, Any]) -> dict[str, tuple[int, Any]]:
    """A container's environment: name -> (index in env, value)."""
    out: dict[str, tuple[int, Any]] = {}
    for k, var in enumerate(_list(container.get("env"))):
        name = _map(var).get("name")
        if isinstance(name, str) and name not in out:
            out[name] = (k, _map(var).get("value"))
    return out


def _head_container(cluster: Mapping[str, Any]) -> Mapping[str, Any]:
    """The head's Ray container (the first one); empty when there is none."""
    containers = _list(
        _map(_map(_map(cluster.get("headGroupSpec")).get("template")).get("spec")).get("containers")
    )
    return _map(containers[0]) if containers else {}


def _head_env_path(env_index: int) -> str:
    """The field path of the head container's env entry `env_index`."""
    return f"{_HEAD_POD}.containers[0].env[{env_index}]"


def _autoscaling(cluster: Mapping[str, Any]) -> bool:
    """Whether in-tree autoscaling is on."""
    return cluster.get("enableInTreeAutoscaling") is True


def _autoscaler_v2(cluster: Mapping[str, Any]) -> bool:
    """Whether autoscalerOptions.version selects autoscaler v2."""
    return _map(cluster.get("autoscalerOptions")).get("version") == "v2"


def _wants_autoscaler_v2(cluster: Mapping[str, Any]) -> bool:
    """Whether v2 is selected by autoscalerOptions.version or by the head's RAY_enable_autoscaler_v2."""
    _, value = _env(_head_container(cluster)).get(AUTOSCALER_V2_ENV, (0, None))
    return _autoscaler_v2(cluster) or value in ("1", "true")


def _workers(cluster: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """The worker groups, with their indexes."""
    return [(i, _map(group)) for i, group in enumerate(_list(cluster.get("workerGroupSpecs")))]


# ---------------------------------------------------------------------------------------------------------
# KubeRay
# ---------------------------------------------------------------------------------------------------------


def kuberay_problems(rayjob: dict[str, Any]) -> list[str]:
    """Every rule KubeRay applies to a new RayJob (metadata, spec, embedded rayClusterSpec) that it breaks."""
    meta = _map(rayjob.get("metadata"))
    spec = _map(rayjob.get("spec"))
    problems = [*_rayjob_name(meta), *_rayjob_spec(spec)]
    if spec.get("rayClusterSpec") is not None:
        cluster = _map(spec["rayClusterSpec"])
        problems += [
            *_cluster_spec(cluster, _map(meta.get("annotations"))),
            *_cluster_created_by_rayjob(cluster),
        ]
    return problems


def _rayjob_name(meta: Mapping[str, Any]) -> Iterator[str]:
    """ValidateRayJobMetadata: the name bounds the generated RayCluster's name and its services' names."""
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return  # a missing name is the schema check's finding
    if len(name) > MAX_RAYJOB_NAME:
        yield (
            f"metadata.name: {name!r} has {len(name)} characters; KubeRay accepts at most {MAX_RAYJOB_NAME} "
            "(it appends 6 to name the RayCluster, whose names are capped at 53)"
        )
    if not _is_dns1035_label(name):
        yield (
            f"metadata.name: {name!r} is not a DNS-1035 label; use lowercase letters, digits and '-', "
            "starting with a letter and ending with a letter or digit"
        )


def _rayjob_spec(spec: Mapping[str, Any]) -> Iterator[str]:
    """ValidateRayJobSpec, apart from the embedded rayClusterSpec."""
    yield from _lifecycle(spec)
    yield from _deletion_strategy(spec)
    yield from _cluster_source(spec)
    yield from _submission_mode(spec)
    yield from _runtime_env(spec)


def _lifecycle(spec: Mapping[str, Any]) -> Iterator[str]:
    """Suspension, TTL, deadlines and retries."""
    shutdown = spec.get("shutdownAfterJobFinishes") is True
    if spec.get("suspend") is True and not shutdown:
        yield (
            "spec.suspend: a RayJob with shutdownAfterJobFinishes false cannot be suspended; "
            "set shutdownAfterJobFinishes: true, or do not suspend it"
        )
    ttl = _int(spec.get("ttlSecondsAfterFinished"))
    if ttl is not None and ttl < 0:
        yield f"spec.ttlSecondsAfterFinished: {ttl} is negative; KubeRay accepts 0 or more seconds"
    if ttl is not None and ttl > 0 and not shutdown:
        yield (
            f"spec.ttlSecondsAfterFinished: {ttl} is set while shutdownAfterJobFinishes is false; "
            "a TTL is accepted only with shutdownAfterJobFinishes: true"
        )
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        value = _int(spec.get(key))
        if value is not None and value <= 0:
            yield (
                f"spec.{key}: {value} is not positive; KubeRay accepts 1 or more seconds, or the field unset"
            )
    backoff = _int(spec.get("backoffLimit"))
    if backoff is not None and backoff < 0:
        yield f"spec.backoffLimit: {backoff} is negative; KubeRay accepts 0 or more retries"


def _deletion_strategy(spec: Mapping[str, Any]) -> Iterator[str]:
    """validateDeletionConfiguration and the legacy / rules checks it calls (the shape is CEL's)."""
    strategy = _map(spec.get("deletionStrategy"))
    if not strategy:
        return
    path = "spec.deletionStrategy"
    selector_mode = bool(_map(spec.get("clusterSelector")))
    autoscaling = _autoscaling(_map(spec.get("rayClusterSpec")))
    shutdown = spec.get("shutdownAfterJobFinishes") is True
    rules = _list(strategy.get("deletionRules"))
    if rules and shutdown:
        yield (
            f"{path}.deletionRules: set together with shutdownAfterJobFinishes: true; "
            "use one or the other (the rules decide what is deleted and when)"
        )
    # onSuccess/onFailure with deletionRules too: CEL refuses the strategy, and KubeRay checks only the rules.
    legacy = {} if rules else {k: _map(strategy.get(k)) for k in ("onSuccess", "onFailure") if k in strategy}
    for key, policy_spec in legacy.items():
        policy = policy_spec.get("policy")
        where = f"{path}.{key}.policy"
        if policy is None:
            yield (
                f"{where}: unset; a legacy deletion strategy needs a policy for both onSuccess and onFailure"
            )
        elif selector_mode and policy in ("DeleteCluster", "DeleteWorkers"):
            yield (
                f"{where}: {policy} with clusterSelector; "
                "a RayJob on an existing cluster accepts DeleteSelf or DeleteNone"
            )
        elif policy == "DeleteWorkers" and autoscaling:
            yield (
                f"{where}: DeleteWorkers with enableInTreeAutoscaling: true; "
                "use DeleteCluster, DeleteSelf or DeleteNone"
            )
        elif policy == "DeleteNone" and shutdown:
            yield (
                f"{where}: DeleteNone with shutdownAfterJobFinishes: true; "
                "pick a deleting policy or set it to false"
            )
    yield from _deletion_rules(rules, selector_mode, autoscaling)


# KubeRay deletes in this order, so along it the TTLs of one condition must not decrease.
_DELETION_ORDER = ("DeleteWorkers", "DeleteCluster", "DeleteSelf")


def _deletion_rules(rules: list[Any], selector_mode: bool, autoscaling: bool) -> Iterator[str]:
    """validateDeletionRules: per-rule context, unique (condition, policy) pairs, TTLs in deletion order."""
    ttls: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    for i, raw in enumerate(rules):
        rule, where = _map(raw), f"spec.deletionStrategy.deletionRules[{i}]"
        policy, condition = rule.get("policy"), _map(rule.get("condition"))
        if selector_mode and policy in ("DeleteCluster", "DeleteWorkers"):
            yield (
                f"{where}.policy: {policy} with clusterSelector; "
                "a RayJob on an existing cluster accepts DeleteSelf or DeleteNone"
            )
            continue
        if autoscaling and policy == "DeleteWorkers":
            yield (
                f"{where}.policy: DeleteWorkers with enableInTreeAutoscaling: true; "
                "use DeleteCluster, DeleteSelf or DeleteNone"
            )
            continue
        kind = "jobStatus" if "jobStatus" in condition else "jobDeploymentStatus"
        key = (kind, str(condition.get(kind)))
        if policy in ttls.setdefault(key, {}):
            yield (
                f"{where}: a second {policy} rule for {kind} {key[1]}; "
                "each (condition, policy) pair may appear once"
            )
            continue
        ttls[key][str(policy)] = (i, _int(condition.get("ttlSeconds")) or 0)
    for (kind, status), by_policy in ttls.items():
        ordered = [(p, *by_policy[p]) for p in _DELETION_ORDER if p in by_policy]
        for (prev, _, prev_ttl), (policy, i, ttl) in pairwise(ordered):
            if ttl < prev_ttl:
                yield (
                    f"spec.deletionStrategy.deletionRules[{i}].condition.ttlSeconds: "
                    f"{policy} after {ttl}s comes before {prev} after {prev_ttl}s for {kind} {status}; "
                    "TTLs must not decrease along DeleteWorkers, DeleteCluster, DeleteSelf"
                )


def _cluster_source(spec: Mapping[str, Any]) -> Iterator[str]:
    """A RayJob makes its own cluster (rayClusterSpec) or uses an existing one (clusterSelector)."""
    selector = _map(spec.get("clusterSelector"))
    if not selector:
        if spec.get("rayClusterSpec") is None:
            yield (
                "spec.rayClusterSpec: missing; "
                "a RayJob needs rayClusterSpec, or clusterSelector to use an existing cluster"
            )
        return
    if spec.get("suspend") is True:
        yield "spec.suspend: true with clusterSelector; a RayJob on an existing cluster cannot be suspended"
    if not selector.get(CLUSTER_SELECTOR_KEY):
        yield (
            f"spec.clusterSelector[{CLUSTER_SELECTOR_KEY}]: missing or empty; "
            "it must name the existing RayCluster"
        )
    if spec.get("submissionMode") == "SidecarMode":
        yield (
            "spec.submissionMode: SidecarMode with clusterSelector; "
            "use K8sJobMode, HTTPMode or InteractiveMode"
        )
    backoff = _int(spec.get("backoffLimit"))
    if backoff is not None and backoff > 0:
        yield (
            f"spec.backoffLimit: {backoff} with clusterSelector; "
            "a RayJob on an existing cluster accepts only 0"
        )


def _submission_mode(spec: Mapping[str, Any]) -> Iterator[str]:
    """What InteractiveMode and SidecarMode exclude."""
    mode = spec.get("submissionMode")
    backoff = _int(spec.get("backoffLimit"))
    if mode == "InteractiveMode" and backoff is not None and backoff > 0:
        yield (
            f"spec.backoffLimit: {backoff} with InteractiveMode; InteractiveMode accepts only 0 (no retries)"
        )
    if mode != "SidecarMode":
        return
    for key in ("submitterPodTemplate", "submitterConfig"):
        if spec.get(key) is not None:
            yield (
                f"spec.{key}: set with SidecarMode; "
                "SidecarMode runs no submitter pod, remove it or use K8sJobMode"
            )
    head_pod = _map(
        _map(_map(_map(spec.get("rayClusterSpec")).get("headGroupSpec")).get("template")).get("spec")
    )
    if head_pod.get("restartPolicy") not in (None, "", "Never"):
        yield (
            f"{_HEAD_POD}.restartPolicy: {head_pod['restartPolicy']} with SidecarMode; "
            "the head pod must use Never or leave it unset"
        )


def _runtime_env(spec: Mapping[str, Any]) -> Iterator[str]:
    """runtimeEnvYAML must parse as a YAML mapping (its content is Ray's business)."""
    text = spec.get("runtimeEnvYAML")
    if not isinstance(text, str) or not text:
        return
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        yield f"spec.runtimeEnvYAML: not valid YAML ({str(e).splitlines()[0]}); it must be a YAML mapping"
        return
    if parsed is not None and not isinstance(parsed, dict):
        yield f"spec.runtimeEnvYAML: a YAML {type(parsed).__name__}, not a mapping; it must be a YAML mapping"


def _cluster_spec(cluster: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """ValidateRayClusterSpec on the embedded rayClusterSpec (annotations are the RayJob's)."""
    head = _map(cluster.get("headGroupSpec"))
    if not _list(_map(_map(head.get("template")).get("spec")).get("containers")):
        yield (
            f"{_HEAD_POD}.containers: empty; the head group needs at least one container (the first runs Ray)"
        )
    yield from _group_params(_HEAD, head)
    for i, group in _workers(cluster):
        yield from _worker_group(_worker(i), group, cluster)
    yield from _fault_tolerance(cluster, annotations)
    yield from _autoscaler(cluster)
    yield from _gated_features(cluster)
    yield from _auth(cluster)


def _group_params(path: str, group: Mapping[str, Any]) -> Iterator[str]:
    """validateRayGroupResources and validateRayGroupLabels, for the head or a worker group."""
    params = _map(group.get("rayStartParams"))
    in_params = [p for p in RAY_RESOURCE_PARAMS if params.get(p)]
    if in_params and _map(group.get("resources")):
        yield (
            f"{path}.resources: set while rayStartParams also sets {', '.join(in_params)}; "
            "declare Ray resources in one of the two places only"
        )
    if "labels" in params:
        yield f"{path}.rayStartParams.labels: not supported; put Ray node labels in {path}.labels instead"
    for key, value in _map(group.get("labels")).items():
        if not _is_qualified_name(str(key)):
            yield (
                f"{path}.labels[{key}]: {key!r} is not a valid label key; "
                "use an optional DNS subdomain prefix and '/', then at most 63 alphanumerics, "
                "'-', '_' or '.', starting and ending alphanumeric"
            )
        if not _is_label_value(value):
            yield (
                f"{path}.labels[{key}]: value {value!r} is not a valid label value; use at most 63 "
                "alphanumerics, '-', '_' or '.', starting and ending alphanumeric (or empty)"
            )


def _worker_group(path: str, group: Mapping[str, Any], cluster: Mapping[str, Any]) -> Iterator[str]:
    """The per-worker-group rules of ValidateRayClusterSpec."""
    if not _list(_map(_map(group.get("template")).get("spec")).get("containers")):
        yield f"{path}.template.spec.containers: empty; a worker group needs at least one container"
    low, high = _int(group.get("minReplicas")), _int(group.get("maxReplicas"))
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
    idle = _int(group.get("idleTimeoutSeconds"))
    if idle is not None and idle < 0:
        yield f"{path}.idleTimeoutSeconds: {idle} is negative; KubeRay accepts 0 or more seconds"
    elif idle is not None and not _wants_autoscaler_v2(cluster):
        yield (
            f"{path}.idleTimeoutSeconds: set without autoscaler v2; it is accepted only with "
            "spec.rayClusterSpec.autoscalerOptions.version: v2"
        )
    yield from _worker_priority(path, group, cluster)
    if group.get("suspend") is True and _autoscaling(cluster):
        yield (
            f"{path}.suspend: true with enableInTreeAutoscaling: true; "
            "a worker group can be suspended only without autoscaling"
        )


def _worker_priority(path: str, group: Mapping[str, Any], cluster: Mapping[str, Any]) -> Iterator[str]:
    """validateWorkerGroupPriority: a non-zero priority needs Ray >= 2.56.0 and autoscaler v2."""
    priority = _int(group.get("priority"))
    if not priority:
        return
    version = _version(cluster.get("rayVersion"))
    if version is None or version < (2, 56, 0):
        yield (
            f"{path}.priority: set with rayVersion {cluster.get('rayVersion')!r}; "
            "a worker group priority needs spec.rayClusterSpec.rayVersion 2.56.0 or later"
        )
    elif not _wants_autoscaler_v2(cluster):
        yield (
            f"{path}.priority: {priority} without autoscaler v2; "
            "a worker group priority is accepted only with spec.rayClusterSpec.autoscalerOptions.version: v2"
        )


def _fault_tolerance(cluster: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """GCS fault tolerance: configured through gcsFaultToleranceOptions only, never through env or params."""
    options = cluster.get("gcsFaultToleranceOptions")
    head_params = _map(_map(cluster.get("headGroupSpec")).get("rayStartParams"))
    env = _env(_head_container(cluster))
    ft_annotation = annotations.get(FT_ENABLED_ANNOTATION)
    if ft_annotation and options is not None:
        yield (
            f"metadata.annotations[{FT_ENABLED_ANNOTATION}]: set together with gcsFaultToleranceOptions; "
            "configure GCS fault tolerance with gcsFaultToleranceOptions only"
        )
    ft_enabled = options is not None or str(ft_annotation).lower() == "true"
    if not ft_enabled and "RAY_REDIS_ADDRESS" in env:
        yield (
            f"{_head_env_path(env['RAY_REDIS_ADDRESS'][0])}: RAY_REDIS_ADDRESS turns on GCS fault tolerance "
            "implicitly; set spec.rayClusterSpec.gcsFaultToleranceOptions instead"
        )
    if options is not None:
        yield from _fault_tolerance_options(_map(options), head_params, env, annotations)
    if head_params.get("redis-username"):
        yield (
            f"{_HEAD}.rayStartParams.redis-username: not accepted; "
            "set gcsFaultToleranceOptions.redisUsername instead"
        )
    if "REDIS_USERNAME" in env:
        yield (
            f"{_head_env_path(env['REDIS_USERNAME'][0])}: REDIS_USERNAME is not accepted; "
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
            f"{_HEAD}.rayStartParams.redis-password: set with gcsFaultToleranceOptions; use its redisPassword"
        )
    for name, replacement in (("REDIS_PASSWORD", "redisPassword"), ("RAY_REDIS_ADDRESS", "redisAddress")):
        if name in env:
            yield (
                f"{_head_env_path(env[name][0])}: {name} set with gcsFaultToleranceOptions; "
                f"use its {replacement}"
            )
    if annotations.get(EXTERNAL_STORAGE_NS_ANNOTATION):
        yield (
            f"metadata.annotations[{EXTERNAL_STORAGE_NS_ANNOTATION}]: set with gcsFaultToleranceOptions; "
            "use its externalStorageNamespace"
        )
    path = f"{_CLUSTER}.gcsFaultToleranceOptions"
    if options.get("backend") == "rocksdb":
        yield (
            f"{path}.backend: rocksdb needs KubeRay's GCSFaultToleranceEmbeddedStorage feature gate, "
            "off by default; use the redis backend"
        )
    elif options.get("storage") is not None:
        yield f"{path}.storage: set with the redis backend; it applies only to the rocksdb backend"


def _autoscaler(cluster: Mapping[str, Any]) -> Iterator[str]:
    """The autoscaler's switches: v2 by env or by options, restart policies under v2, autoscalerOptions."""
    env = _env(_head_container(cluster))
    options = _map(cluster.get("autoscalerOptions"))
    v2_env = env.get(AUTOSCALER_V2_ENV)
    if not _autoscaling(cluster) and v2_env and v2_env[1] in ("1", "true"):
        yield (
            f"{_head_env_path(v2_env[0])}: {AUTOSCALER_V2_ENV}={v2_env[1]} without autoscaling; "
            "set enableInTreeAutoscaling: true to use autoscaler v2, or drop the variable"
        )
    if _autoscaling(cluster):
        if options.get("version") is not None and v2_env:
            yield (
                f"{_head_env_path(v2_env[0])}: {AUTOSCALER_V2_ENV} set together with "
                "autoscalerOptions.version; choose the autoscaler with autoscalerOptions.version only"
            )
        if _autoscaler_v2(cluster):
            yield from _v2_restart_policies(cluster)
    idle = _int(options.get("idleTimeoutSeconds"))
    if idle is not None and idle < 0:
        yield (
            f"{_CLUSTER}.autoscalerOptions.idleTimeoutSeconds: {idle} is negative; KubeRay accepts 0 or more"
        )
    for k, var in enumerate(_list(options.get("env"))):
        if _map(var).get("name") == "KUBERAY_GEN_AUTOSCALER_START_CMD":
            yield (
                f"{_CLUSTER}.autoscalerOptions.env[{k}]: "
                "KUBERAY_GEN_AUTOSCALER_START_CMD is managed by KubeRay; remove it"
            )


def _v2_restart_policies(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Under autoscaler v2 every pod must use restartPolicy Never (or leave it unset)."""
    groups = [(_HEAD, _map(cluster.get("headGroupSpec")))] + [(_worker(i), g) for i, g in _workers(cluster)]
    for path, group in groups:
        policy = _map(_map(group.get("template")).get("spec")).get("restartPolicy")
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
            yield f"{_CLUSTER}.{key}: needs KubeRay's {gate} feature gate, off by default; remove it"


def _auth(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Token authentication needs a known Ray version >= 2.52.0; Kubernetes token auth is not for RayJobs."""
    auth = _map(cluster.get("authOptions"))
    if auth.get("enableK8sTokenAuth") is True:
        yield (
            f"{_CLUSTER}.authOptions.enableK8sTokenAuth: not supported for a RayJob; leave it unset or false"
        )
        return  # KubeRay stops here for a RayJob
    if auth.get("mode") == "token":
        version = _version(cluster.get("rayVersion"))
        if version is None or version < (2, 52, 0):
            yield (
                f"{_CLUSTER}.rayVersion: {cluster.get('rayVersion')!r} with authOptions.mode token; "
                "token authentication needs rayVersion 2.52.0 or later"
            )


def _cluster_created_by_rayjob(cluster: Mapping[str, Any]) -> Iterator[str]:
    """Rules KubeRay applies to the RayCluster the RayJob creates: its webhook and its controller."""
    seen: set[Any] = set()
    for i, group in _workers(cluster):
        name = group.get("groupName")
        if name in seen:
            yield (
                f"{_worker(i)}.groupName: {name!r} repeats an earlier worker group's name; "
                "names must be unique"
            )
        seen.add(name)
    if _map(cluster.get("upgradeStrategy")).get("type") is not None:
        yield (
            f"{_CLUSTER}.upgradeStrategy.type: set on a RayJob's cluster; "
            "an upgrade strategy is accepted only on a RayCluster created directly"
        )


# ---------------------------------------------------------------------------------------------------------
# Kueue
# ---------------------------------------------------------------------------------------------------------


def kueue_problems(rayjob: dict[str, Any]) -> list[str]:
    """Every rule Kueue's RayJob webhook applies at creation that a job with a queue label breaks.

    Without the kueue.x-k8s.io/queue-name label (and with Kueue's default manageJobsWithoutQueueName: false)
    Kueue does not manage the job: its RayJob rules are skipped and the job runs unqueued; only generic label
    checks loopline never triggers (max-exec-time, prebuilt workload) would still run. Then this returns [].
    """
    meta = _map(rayjob.get("metadata"))
    labels = _map(meta.get("labels"))
    if not labels.get(QUEUE_LABEL):
        return []
    spec = _map(rayjob.get("spec"))
    has_selector, has_cluster = (
        bool(_map(spec.get("clusterSelector"))),
        spec.get("rayClusterSpec") is not None,
    )
    # Kueue returns straight away in these three cases, skipping even its generic label checks.
    if has_selector and has_cluster:
        return [
            "spec.clusterSelector: set with rayClusterSpec on a Kueue-managed job; "
            "it must create its own cluster, so drop clusterSelector"
        ]
    if has_selector:
        return []  # a RayJob on an existing cluster is not managed by Kueue
    if not has_cluster:
        return ["spec.rayClusterSpec: missing; a Kueue-managed job needs rayClusterSpec"]
    return [*_kueue_rayjob(spec, _map(meta.get("annotations"))), *_kueue_generic(meta)]


def _kueue_rayjob(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """The RayJob-specific rules: the cluster must go when the job ends, fixed size, bounded pod sets."""
    if spec.get("shutdownAfterJobFinishes") is not True:
        yield (
            "spec.shutdownAfterJobFinishes: not true on a Kueue-managed job; it must be true, "
            "or the finished job's cluster keeps holding the queue's quota"
        )
    cluster = _map(spec.get("rayClusterSpec"))
    if _autoscaling(cluster) and annotations.get(ELASTIC_JOB_ANNOTATION) != "true":
        yield (
            f"{_CLUSTER}.enableInTreeAutoscaling: true on a Kueue-managed job; accepted only with the "
            f'annotation {ELASTIC_JOB_ANNOTATION}: "true" (workload slicing), else set it to false'
        )
    workers = _workers(cluster)
    # The webhook counts the head and the workers; in K8sJobMode (the default) Kueue's Workload also holds
    # the submitter Job's pod set, and a Workload of more than MaxPodSets is refused when it is created:
    # loopline's own stricter check, so that such a job fails here rather than waiting unadmitted.
    submitter = int(spec.get("submissionMode") in (None, "K8sJobMode"))
    if len(workers) + 1 + submitter > MAX_KUEUE_POD_SETS:
        extra = " and the submitter (K8sJobMode)" if submitter else ""
        yield (
            f"{_CLUSTER}.workerGroupSpecs: {len(workers)} worker groups make {len(workers) + 1 + submitter} "
            f"pod sets with the head{extra}; Kueue accepts at most {MAX_KUEUE_POD_SETS} "
            f"(so {MAX_KUEUE_POD_SETS - 1 - submitter} worker groups)"
        )
    for i, group in workers:
        if group.get("groupName") == "head":
            yield f"{_worker(i)}.groupName: 'head' is reserved by Kueue for the head group; pick another name"


def _kueue_generic(meta: Mapping[str, Any]) -> Iterator[str]:
    """jobframework.ValidateJobOnCreate: the queue name, max execution time and prebuilt workload name."""
    labels, annotations = _map(meta.get("labels")), _map(meta.get("annotations"))
    queue = str(labels[QUEUE_LABEL])
    if not _is_dns1123_subdomain(queue):
        yield (
            f"metadata.labels[{QUEUE_LABEL}]: {queue!r} is not a DNS-1123 subdomain; a LocalQueue name is "
            "lowercase letters, digits, '-' and '.', starting and ending alphanumeric"
        )
    if MAX_EXEC_TIME_LABEL in labels:
        raw = labels[MAX_EXEC_TIME_LABEL]
        seconds = int(raw) if isinstance(raw, str) and re.fullmatch(r"[+-]?\d+", raw) else None
        if seconds is None or seconds <= 0:
            yield (
                f"metadata.labels[{MAX_EXEC_TIME_LABEL}]: {raw!r} is not a positive integer; "
                "give whole seconds > 0"
            )
    # With WorkloadIdentifierAnnotations (on by default) a non-empty annotation wins over the label.
    where, prebuilt = (
        ("annotations", annotations.get(PREBUILT_WORKLOAD_KEY))
        if annotations.get(PREBUILT_WORKLOAD_KEY)
        else ("labels", labels.get(PREBUILT_WORKLOAD_KEY))
    )
    if prebuilt is not None and not _is_dns1123_subdomain(str(prebuilt)):
        yield (
            f"metadata.{where}[{PREBUILT_WORKLOAD_KEY}]: {prebuilt!r} is not a DNS-1123 subdomain; "
            "a Workload name is lowercase letters, digits, '-' and '.'"
        )
