"""How much memory a run's pods ask for when the k8s section does not say: what `loopline plan` says each rank of
the roles a pod holds needs (loopline.plan: parameters, gradients, optimizer state, activations, logits, KV cache,
a code env's sandbox), plus a process overhead per Python process and Ray's services, with HEADROOM over the sum,
rounded up to a GiB. A pod's limit kills it when passed, so the overhead here is the generous one (a GiB a process)
rather than the plan's measured figure. On a GPU pod the model lives in GPU memory and the host keeps one copy of
the weights (loading, the checkpoint's whole-model gather).
"""

from __future__ import annotations

import math

from loopline.config import RunConfig
from loopline.errors import UserError
from loopline.models.shape import BUILTIN_VOCAB, ModelShape
from loopline.plan import GIB, wanted_roles
from loopline.plan import model_shape as plan_model_shape
from loopline.plan import role_rank_bytes as plan_rank_bytes

__all__ = [
    "BUILTIN_VOCAB",
    "GIB",
    "ModelShape",
    "group_memory",
    "head_memory",
    "model_shape",
    "role_rank_bytes",
]

# A Python process with torch and transformers imported. Measured here (2026-12-04): the default job's whole process
# tree peaked at 0.63 GiB RSS on the local backend (two processes), 2.42 GiB on ray (driver, GCS, raylet, dashboard,
# three actors and Ray's idle workers); 1 GiB leaves room for allocator slack and larger tokenizers.
PROCESS_OVERHEAD = 1 * GIB
RAY_HEAD_OVERHEAD = 1 * GIB  # the head node's GCS, raylet and dashboard agent
RAY_NODE_OVERHEAD = GIB // 2  # a worker node's raylet
HEADROOM = 1.25  # over the estimate: fragmentation, Ray's object store in /dev/shm, what the sum leaves out


def model_shape(cfg: RunConfig) -> ModelShape:
    """The policy's shape (loopline.plan's); a model.path not readable here asks for the memory fields."""
    try:
        return plan_model_shape(cfg)
    except UserError as e:
        raise UserError(
            f"k8s.head.memory / k8s.groups.<pool>.memory: the pods' memory is estimated from the model, and {e}; "
            "set them (e.g. k8s.head.memory=32Gi)"
        ) from None


def role_rank_bytes(cfg: RunConfig, role: str, gpu: bool) -> int:
    """Host memory of one rank of `role` besides its process's overhead: the plan's, for `loopline train`."""
    model_shape(cfg)  # the error that names the k8s fields
    return plan_rank_bytes(cfg, role, gpu, "train")


def pod_memory_bytes(
    cfg: RunConfig, ranks: dict[str, int], processes: int, gpu: bool, ray_overhead: int
) -> int:
    """Estimated memory of a pod holding `ranks` (role -> ranks on this pod) in `processes` Python processes."""
    total = processes * PROCESS_OVERHEAD + ray_overhead
    total += sum(n * role_rank_bytes(cfg, role, gpu) for role, n in ranks.items())
    return total


def quantity(nbytes: int) -> str:
    """Bytes with HEADROOM, rounded up to a whole GiB, as a Kubernetes quantity."""
    return f"{max(1, math.ceil(nbytes * HEADROOM / GIB))}Gi"


def _wanted(cfg: RunConfig) -> list[str]:
    """The model roles a run has besides actor and rollout (a DPO run's online reference too)."""
    roles = wanted_roles(cfg, "train")
    if cfg.dpo.reference == "online" and "ref" not in roles:
        roles.append("ref")
    return roles


def head_memory(cfg: RunConfig) -> str:
    """The head pod's memory, estimated (each rank's memory from `loopline plan`): on the local
    backend the whole run (one process with every model role, and the env worker processes); on ray the driver
    and Ray's head services."""
    if cfg.runtime.backend == "ray":
        return quantity(PROCESS_OVERHEAD + RAY_HEAD_OVERHEAD)
    ranks = {r: 1 for r in ("actor", "rollout", *_wanted(cfg))}
    gpu = cfg.k8s.head.gpu > 0
    return quantity(pod_memory_bytes(cfg, ranks, 1 + cfg.runtime.env_workers, gpu, RAY_HEAD_OVERHEAD))


def group_memory(cfg: RunConfig, pool: str, per_pod: int, gpu: bool) -> str:
    """A worker group's pod memory, estimated (each rank's memory from `loopline plan`): the ranks
    of each role on `pool` that one pod holds (one per bundle), the critic and reference beside the actor unless
    placed elsewhere."""
    placement = cfg.runtime.pools()
    roles = list(placement.roles_on(pool))
    if "actor" in roles:
        roles += [r for r in _wanted(cfg) if r not in placement.roles and r != "reward"]
    rt = cfg.runtime
    total = {"actor": rt.trainer_ranks, "rollout": rt.engines, "env": rt.env_workers}
    ranks = {r: min(per_pod, total.get(r, rt.trainer_ranks)) for r in roles}
    return quantity(pod_memory_bytes(cfg, ranks, sum(ranks.values()), gpu, RAY_NODE_OVERHEAD))
