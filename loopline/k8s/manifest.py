"""The plain-dict RayJob manifest as the admission rules read it: field paths, label and name syntax, safe
accessors (a wrong type is the schema check's business, so a rule sees an empty value instead)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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

CLUSTER = "spec.rayClusterSpec"
HEAD = f"{CLUSTER}.headGroupSpec"
HEAD_POD = f"{HEAD}.template.spec"

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_GENERIC_VERSION = re.compile(r"\s*v?(\d+(?:\.\d+)+)")


# ---------------------------------------------------------------------------------------------------------
# Small helpers over the plain-dict manifest
# ---------------------------------------------------------------------------------------------------------


def as_map(value: Any) -> Mapping[str, Any]:
    """`value` if it is a mapping, else an empty one (a wrong type is the schema check's business)."""
    return value if isinstance(value, Mapping) else {}


def as_list(value: Any) -> list[Any]:
    """`value` if it is a list, else an empty one."""
    return value if isinstance(value, list) else []


def as_int(value: Any) -> int | None:
    """`value` if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def worker_path(i: int) -> str:
    """The field path of worker group `i`."""
    return f"{CLUSTER}.workerGroupSpecs[{i}]"


def is_dns1123_subdomain(value: str) -> bool:
    """Kubernetes' DNS-1123 subdomain: dot-separated lowercase labels, at most 253 characters."""
    return len(value) <= 253 and all(_DNS1123_LABEL.fullmatch(part) for part in value.split("."))


def is_dns1035_label(value: str) -> bool:
    """Kubernetes' DNS-1035 label: lowercase alphanumerics and '-', starting with a letter, at most 63."""
    return len(value) <= 63 and bool(_DNS1035_LABEL.fullmatch(value))


def is_qualified_name(key: str) -> bool:
    """A label key: an optional DNS-1123 subdomain prefix and '/', then a name of at most 63 characters."""
    prefix, _, name = key.rpartition("/")
    if "/" in prefix or (key.count("/") == 1 and not (prefix and is_dns1123_subdomain(prefix))):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def is_label_value(value: Any) -> bool:
    """A label value: empty, or a name of at most 63 characters."""
    return isinstance(value, str) and (
        value == "" or (len(value) <= 63 and bool(_LABEL_NAME.fullmatch(value)))
    )


def parse_version(value: Any) -> tuple[int, ...] | None:
    """The numeric part of a "generic" version ("2.52.0", "v2.52"); None when it has fewer than two parts."""
    match = _GENERIC_VERSION.match(value) if isinstance(value, str) else None
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def env_of(container: Mapping[str, Any]) -> dict[str, tuple[int, Any]]:
    """A container's environment: name -> (index in env, value)."""
    out: dict[str, tuple[int, Any]] = {}
    for k, var in enumerate(as_list(container.get("env"))):
        name = as_map(var).get("name")
        if isinstance(name, str) and name not in out:
            out[name] = (k, as_map(var).get("value"))
    return out


def head_container(cluster: Mapping[str, Any]) -> Mapping[str, Any]:
    """The head's Ray container (the first one); empty when there is none."""
    containers = as_list(
        as_map(as_map(as_map(cluster.get("headGroupSpec")).get("template")).get("spec")).get("containers")
    )
    return as_map(containers[0]) if containers else {}


def head_env_path(env_index: int) -> str:
    """The field path of the head container's env entry `env_index`."""
    return f"{HEAD_POD}.containers[0].env[{env_index}]"


def autoscaling_on(cluster: Mapping[str, Any]) -> bool:
    """Whether in-tree autoscaling is on."""
    return cluster.get("enableInTreeAutoscaling") is True


def uses_autoscaler_v2(cluster: Mapping[str, Any]) -> bool:
    """Whether autoscalerOptions.version selects autoscaler v2."""
    return as_map(cluster.get("autoscalerOptions")).get("version") == "v2"


def wants_autoscaler_v2(cluster: Mapping[str, Any]) -> bool:
    """Whether v2 is selected by autoscalerOptions.version or by the head's RAY_enable_autoscaler_v2."""
    _, value = env_of(head_container(cluster)).get(AUTOSCALER_V2_ENV, (0, None))
    return uses_autoscaler_v2(cluster) or value in ("1", "true")


def worker_groups(cluster: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """The worker groups, with their indexes."""
    return [(i, as_map(group)) for i, group in enumerate(as_list(cluster.get("workerGroupSpecs")))]
