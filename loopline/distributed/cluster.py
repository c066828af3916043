"""Start or join Ray: a local single-node Ray on loopback by default, or an existing cluster by address.

Also a helper for tests that builds a multi-node cluster on this one machine (ray.cluster_utils.Cluster),
with nodes carrying different custom resources, so heterogeneous placement can be tested without one.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pydantic import Field

from loopline.section import Section

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

# With this set to 0 every Ray node address is 127.0.0.1, so local traffic stays on loopback. Ray reads it
# once, when `ray` is imported; _loopback() also sets the flag it was read into, for a `ray` imported earlier.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def _loopback() -> Iterator[None]:
    """While open, Ray in this process and the Ray processes it starts use 127.0.0.1 as this node's address."""
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOOPBACK_ENV] = "0"  # inherited by the GCS, raylets and (through them) workers
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by ray._private.services
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = saved_env


class ClusterConfig(Section):
    """Which Ray to use: a local one started in this process, or an existing cluster."""

    address: str = Field(
        "", description="Cluster to join ('auto' or host:port); empty = start a local Ray here."
    )
    num_cpus: int = Field(0, ge=0, description="CPUs of the local Ray; 0 = all cores. Ignored when joining.")
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of the local Ray; None = detect. Ignored when joining."
    )
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources of the local Ray node, e.g. {env_node: 4}."
    )
    object_store_mb: int = Field(
        0, ge=0, description="Object store of the local Ray in MiB; 0 = Ray's default."
    )
    namespace: str = Field("loopline", min_length=1, description="Ray namespace for this run's actors.")


# Ray starts a worker process per CPU when a driver first connects, for tasks loopline never sends (its roles are
# actors, each in a process of its own): on few cores those idle imports of Ray delay the roles' own start.
_NO_PRESTART = {"prestart_worker_first_driver": False}
# A test cluster declares a lost node dead after 3 failed health checks a second apart (Ray's default: 5, 3 s apart,
# after 5 s): a killed raylet refuses at once, so its node is dead ~3 s later. A slow raylet still has Ray's 10 s
# per check, three times in a row, before it counts as lost.
_TEST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


def start_ray(cfg: ClusterConfig | None = None) -> bool:
    """Start a local Ray on loopback or join cfg.address; True if this call started it (so the caller stops it).

    If Ray is already initialised in this process it is reused and False is returned.
    """
    import ray

    cfg = cfg or ClusterConfig()
    if ray.is_initialized():
        return False
    if cfg.address:
        _init(address=cfg.address, namespace=cfg.namespace)
        return True
    with _loopback():  # once started, Ray keeps the node address it was given
        _init(
            # "local" always starts a new Ray: a stale /tmp/ray/ray_current_cluster is not followed.
            address="local",
            num_cpus=cfg.num_cpus or None,
            num_gpus=cfg.num_gpus,
            resources=dict(cfg.resources) or None,
            object_store_memory=cfg.object_store_mb * 2**20 or None,
            include_dashboard=False,
            namespace=cfg.namespace,
            _system_config=_NO_PRESTART,
        )
    return True


def _init(**kwargs: Any) -> None:
    """ray.init, keeping the SIGTERM handler this process had: ray.init installs one that exits at once (status
    15), which would end a preempted run without the checkpoint its own handler writes (loops.stop)."""
    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**kwargs)
    if callable(previous):
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def local_multinode_cluster(
    nodes: Sequence[Mapping[str, float]],
    *,
    head_cpus: int = 0,
    object_store_mb: int = 100,
    namespace: str = "loopline",
) -> Iterator[Cluster]:
    """For tests: a Ray cluster of several nodes on this machine, the driver connected; stopped on exit.

    `nodes` gives each worker node's resources, e.g. [{"CPU": 1, "trainer": 2}, {"CPU": 1, "gen": 1}].
    The cluster keeps its files (and the ray_current_cluster address file, which Cluster writes) in a
    private temp directory, so it neither follows nor overwrites other clusters on a shared machine. A node
    removed from it (`cluster.remove_node(node, allow_graceful=False)`) is declared dead within seconds.
    """
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; call ray.shutdown() first")
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    tmp = tempfile.mkdtemp(prefix="llray-")  # short: Ray's socket paths must stay under 108 bytes
    os.environ["RAY_TMPDIR"] = tmp
    cluster = None
    try:
        with _loopback():
            common: dict[str, Any] = {
                "object_store_memory": object_store_mb * 2**20,
                "node_ip_address": "127.0.0.1",
            }
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": head_cpus,
                    "include_dashboard": False,
                    "_system_config": {**_NO_PRESTART, **_TEST_HEALTH_CHECKS},
                    **common,
                },
            )
            for res in nodes:
                custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
                cluster.add_node(
                    num_cpus=int(res.get("CPU", 0)),
                    num_gpus=int(res.get("GPU", 0)),
                    resources=custom,
                    **common,
                )
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, namespace=namespace)
            yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        shutil.rmtree(tmp, ignore_errors=True)
