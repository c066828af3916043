"""Ray actors started, waited on, told dead from raising, and killed: one copy for WorkerGroup and the env pool; a
rank's torch.distributed environment."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any


class ActorRaised(Exception):
    """A method of the actor raised (its constructor, when `in_init`); the message reads "Type: text"."""

    def __init__(self, detail: str, in_init: bool = False) -> None:
        super().__init__(detail)
        self.in_init = in_init


class ActorGone(Exception):
    """The actor died or cannot be reached (restarting, or its node is lost); the message says which."""


def in_bundle(placement_group: Any, index: int) -> Any:
    """Ray's scheduling strategy for running in bundle `index` of `placement_group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=index)


def start_actor(
    cls: type,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    resources: Mapping[str, float],
    bundle: tuple[Any, int] | None = None,
    env_vars: Mapping[str, str] | None = None,
    max_restarts: int = 0,
) -> Any:
    """A new actor `cls(*args, **kwargs)` taking `resources` (CPU, GPU, memory, custom) in `bundle` (pg, index)."""
    import ray

    share = dict(resources)
    options: dict[str, Any] = {
        "num_cpus": share.pop("CPU", 0.0),
        "num_gpus": share.pop("GPU", 0.0),
        "max_restarts": max_restarts,
        # a class that takes calls while another runs (an engine taking weights mid-generation) says how many
        "max_concurrency": getattr(cls, "max_concurrency", 1),
    }
    if "memory" in share:
        options["memory"] = share.pop("memory")
    if bundle is not None:
        options["scheduling_strategy"] = in_bundle(*bundle)
    if env_vars:
        options["runtime_env"] = {"env_vars": dict(env_vars)}
    # a class that answers some calls while a call of its own hangs (a trainer rank stuck in a broken collective
    # still tells a healing driver its state) names those calls' concurrency groups
    groups = getattr(cls, "concurrency_groups", None)
    remote = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)  # type: ignore[call-overload]
    return remote.options(**options, resources=share).remote(*args, **dict(kwargs or {}))


def finished(refs: list[Any], timeout: float | None, fetch: bool = True) -> list[Any]:
    """The done ones of `refs`, in order, after waiting at most `timeout` s (None = no limit) for the first.
    fetch=False: done where they were made, not copied to this node (an argument for other actors)."""
    import ray

    ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=fetch)
    return ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch)[0] if ready else []


def get(ref: Any) -> Any:
    """A finished call's value; ActorRaised (caused by the method's exception) or ActorGone, other Ray errors as is."""
    import ray
    from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise ActorRaised(f"{type(e.cause).__name__}: {e.cause}") from e.cause
    except ActorDiedError as e:
        if e.actor_init_failed:  # the last line of Ray's traceback is "ErrorType: message"
            raise ActorRaised(e.error_msg.strip().splitlines()[-1], in_init=True) from e
        raise ActorGone(f"died: {e.error_msg}") from e
    except RayActorError as e:  # ActorUnavailableError: restarting, or its node is unreachable
        raise ActorGone(f"is unavailable ({type(e).__name__}): {e}") from e


def kill(*actors: Any) -> None:
    """Kill these actors for good (no restart by Ray)."""
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def master_address() -> tuple[str, int]:
    """Run on rank 0's node: that node's address and a port free there, for the torch.distributed rendezvous."""
    import ray.util

    return ray.util.get_node_ip_address(), free_port()


def rank_env(
    rank: int, world: int, local_rank: int, local_world: int, addr: str, port: int
) -> dict[str, str]:
    """The torch.distributed variables of one rank's environment (env:// rendezvous)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


_WARM: dict[type, type] = {}


def warm_class(cls: type) -> type:
    """`cls` as a warm actor: its process starts and imports cls's module (torch and transformers: most of a new
    rank's start-up) and what cls.warm_up() imports, if it has one, but runs no constructor until
    `become(*args, **kwargs)`, which runs cls's there. Named as
    `cls` (its process title too: ray::<name>), but of a module of its own, so Ray keeps the two classes apart."""
    if cls not in _WARM:

        def __init__(self: Any) -> None:  # nothing built yet: unpickling the class paid its module's imports
            warm_up = getattr(cls, "warm_up", None)  # and the class may import what its calls import lazily
            if warm_up is not None:
                warm_up()

        def become(self: Any, *args: Any, **kwargs: Any) -> None:
            cls.__init__(self, *args, **kwargs)  # type: ignore[misc]

        body = {"__init__": __init__, "become": become, "__module__": f"{cls.__module__}.warm"}
        _WARM[cls] = type(cls.__name__, (cls,), {**body, "__qualname__": cls.__qualname__})
    return _WARM[cls]
