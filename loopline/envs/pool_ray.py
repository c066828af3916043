"""The env pool's Ray backend: each worker a Ray actor running one task at a time (loopline.envs.pool chooses it
for backend=ray; its local twin, worker processes over pipes, stays beside the pool)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loopline.distributed.ray_actors import ActorGone, ActorRaised, finished, get, kill, start_actor
from loopline.envs.pool_parts import EnvPoolConfig, RayBundles, _call, _Event, _Reply, _Task, _Worker
from loopline.errors import ENV_WORKER_VAR

logger = logging.getLogger("loopline.envs.pool")


class _RayWorkerActor:
    """Body of a Ray env worker actor (started by loopline.distributed.ray_actors.start_actor)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def pid(self) -> int:
        return os.getpid()

    def run(self, token: tuple[Hashable, int], item: Any) -> _Reply:
        return _call(self.fn, token, item)


@dataclass
class _RayHandle:
    actor: Any
    future: Any = None
    pid_future: Any = None
    pid: int | None = None
    bundle: int | None = None  # its bundle index, with RayBundles


class RayBackend:
    """Workers are Ray actors, one task at a time each; Ray is started here only if needed."""

    def __init__(self, fn: Callable[[Any], Any], config: EnvPoolConfig, bundles: RayBundles | None) -> None:
        import ray

        from loopline.distributed.cluster import ClusterConfig, start_ray

        self.ray = ray
        # Reuse the Ray of this process if there is one; else join ray_address or start a local one.
        self.started_ray = start_ray(ClusterConfig(address=config.ray_address))
        # Workers must import loopline (fn is pickled by reference) even when it is not installed.
        # And they are env workers: a run that user code they load would start there is refused.
        self.env_vars = {
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
            ENV_WORKER_VAR: str(os.getpid()),
        }
        # In a bundle the bundle reserves the resources; a worker only needs to run on its node.
        self.resources = {"CPU": 0.0} if bundles else {**config.ray_resources, "CPU": config.ray_num_cpus}
        self.bundles = bundles
        self.load = [0] * (bundles.num_bundles if bundles else 0)  # live workers per bundle
        self.fn_ref = ray.put(fn)

    def start(self, name: str) -> _Worker:
        place, bundle = None, None
        if self.bundles is not None:
            bundle = min(range(len(self.load)), key=self.load.__getitem__)
            self.load[bundle] += 1
            place = (self.bundles.placement_group, bundle)
        actor = start_actor(
            _RayWorkerActor, (self.fn_ref,), resources=self.resources, bundle=place, env_vars=self.env_vars
        )
        return _Worker(name, _RayHandle(actor, pid_future=actor.pid.remote(), bundle=bundle))

    def submit(self, worker: _Worker, task: _Task) -> None:
        worker.handle.future = worker.handle.actor.run.remote(task.token, task.item)

    def poll(self, workers: list[_Worker], timeout: float) -> list[_Event]:
        waiting: dict[Any, tuple[_Worker, Literal["ready", "reply"]]] = {}
        for w in workers:
            if not w.ready and w.handle.pid_future is not None:
                waiting[w.handle.pid_future] = (w, "ready")
            elif w.task is not None and w.handle.future is not None:
                waiting[w.handle.future] = (w, "reply")
        if not waiting:
            time.sleep(timeout)
            return []
        events: list[_Event] = []
        for future in finished(list(waiting), timeout):
            worker, kind = waiting[future]
            try:
                value = get(future)
            except (ActorGone, ActorRaised, self.ray.exceptions.RayError) as e:  # actor died, node lost, ...
                logger.debug("ray env worker %s failed: %s", worker.name, e)
                events.append((worker, "dead", None))
                continue
            if kind == "ready":
                worker.handle.pid, worker.handle.pid_future = value, None
                events.append((worker, "ready", None))
            else:
                worker.handle.future = None
                events.append((worker, "reply", value))
        return events

    def pid(self, worker: _Worker) -> int | None:
        return worker.handle.pid  # known once the actor is ready

    def alive(self, worker: _Worker) -> bool:
        return True  # not cheap to ask Ray; a dead actor fails its next task, which is retried

    def kill(self, worker: _Worker) -> None:
        kill(worker.handle.actor)
        if worker.handle.bundle is not None:
            self.load[worker.handle.bundle] -= 1
            worker.handle.bundle = None

    def stop(self, worker: _Worker) -> None:
        self.kill(worker)

    def close(self) -> None:
        if self.started_ray:
            self.ray.shutdown()
