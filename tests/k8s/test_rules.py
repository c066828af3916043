"""KubeRay's and Kueue's admission rules for a RayJob (loopline.k8s.rules): a valid job passes both, and each
rule, broken alone, is reported once under its field path."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from loopline.k8s.rules import kuberay_problems, kueue_problems

# The shape loopline renders (loopline/k8s/render.py), with a queue and a priority class.
VALID_RAYJOB_YAML = r"""
apiVersion: ray.io/v1
kind: RayJob
metadata:
  name: loopline-hetero
  namespace: ml
  labels:
    app.kubernetes.io/name: loopline
    app.kubernetes.io/instance: loopline-hetero
    kueue.x-k8s.io/queue-name: team-a
    kueue.x-k8s.io/priority-class: high
spec:
  entrypoint: loopline train /etc/loopline/run.yaml --resume
  shutdownAfterJobFinishes: true
  ttlSecondsAfterFinished: 3600
  backoffLimit: 3
  suspend: true
  submissionMode: K8sJobMode
  rayClusterSpec:
    rayVersion: "2.60.0"
    enableInTreeAutoscaling: false
    headGroupSpec:
      rayStartParams: {num-cpus: "0"}
      template:
        spec:
          containers:
          - name: ray-head
            image: loopline:0.1.0-cpu
            imagePullPolicy: IfNotPresent
            resources:
              requests: {cpu: "2", memory: 8Gi}
              limits: {cpu: "2", memory: 8Gi}
            volumeMounts:
            - {name: runs, mountPath: /runs}
            - {name: config, mountPath: /etc/loopline, readOnly: true}
          volumes:
          - name: runs
            persistentVolumeClaim: {claimName: loopline-hetero-runs}
          - name: config
            configMap: {name: loopline-hetero-config}
    workerGroupSpecs:
    - groupName: trainer
      replicas: 2
      minReplicas: 2
      maxReplicas: 2
      rayStartParams: {num-cpus: "16", num-gpus: "8"}
      template:
        spec:
          nodeSelector: {cloud.google.com/gke-accelerator: nvidia-h100-80gb}
          tolerations:
          - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
          containers:
          - name: ray-worker
            image: loopline:0.1.0-cuda
            resources:
              requests: {cpu: "16", memory: 512Gi, nvidia.com/gpu: "8"}
              limits: {cpu: "16", memory: 512Gi, nvidia.com/gpu: "8"}
            volumeMounts:
            - {name: runs, mountPath: /runs}
          volumes:
          - name: runs
            persistentVolumeClaim: {claimName: loopline-hetero-runs}
    - groupName: env
      replicas: 4
      minReplicas: 4
      maxReplicas: 4
      rayStartParams: {num-cpus: "8", resources: '"{\"env_node\": 8}"'}
      template:
        spec:
          containers:
          - name: ray-worker
            image: loopline:0.1.0-cpu
            resources:
              requests: {cpu: "8", memory: 16Gi}
              limits: {cpu: "8", memory: 16Gi}
"""

Job = dict[str, Any]
Mutation = Callable[[Job], object]

CLUSTER = "spec.rayClusterSpec"
HEAD = f"{CLUSTER}.headGroupSpec"
HEAD_ENV0 = f"{HEAD}.template.spec.containers[0].env[0]"
W0, W1 = f"{CLUSTER}.workerGroupSpecs[0]", f"{CLUSTER}.workerGroupSpecs[1]"


@pytest.fixture
def job() -> Job:
    return yaml.safe_load(VALID_RAYJOB_YAML)


def mutated(job: Job, *mutations: Mutation) -> Job:
    out = copy.deepcopy(job)
    for mutate in mutations:
        mutate(out)
    return out


# Accessors and mutations shared by the cases below.
def cluster(j: Job) -> dict[str, Any]:
    return j["spec"]["rayClusterSpec"]


def head(j: Job) -> dict[str, Any]:
    return cluster(j)["headGroupSpec"]


def worker(j: Job, i: int) -> dict[str, Any]:
    return cluster(j)["workerGroupSpecs"][i]


def head_env(name: str, value: str = "x") -> Mutation:
    return lambda j: (
        head(j)["template"]["spec"]["containers"][0]
        .setdefault("env", [])
        .append({"name": name, "value": value})
    )


def spec(**fields: Any) -> Mutation:
    return lambda j: j["spec"].update(fields)


def cluster_spec(**fields: Any) -> Mutation:
    return lambda j: cluster(j).update(fields)


def worker0(**fields: Any) -> Mutation:
    return lambda j: worker(j, 0).update(fields)


def annotate(**annotations: str) -> Mutation:
    return lambda j: j["metadata"].setdefault("annotations", {}).update(annotations)


def no_cluster(j: Job) -> None:
    del j["spec"]["rayClusterSpec"]


# A RayJob on an existing cluster: not suspendable, no retries.
on_existing_cluster = spec(clusterSelector={"ray.io/cluster": "shared"}, suspend=False, backoffLimit=0)
# No shutdown after the job (so no TTL and no suspension either).
keep_cluster = spec(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=False)
autoscaling = cluster_spec(enableInTreeAutoscaling=True)
ft_options = cluster_spec(gcsFaultToleranceOptions={"redisAddress": "redis:6379"})


def rule(policy: str, ttl: int = 0, status: str = "SUCCEEDED") -> dict[str, Any]:
    return {"policy": policy, "condition": {"jobStatus": status, "ttlSeconds": ttl}}


def legacy(on_success: str | None, on_failure: str | None) -> Mutation:
    policies = {"onSuccess": on_success, "onFailure": on_failure}
    strategy = {k: ({"policy": v} if v else {}) for k, v in policies.items()}
    return spec(deletionStrategy=strategy)


def deletion_rules(*rules: dict[str, Any]) -> Mutation:
    return spec(deletionStrategy={"deletionRules": list(rules)})


KUBERAY_CASES: list[tuple[str, list[Mutation], str]] = [
    # ValidateRayJobMetadata
    ("name longer than 47", [lambda j: j["metadata"].update(name="a" * 48)], "metadata.name"),
    ("name not a DNS-1035 label", [lambda j: j["metadata"].update(name="9-loopline")], "metadata.name"),
    # ValidateRayJobSpec: lifecycle
    (
        "suspended without shutdown",
        [spec(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0)],
        "spec.suspend",
    ),
    ("negative TTL", [spec(ttlSecondsAfterFinished=-1)], "spec.ttlSecondsAfterFinished"),
    (
        "TTL without shutdown",
        [spec(shutdownAfterJobFinishes=False, suspend=False)],
        "spec.ttlSecondsAfterFinished",
    ),
    ("activeDeadlineSeconds 0", [spec(activeDeadlineSeconds=0)], "spec.activeDeadlineSeconds"),
    ("preRunningDeadlineSeconds 0", [spec(preRunningDeadlineSeconds=0)], "spec.preRunningDeadlineSeconds"),
    ("negative backoffLimit", [spec(backoffLimit=-1)], "spec.backoffLimit"),
    # validateDeletionConfiguration, validateLegacyDeletionPolicies, validateDeletionRules
    (
        "deletion rules with shutdown",
        [deletion_rules(rule("DeleteCluster"))],
        "spec.deletionStrategy.deletionRules",
    ),
    ("legacy policy unset", [legacy("DeleteCluster", None)], "spec.deletionStrategy.onFailure.policy"),
    (
        "legacy DeleteCluster on an existing cluster",
        [on_existing_cluster, legacy("DeleteCluster", "DeleteSelf")],
        "spec.deletionStrategy.onSuccess.policy",
    ),
    (
        "legacy DeleteWorkers with autoscaling",
        [autoscaling, legacy("DeleteWorkers", "DeleteCluster")],
        "spec.deletionStrategy.onSuccess.policy",
    ),
    (
        "legacy DeleteNone with shutdown",
        [legacy("DeleteCluster", "DeleteNone")],
        "spec.deletionStrategy.onFailure.policy",
    ),
    (
        "rule DeleteCluster on an existing cluster",
        [keep_cluster, on_existing_cluster, deletion_rules(rule("DeleteCluster"))],
        "spec.deletionStrategy.deletionRules[0].policy",
    ),
    (
        "rule DeleteWorkers with autoscaling",
        [keep_cluster, autoscaling, deletion_rules(rule("DeleteWorkers"))],
        "spec.deletionStrategy.deletionRules[0].policy",
    ),
    (
        "duplicate deletion rule",
        [keep_cluster, deletion_rules(rule("DeleteCluster"), rule("DeleteCluster", 60))],
        "spec.deletionStrategy.deletionRules[1]",
    ),
    (
        "DeleteSelf before DeleteCluster",
        [keep_cluster, deletion_rules(rule("DeleteCluster", 100), rule("DeleteSelf", 50))],
        "spec.deletionStrategy.deletionRules[1].condition.ttlSeconds",
    ),
    # ValidateRayJobSpec: where the cluster comes from
    ("neither rayClusterSpec nor clusterSelector", [no_cluster], "spec.rayClusterSpec"),
    ("suspended on an existing cluster", [on_existing_cluster, spec(suspend=True)], "spec.suspend"),
    (
        "clusterSelector without a cluster name",
        [on_existing_cluster, spec(clusterSelector={"team": "a"})],
        "spec.clusterSelector[ray.io/cluster]",
    ),
    (
        "SidecarMode on an existing cluster",
        [on_existing_cluster, spec(submissionMode="SidecarMode")],
        "spec.submissionMode",
    ),
    ("retries on an existing cluster", [on_existing_cluster, spec(backoffLimit=1)], "spec.backoffLimit"),
    # ValidateRayJobSpec: submission modes
    ("retries in InteractiveMode", [spec(submissionMode="InteractiveMode")], "spec.backoffLimit"),
    (
        "submitterPodTemplate in SidecarMode",
        [spec(submissionMode="SidecarMode", submitterPodTemplate={"spec": {}})],
        "spec.submitterPodTemplate",
    ),
    (
        "submitterConfig in SidecarMode",
        [spec(submissionMode="SidecarMode", submitterConfig={"backoffLimit": 1})],
        "spec.submitterConfig",
    ),
    (
        "head restartPolicy Always in SidecarMode",
        [
            spec(submissionMode="SidecarMode"),
            lambda j: head(j)["template"]["spec"].update(restartPolicy="Always"),
        ],
        f"{HEAD}.template.spec.restartPolicy",
    ),
    (
        "Kubernetes token auth",
        [cluster_spec(authOptions={"enableK8sTokenAuth": True})],
        f"{CLUSTER}.authOptions.enableK8sTokenAuth",
    ),
    ("runtimeEnvYAML not YAML", [spec(runtimeEnvYAML="pip: [torch")], "spec.runtimeEnvYAML"),
    ("runtimeEnvYAML a list", [spec(runtimeEnvYAML="- torch")], "spec.runtimeEnvYAML"),
    # ValidateRayClusterSpec: groups
    (
        "head without containers",
        [lambda j: head(j)["template"]["spec"].update(containers=[])],
        f"{HEAD}.template.spec.containers",
    ),
    ("head resources twice", [lambda j: head(j).update(resources={"CPU": "0"})], f"{HEAD}.resources"),
    (
        "rayStartParams labels",
        [lambda j: head(j)["rayStartParams"].update(labels="a=b")],
        f"{HEAD}.rayStartParams.labels",
    ),
    ("bad group label key", [worker0(labels={"bad key": "x"})], f"{W0}.labels[bad key]"),
    ("bad group label value", [worker0(labels={"zone": "-a"})], f"{W0}.labels[zone]"),
    (
        "worker without containers",
        [lambda j: worker(j, 1)["template"]["spec"].update(containers=[])],
        f"{W1}.template.spec.containers",
    ),
    ("negative minReplicas", [worker0(minReplicas=-1)], f"{W0}.minReplicas"),
    ("negative maxReplicas", [worker0(minReplicas=0, maxReplicas=-1)], f"{W0}.maxReplicas"),
    ("minReplicas above maxReplicas", [worker0(minReplicas=3)], f"{W0}.minReplicas"),
    ("worker resources twice", [worker0(resources={"GPU": "8"})], f"{W0}.resources"),
    ("negative idleTimeoutSeconds", [worker0(idleTimeoutSeconds=-1)], f"{W0}.idleTimeoutSeconds"),
    (
        "idleTimeoutSeconds without autoscaler v2",
        [worker0(idleTimeoutSeconds=60)],
        f"{W0}.idleTimeoutSeconds",
    ),
    ("priority on Ray 2.50", [cluster_spec(rayVersion="2.50.0"), worker0(priority=1)], f"{W0}.priority"),
    ("priority without autoscaler v2", [worker0(priority=1)], f"{W0}.priority"),
    ("worker suspended with autoscaling", [autoscaling, worker0(suspend=True)], f"{W0}.suspend"),
    # ValidateRayClusterSpec: GCS fault tolerance
    (
        "ft-enabled annotation with gcsFaultToleranceOptions",
        [ft_options, annotate(**{"ray.io/ft-enabled": "true"})],
        "metadata.annotations[ray.io/ft-enabled]",
    ),
    ("RAY_REDIS_ADDRESS without fault tolerance", [head_env("RAY_REDIS_ADDRESS")], HEAD_ENV0),
    (
        "redis-password with gcsFaultToleranceOptions",
        [ft_options, lambda j: head(j)["rayStartParams"].update({"redis-password": "x"})],
        f"{HEAD}.rayStartParams.redis-password",
    ),
    ("REDIS_PASSWORD with gcsFaultToleranceOptions", [ft_options, head_env("REDIS_PASSWORD")], HEAD_ENV0),
    (
        "RAY_REDIS_ADDRESS with gcsFaultToleranceOptions",
        [ft_options, head_env("RAY_REDIS_ADDRESS")],
        HEAD_ENV0,
    ),
    (
        "external-storage-namespace annotation with gcsFaultToleranceOptions",
        [ft_options, annotate(**{"ray.io/external-storage-namespace": "ns"})],
        "metadata.annotations[ray.io/external-storage-namespace]",
    ),
    (
        "rocksdb backend (gate off)",
        [cluster_spec(gcsFaultToleranceOptions={"backend": "rocksdb"})],
        f"{CLUSTER}.gcsFaultToleranceOptions.backend",
    ),
    (
        "storage with the redis backend",
        [cluster_spec(gcsFaultToleranceOptions={"redisAddress": "r:6379", "storage": {"size": "1Gi"}})],
        f"{CLUSTER}.gcsFaultToleranceOptions.storage",
    ),
    (
        "redis-username in rayStartParams",
        [lambda j: head(j)["rayStartParams"].update({"redis-username": "u"})],
        f"{HEAD}.rayStartParams.redis-username",
    ),
    ("REDIS_USERNAME in the head env", [head_env("REDIS_USERNAME")], HEAD_ENV0),
    # ValidateRayClusterSpec: autoscaler
    ("autoscaler v2 env without autoscaling", [head_env("RAY_enable_autoscaler_v2", "true")], HEAD_ENV0),
    (
        "autoscaler v2 env and autoscalerOptions.version",
        [
            autoscaling,
            cluster_spec(autoscalerOptions={"version": "v1"}),
            head_env("RAY_enable_autoscaler_v2", "1"),
        ],
        HEAD_ENV0,
    ),
    (
        "head restartPolicy Always under autoscaler v2",
        [
            autoscaling,
            cluster_spec(autoscalerOptions={"version": "v2"}),
            lambda j: head(j)["template"]["spec"].update(restartPolicy="Always"),
        ],
        f"{HEAD}.template.spec.restartPolicy",
    ),
    (
        "worker restartPolicy OnFailure under autoscaler v2",
        [
            autoscaling,
            cluster_spec(autoscalerOptions={"version": "v2"}),
            lambda j: worker(j, 1)["template"]["spec"].update(restartPolicy="OnFailure"),
        ],
        f"{W1}.template.spec.restartPolicy",
    ),
    (
        "negative autoscaler idleTimeoutSeconds",
        [cluster_spec(autoscalerOptions={"idleTimeoutSeconds": -1})],
        f"{CLUSTER}.autoscalerOptions.idleTimeoutSeconds",
    ),
    (
        "KUBERAY_GEN_AUTOSCALER_START_CMD in autoscalerOptions.env",
        [
            cluster_spec(
                autoscalerOptions={"env": [{"name": "KUBERAY_GEN_AUTOSCALER_START_CMD", "value": "x"}]}
            )
        ],
        f"{CLUSTER}.autoscalerOptions.env[0]",
    ),
    # ValidateRayClusterSpec: feature-gated fields and auth
    (
        "historyServerOptions (gate off)",
        [cluster_spec(historyServerOptions={})],
        f"{CLUSTER}.historyServerOptions",
    ),
    ("networkPolicy (gate off)", [cluster_spec(networkPolicy={})], f"{CLUSTER}.networkPolicy"),
    ("tlsOptions (gate off)", [cluster_spec(tlsOptions={"enabled": True})], f"{CLUSTER}.tlsOptions"),
    (
        "token auth on Ray 2.50",
        [cluster_spec(rayVersion="2.50.0", authOptions={"mode": "token"})],
        f"{CLUSTER}.rayVersion",
    ),
    # RayCluster webhook and ValidateRayClusterUpgradeOptions, on the RayJob's cluster
    ("duplicate worker group name", [lambda j: worker(j, 1).update(groupName="trainer")], f"{W1}.groupName"),
    (
        "upgradeStrategy on a RayJob's cluster",
        [cluster_spec(upgradeStrategy={"type": "Recreate"})],
        f"{CLUSTER}.upgradeStrategy.type",
    ),
]


def test_valid_rayjob_has_no_problems(job: Job) -> None:
    assert kuberay_problems(job) == []
    assert kueue_problems(job) == []


@pytest.mark.parametrize(("mutations", "path"), [pytest.param(m, p, id=d) for d, m, p in KUBERAY_CASES])
def test_kuberay_rule(job: Job, mutations: list[Mutation], path: str) -> None:
    problems = kuberay_problems(mutated(job, *mutations))
    assert len(problems) == 1, problems
    assert problems[0].startswith(path + ":"), problems


def test_kuberay_accepts_its_limits(job: Job) -> None:
    """The boundaries pass: a 47-character name, an unset maxReplicas (the CRD's default: 2**31-1), an
    existing cluster, TTLs in deletion order, idle timeout and priority under autoscaler v2."""
    assert kuberay_problems(mutated(job, lambda j: j["metadata"].update(name="a" * 47))) == []
    assert (
        kuberay_problems(mutated(job, worker0(minReplicas=3), lambda j: worker(j, 0).pop("maxReplicas")))
        == []
    )
    assert kuberay_problems(mutated(job, on_existing_cluster, no_cluster)) == []
    ordered = deletion_rules(rule("DeleteWorkers", 0), rule("DeleteCluster", 10), rule("DeleteSelf", 10))
    assert kuberay_problems(mutated(job, keep_cluster, ordered)) == []
    v2 = [
        autoscaling,
        cluster_spec(autoscalerOptions={"version": "v2"}),
        worker0(idleTimeoutSeconds=60, priority=1),
    ]
    assert kuberay_problems(mutated(job, *v2)) == []


def groups(n: int) -> Mutation:
    """n worker groups, copies of the first one with distinct names."""

    def mutate(j: Job) -> None:
        first = worker(j, 0)
        cluster(j)["workerGroupSpecs"] = [{**copy.deepcopy(first), "groupName": f"g{i}"} for i in range(n)]

    return mutate


def label(key: str, value: str) -> Mutation:
    return lambda j: j["metadata"]["labels"].update({key: value})


KUEUE_CASES: list[tuple[str, list[Mutation], str]] = [
    # RayJobWebhook.validateCreate
    (
        "clusterSelector with rayClusterSpec",
        [spec(clusterSelector={"ray.io/cluster": "shared"})],
        "spec.clusterSelector",
    ),
    ("no rayClusterSpec", [no_cluster], "spec.rayClusterSpec"),
    ("no shutdown after the job", [spec(shutdownAfterJobFinishes=False)], "spec.shutdownAfterJobFinishes"),
    # raycluster.ValidateCreate
    ("autoscaling without workload slicing", [autoscaling], f"{CLUSTER}.enableInTreeAutoscaling"),
    ("18 worker groups", [groups(18), spec(submissionMode="HTTPMode")], f"{CLUSTER}.workerGroupSpecs"),
    ("17 worker groups and the submitter", [groups(17)], f"{CLUSTER}.workerGroupSpecs"),
    ("a worker group named head", [worker0(groupName="head")], f"{W0}.groupName"),
    # jobframework.ValidateJobOnCreate
    (
        "queue name not a DNS subdomain",
        [label("kueue.x-k8s.io/queue-name", "Team_A")],
        "metadata.labels[kueue.x-k8s.io/queue-name]",
    ),
    (
        "max-exec-time 0",
        [label("kueue.x-k8s.io/max-exec-time-seconds", "0")],
        "metadata.labels[kueue.x-k8s.io/max-exec-time-seconds]",
    ),
    (
        "prebuilt workload name not a DNS subdomain",
        [label("kueue.x-k8s.io/prebuilt-workload-name", "My_Workload")],
        "metadata.labels[kueue.x-k8s.io/prebuilt-workload-name]",
    ),
]


@pytest.mark.parametrize(("mutations", "path"), [pytest.param(m, p, id=d) for d, m, p in KUEUE_CASES])
def test_kueue_rule(job: Job, mutations: list[Mutation], path: str) -> None:
    problems = kueue_problems(mutated(job, *mutations))
    assert len(problems) == 1, problems
    assert problems[0].startswith(path + ":"), problems


def test_kueue_accepts_its_limits(job: Job) -> None:
    """16 worker groups (17 without the submitter pod of K8sJobMode), autoscaling on an elastic job, a job on an
    existing cluster (not Kueue's) pass."""
    assert kueue_problems(mutated(job, groups(16))) == []
    assert kueue_problems(mutated(job, groups(17), spec(submissionMode="HTTPMode"))) == []
    assert kueue_problems(mutated(job, autoscaling, annotate(**{"kueue.x-k8s.io/elastic-job": "true"}))) == []
    assert kueue_problems(mutated(job, on_existing_cluster, no_cluster)) == []


def test_kueue_ignores_a_job_without_a_queue(job: Job) -> None:
    """Without the queue-name label Kueue does not manage the job, so none of its rules apply."""
    broken = mutated(
        job,
        lambda j: j["metadata"]["labels"].pop("kueue.x-k8s.io/queue-name"),
        spec(shutdownAfterJobFinishes=False),
        autoscaling,
        groups(20),
        worker0(groupName="head"),
    )
    assert kueue_problems(broken) == []
    assert kueue_problems(
        mutated(broken, label("kueue.x-k8s.io/queue-name", "team-a"))
    )  # the same job, queued
