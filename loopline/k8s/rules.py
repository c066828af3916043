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

from loopline.k8s.cluster_rules import cluster_created_by_rayjob, cluster_spec_problems
from loopline.k8s.manifest import (
    CLUSTER,
    CLUSTER_SELECTOR_KEY,
    ELASTIC_JOB_ANNOTATION,
    HEAD_POD,
    MAX_EXEC_TIME_LABEL,
    MAX_KUEUE_POD_SETS,
    MAX_RAYJOB_NAME,
    PREBUILT_WORKLOAD_KEY,
    QUEUE_LABEL,
    as_int,
    as_list,
    as_map,
    autoscaling_on,
    is_dns1035_label,
    is_dns1123_subdomain,
    worker_groups,
    worker_path,
)

# ---------------------------------------------------------------------------------------------------------


def kuberay_problems(rayjob: dict[str, Any]) -> list[str]:
    """Every rule KubeRay applies to a new RayJob (metadata, spec, embedded rayClusterSpec) that it breaks."""
    meta = as_map(rayjob.get("metadata"))
    spec = as_map(rayjob.get("spec"))
    problems = [*_rayjob_name(meta), *_rayjob_spec(spec)]
    if spec.get("rayClusterSpec") is not None:
        cluster = as_map(spec["rayClusterSpec"])
        problems += [
            *cluster_spec_problems(cluster, as_map(meta.get("annotations"))),
            *cluster_created_by_rayjob(cluster),
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
    if not is_dns1035_label(name):
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
    ttl = as_int(spec.get("ttlSecondsAfterFinished"))
    if ttl is not None and ttl < 0:
        yield f"spec.ttlSecondsAfterFinished: {ttl} is negative; KubeRay accepts 0 or more seconds"
    if ttl is not None and ttl > 0 and not shutdown:
        yield (
            f"spec.ttlSecondsAfterFinished: {ttl} is set while shutdownAfterJobFinishes is false; "
            "a TTL is accepted only with shutdownAfterJobFinishes: true"
        )
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        value = as_int(spec.get(key))
        if value is not None and value <= 0:
            yield (
                f"spec.{key}: {value} is not positive; KubeRay accepts 1 or more seconds, or the field unset"
            )
    backoff = as_int(spec.get("backoffLimit"))
    if backoff is not None and backoff < 0:
        yield f"spec.backoffLimit: {backoff} is negative; KubeRay accepts 0 or more retries"


def _deletion_strategy(spec: Mapping[str, Any]) -> Iterator[str]:
    """validateDeletionConfiguration and the legacy / rules checks it calls (the shape is CEL's)."""
    strategy = as_map(spec.get("deletionStrategy"))
    if not strategy:
        return
    path = "spec.deletionStrategy"
    selector_mode = bool(as_map(spec.get("clusterSelector")))
    autoscaling = autoscaling_on(as_map(spec.get("rayClusterSpec")))
    shutdown = spec.get("shutdownAfterJobFinishes") is True
    rules = as_list(strategy.get("deletionRules"))
    if rules and shutdown:
        yield (
            f"{path}.deletionRules: set together with shutdownAfterJobFinishes: true; "
            "use one or the other (the rules decide what is deleted and when)"
        )
    # onSuccess/onFailure with deletionRules too: CEL refuses the strategy, and KubeRay checks only the rules.
    legacy = (
        {} if rules else {k: as_map(strategy.get(k)) for k in ("onSuccess", "onFailure") if k in strategy}
    )
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
        rule, where = as_map(raw), f"spec.deletionStrategy.deletionRules[{i}]"
        policy, condition = rule.get("policy"), as_map(rule.get("condition"))
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
        ttls[key][str(policy)] = (i, as_int(condition.get("ttlSeconds")) or 0)
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
    selector = as_map(spec.get("clusterSelector"))
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
    backoff = as_int(spec.get("backoffLimit"))
    if backoff is not None and backoff > 0:
        yield (
            f"spec.backoffLimit: {backoff} with clusterSelector; "
            "a RayJob on an existing cluster accepts only 0"
        )


def _submission_mode(spec: Mapping[str, Any]) -> Iterator[str]:
    """What InteractiveMode and SidecarMode exclude."""
    mode = spec.get("submissionMode")
    backoff = as_int(spec.get("backoffLimit"))
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
    head_pod = as_map(
        as_map(as_map(as_map(spec.get("rayClusterSpec")).get("headGroupSpec")).get("template")).get("spec")
    )
    if head_pod.get("restartPolicy") not in (None, "", "Never"):
        yield (
            f"{HEAD_POD}.restartPolicy: {head_pod['restartPolicy']} with SidecarMode; "
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


# ---------------------------------------------------------------------------------------------------------


def kueue_problems(rayjob: dict[str, Any]) -> list[str]:
    """Every rule Kueue's RayJob webhook applies at creation that a job with a queue label breaks.

    Without the kueue.x-k8s.io/queue-name label (and with Kueue's default manageJobsWithoutQueueName: false)
    Kueue does not manage the job: its RayJob rules are skipped and the job runs unqueued; only generic label
    checks loopline never triggers (max-exec-time, prebuilt workload) would still run. Then this returns [].
    """
    meta = as_map(rayjob.get("metadata"))
    labels = as_map(meta.get("labels"))
    if not labels.get(QUEUE_LABEL):
        return []
    spec = as_map(rayjob.get("spec"))
    has_selector, has_cluster = (
        bool(as_map(spec.get("clusterSelector"))),
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
    return [*_kueue_rayjob(spec, as_map(meta.get("annotations"))), *_kueue_generic(meta)]


def _kueue_rayjob(spec: Mapping[str, Any], annotations: Mapping[str, Any]) -> Iterator[str]:
    """The RayJob-specific rules: the cluster must go when the job ends, fixed size, bounded pod sets."""
    if spec.get("shutdownAfterJobFinishes") is not True:
        yield (
            "spec.shutdownAfterJobFinishes: not true on a Kueue-managed job; it must be true, "
            "or the finished job's cluster keeps holding the queue's quota"
        )
    cluster = as_map(spec.get("rayClusterSpec"))
    if autoscaling_on(cluster) and annotations.get(ELASTIC_JOB_ANNOTATION) != "true":
        yield (
            f"{CLUSTER}.enableInTreeAutoscaling: true on a Kueue-managed job; accepted only with the "
            f'annotation {ELASTIC_JOB_ANNOTATION}: "true" (workload slicing), else set it to false'
        )
    workers = worker_groups(cluster)
    # The webhook counts the head and the workers; in K8sJobMode (the default) Kueue's Workload also holds
    # the submitter Job's pod set, and a Workload of more than MaxPodSets is refused when it is created:
    # loopline's own stricter check, so that such a job fails here rather than waiting unadmitted.
    submitter = int(spec.get("submissionMode") in (None, "K8sJobMode"))
    if len(workers) + 1 + submitter > MAX_KUEUE_POD_SETS:
        extra = " and the submitter (K8sJobMode)" if submitter else ""
        yield (
            f"{CLUSTER}.workerGroupSpecs: {len(workers)} worker groups make {len(workers) + 1 + submitter} "
            f"pod sets with the head{extra}; Kueue accepts at most {MAX_KUEUE_POD_SETS} "
            f"(so {MAX_KUEUE_POD_SETS - 1 - submitter} worker groups)"
        )
    for i, group in workers:
        if group.get("groupName") == "head":
            yield f"{worker_path(i)}.groupName: 'head' is reserved by Kueue for the head group; pick another name"


def _kueue_generic(meta: Mapping[str, Any]) -> Iterator[str]:
    """jobframework.ValidateJobOnCreate: the queue name, max execution time and prebuilt workload name."""
    labels, annotations = as_map(meta.get("labels")), as_map(meta.get("annotations"))
    queue = str(labels[QUEUE_LABEL])
    if not is_dns1123_subdomain(queue):
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
    if prebuilt is not None and not is_dns1123_subdomain(str(prebuilt)):
        yield (
            f"metadata.{where}[{PREBUILT_WORKLOAD_KEY}]: {prebuilt!r} is not a DNS-1123 subdomain; "
            "a Workload name is lowercase letters, digits, '-' and '.'"
        )
