"""The k8s section: how `loopline k8s render` turns a run into a KubeRay RayJob (image, namespace, storage,
Kueue queue, and per placement pool the pods' memory, node selectors, tolerations and autoscaling).

Only what Kubernetes needs beyond the run's own config: the worker groups' sizes and Ray resources come from
runtime.placement, so the same config runs locally, on a Ray cluster and on Kubernetes. Pydantic only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from loopline.section import Section

# A Kubernetes quantity as the manifests here use it: a number and an optional binary or decimal suffix.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
MAX_NAME = 47  # KubeRay's limit on a RayJob's name (loopline.k8s.rules checks it on the manifest too)
# RFC 1123 label: the names of objects, worker groups and queues.
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _quantity(v: str) -> str:
    if not _QUANTITY.match(v):
        raise ValueError(f"{v!r} is not a Kubernetes quantity such as 8Gi, 512Mi or 100G")
    return v


def is_dns_label(v: str) -> bool:
    """An RFC 1123 label: what Kubernetes accepts as the name of most objects, and KubeRay as a group name."""
    return len(v) <= 63 and bool(_LABEL.match(v))


def _label(v: str) -> str:
    if v and not is_dns_label(v):
        raise ValueError(
            f"{v!r} must be a DNS label: at most 63 lowercase letters, digits and '-', starting and ending "
            "with a letter or digit"
        )
    return v


Quantity = Annotated[str, AfterValidator(_quantity)]
DnsLabel = Annotated[str, AfterValidator(_label)]


class PodPlacement(Section):
    """Where and how big a group's pods are: Kubernetes scheduling on top of the pool's Ray resources."""

    memory: Quantity | None = Field(
        None,
        description="Memory of one pod (request = limit), a Kubernetes quantity; null = estimated from the model "
        "and the roles on the pod (loopline.k8s.memory).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods must run on, e.g. {node.kubernetes.io/instance-type: ...}.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Kubernetes tolerations of the pods, e.g. [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}].",
    )
    image: str = Field("", description="Container image of these pods; empty = k8s.image.")


class HeadConfig(PodPlacement):
    """The Ray head pod: runs the driver (the loop) and, with runtime.backend=local, the whole run."""

    cpu: float = Field(2.0, gt=0, description="CPUs of the head pod (request = limit).")
    gpu: int = Field(0, ge=0, description="GPUs of the head pod (runtime.backend=local on a GPU node).")


class WorkerGroupConfig(PodPlacement):
    """A placement pool as a KubeRay worker group."""

    bundles_per_pod: int = Field(
        1, gt=0, description="Bundles of the pool on one pod (e.g. 8 one-GPU bundles on an 8-GPU node)."
    )
    min_replicas: int | None = Field(
        None,
        ge=0,
        description="Autoscaling (clusters without Kueue, env pool only): fewest pods; None = fixed.",
    )
    max_replicas: int | None = Field(
        None,
        gt=0,
        description="Autoscaling (clusters without Kueue, env pool only): most pods; None = fixed.",
    )

    @model_validator(mode="after")
    def _range(self) -> WorkerGroupConfig:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError(
                "min_replicas and max_replicas go together: give both, or neither for a fixed size"
            )
        if (
            self.min_replicas is not None
            and self.max_replicas is not None
            and self.min_replicas > self.max_replicas
        ):
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})"
            )
        return self


class StorageConfig(Section):
    """The volume that holds out_dir, mounted on every pod, so that checkpoints outlive pods."""

    claim: DnsLabel = Field("", description="An existing PersistentVolumeClaim to use; empty = render one.")
    size: Quantity = Field("50Gi", description="Size of the rendered claim.")
    storage_class: str = Field(
        "",
        description="Storage class of the rendered claim (ReadWriteMany, e.g. NFS or a filestore); empty = default.",
    )
    mount_path: str = Field(
        "/runs", description="Where the volume is mounted; out_dir is <mount_path>/<name>."
    )

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(f"{v!r} must be an absolute path other than /, e.g. /runs")
        return v.rstrip("/")


class K8sConfig(Section):
    """`loopline k8s render`: the run as a KubeRay RayJob, resumed from its checkpoint when a pod is lost."""

    name: DnsLabel = Field(
        "",
        description="Name of the RayJob (and prefix of its other objects); empty = loopline-<last part of out_dir>.",
    )
    namespace: DnsLabel = Field("default", description="Namespace of every object.")
    image: str = Field(
        "loopline:0.1.0", description="Container image with loopline and its pinned torch (see docker/)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Kubernetes imagePullPolicy of every container."
    )
    ray_version: str = Field("2.60.0", description="Ray version in the image (the RayCluster's rayVersion).")
    service_account: DnsLabel = Field(
        "", description="Service account of the pods; empty = the namespace's default."
    )
    queue: DnsLabel = Field(
        "",
        description="Kueue LocalQueue: the job is created suspended and runs when Kueue admits it; empty = no Kueue.",
    )
    priority_class: DnsLabel = Field("", description="Kueue WorkloadPriorityClass of the job (needs queue).")
    backoff_limit: int = Field(
        3, ge=0, description="Times a failed job is retried (each retry resumes from the last checkpoint)."
    )
    ttl_after_finished_s: int = Field(
        3600, ge=0, description="Seconds a finished job's RayJob object is kept before it is deleted."
    )
    active_deadline_s: int = Field(
        0, ge=0, description="Longest run in seconds before the job fails; 0 = none."
    )
    head: HeadConfig = Field(default_factory=HeadConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    groups: dict[str, WorkerGroupConfig] = Field(
        default_factory=dict,
        description="Per placement pool (by pool name): its pods' memory, node selector, tolerations, "
        "autoscaling; pools left out get the defaults.",
    )

    @field_validator("name")
    @classmethod
    def _short_enough(cls, v: str) -> str:
        if len(v) > MAX_NAME:
            raise ValueError(
                f"{v!r} has {len(v)} characters; KubeRay takes RayJob names of at most {MAX_NAME} (it appends a "
                "suffix to name the job's Ray cluster)"
            )
        return v

    @model_validator(mode="after")
    def _priority_needs_queue(self) -> K8sConfig:
        if self.priority_class and not self.queue:
            raise ValueError(
                "priority_class is a Kueue WorkloadPriorityClass: it needs queue (a Kueue LocalQueue)"
            )
        if self.queue and any(g.max_replicas is not None for g in self.groups.values()):
            raise ValueError(
                "groups.*.min_replicas/max_replicas (autoscaling) cannot be used with queue: Kueue admits a "
                "fixed size (set one or the other)"
            )
        return self
