"""Where each role's workers run: resource pools, the role -> pool map, a resource check, placement groups.

A pool is a number of identical bundles; each role placed on a pool runs one rank per bundle. Roles mapped
to the same pool are colocated: each of their ranks takes an equal share of its bundle. Roles on pools of
their own are disaggregated. A bundle may ask for any Ray resource: CPU, GPU, or a custom one such as
{"tpu_v5": 1} or {"env_node": 1}, which is how heterogeneous placement works (trainer on one kind of node,
engines on another, env workers on CPU nodes).

The check compares the pools with the cluster's free resources before anything is reserved, so a request
the cluster cannot hold fails at once with the role, the pool and the shortfall named, instead of
waiting forever for a placement group. Ray is imported only by the functions that talk to it.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from loopline.section import Section

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

Role = Literal["actor", "rollout", "ref", "critic", "reward", "env"]
ROLES: tuple[str, ...] = get_args(Role)

# Slack for float sums of fractional resources (Ray itself works in units of 1e-4).
_EPS = 1e-6


class PoolConfig(Section):
    """A resource pool: `bundles` identical bundles of `resources`, reserved together as one placement group."""

    name: str = Field(..., min_length=1, description="Pool name, referenced from PlacementConfig.roles.")
    bundles: int = Field(
        1, gt=0, description="Number of bundles; each role on this pool runs one rank per bundle."
    )
    resources: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Resources of one bundle, e.g. {CPU: 1, GPU: 1}, {tpu_v5: 1} or {env_node: 1}.",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement strategy: PACK fills few nodes, SPREAD spreads, STRICT_SPREAD = one bundle per node.",
    )
    gpu_memory_gib: float = Field(
        0.0,
        ge=0,
        description="Memory of each GPU of a bundle (e.g. 80 for an 80 GB H100), which `loopline plan` checks the "
        "bundle's ranks against; 0 = not declared (GPU memory is planned and printed, not checked).",
    )

    @field_validator("resources")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("a bundle must ask for at least one resource, e.g. {CPU: 1}")
        bad = {k: x for k, x in v.items() if not x > 0}
        if bad:
            raise ValueError(f"bundle resources must be > 0 (Ray rejects empty bundles); got {bad}")
        return v


def _actor_on_default() -> dict[Role, str]:
    return {"actor": "default"}


class PlacementConfig(Section):
    """Resource pools and which pool each role runs on (roles sharing a pool are colocated on its bundles)."""

    pools: list[PoolConfig] = Field(
        default_factory=lambda: [PoolConfig(name="default")], description="Resource pools, by unique name."
    )
    roles: dict[Role, str] = Field(
        default_factory=_actor_on_default,
        description="Role -> pool name. Roles on one pool are colocated; roles left out are not placed.",
    )
    check_resources: bool = Field(
        True,
        description="Fail at once when the cluster lacks free resources; turn off on autoscaling clusters.",
    )
    ready_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for Ray to place a pool before failing with the pool named."
    )

    @model_validator(mode="after")
    def _pools_match_roles(self) -> PlacementConfig:
        names = [p.name for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(dupes)}")
        for role, pool in self.roles.items():
            if pool not in names:
                raise ValueError(
                    f"role '{role}' names pool '{pool}', which is not defined; pools: {', '.join(names)}"
                )
        unused = [n for n in names if n not in self.roles.values()]
        if unused:
            raise ValueError(
                f"pool(s) {', '.join(repr(n) for n in unused)} are used by no role; map a role or remove them"
            )
        return self

    def roles_on(self, pool: str) -> tuple[str, ...]:
        """The roles placed on `pool`, in the order they are listed."""
        return tuple(role for role, p in self.roles.items() if p == pool)


class PlacementError(ValueError):
    """The cluster cannot hold the requested pools; the message names the roles, pools and shortfall."""


# ---------------------------------------------------------------------------------------------------------
# The resource check: pure arithmetic over per-node free resources, no cluster needed.
# ---------------------------------------------------------------------------------------------------------


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _amounts(resources: Mapping[str, float], keys: Sequence[str]) -> str:
    return " and ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys)


def _who(cfg: PlacementConfig, pool: PoolConfig) -> str:
    roles = cfg.roles_on(pool.name)
    if len(roles) == 1:
        return f"role '{roles[0]}' (pool '{pool.name}')"
    return f"pool '{pool.name}' (colocated roles {', '.join(repr(r) for r in roles)})"


def _relevant(node: Mapping[str, float], bundle: Mapping[str, float]) -> dict[str, float]:
    return {k: node.get(k, 0.0) for k in bundle}


def _bundles_on(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many bundles fit in one node's free resources."""
    return min(math.floor(node.get(k, 0.0) / v + _EPS) for k, v in bundle.items())


def check_placement(cfg: PlacementConfig, nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise PlacementError naming every pool the cluster cannot hold; `nodes` holds each node's free resources.

    The checks are necessary conditions (enough in total, bundles fit on single nodes, the strategy can be
    met); they are exact for one pool alone. Fragmentation across several pools can still make Ray wait;
    `place_pools` bounds that wait with `ready_timeout_s`.
    """
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            totals[k] = totals.get(k, 0.0) + v

    problems: list[str] = []
    for pool in cfg.pools:
        who, bundle, n = _who(cfg, pool), pool.resources, pool.bundles
        need = {k: v * n for k, v in bundle.items()}
        short = [k for k, v in need.items() if v > totals.get(k, 0.0) + _EPS]
        if short:
            problems.append(
                f"{who} needs {n} x {_fmt(bundle)} = {_amounts(need, short)}, cluster has {_amounts(totals, short)}"
            )
            continue
        fits = [_bundles_on(node, bundle) for node in nodes]
        if sum(fits) < n:
            problems.append(
                f"{who} needs {n} x {_fmt(bundle)}, but a bundle must fit on one node and the nodes hold only "
                f"{sum(fits)} (free per node: {', '.join(_fmt(_relevant(nd, bundle)) for nd in nodes)})"
            )
        elif pool.strategy == "STRICT_SPREAD" and sum(f > 0 for f in fits) < n:
            problems.append(
                f"{who} uses STRICT_SPREAD: {n} bundles of {_fmt(bundle)} need {n} nodes, "
                f"only {sum(f > 0 for f in fits)} node(s) can hold one"
            )
        elif pool.strategy == "STRICT_PACK" and max(fits, default=0) < n:
            problems.append(
                f"{who} uses STRICT_PACK: all {n} bundles of {_fmt(bundle)} must fit on one node, "
                f"the most any node holds is {max(fits, default=0)}"
            )

    if not problems:
        # Each pool fits alone; now all of them together.
        demand: dict[str, list[tuple[str, float]]] = {}
        for pool in cfg.pools:
            for k, v in pool.resources.items():
                demand.setdefault(k, []).append((pool.name, v * pool.bundles))
        for k, parts in demand.items():
            total = sum(v for _, v in parts)
            if total > totals.get(k, 0.0) + _EPS:
                split = ", ".join(
                    f"{_who(cfg, next(p for p in cfg.pools if p.name == name))} {v:g}" for name, v in parts
                )
                problems.append(
                    f"pools together need {k} {total:g} ({split}), cluster has {k} {totals.get(k, 0.0):g}"
                )

    if problems:
        raise PlacementError(
            "cannot place the pools on this cluster's free resources:\n  - " + "\n  - ".join(problems)
        )


# ---------------------------------------------------------------------------------------------------------
# Talking to Ray: free resources per node, placement groups per pool.
# ---------------------------------------------------------------------------------------------------------

# Placement groups add derived resources such as CPU_group_<pg id> and CPU_group_0_<pg id>; they are not free.
_PG_RESOURCE = re.compile(r"_group_(\d+_)?([0-9a-f]+)$")


def cluster_free_resources() -> list[dict[str, float]]:
    """Free resources of each live node of the connected Ray cluster (placement-group reservations excluded)."""
    # A DeveloperAPI: ray.available_resources() only gives the sum, and whether a bundle fits is per node.
    from ray._private.state import available_resources_per_node

    return [
        {k: v for k, v in res.items() if not _PG_RESOURCE.search(k)}
        for res in available_resources_per_node().values()
    ]


# How long a failing resource check waits while the shortfall may be gone in a moment (_why_wait): a run killed a
# moment ago holds its groups until Ray notices its driver is gone (well under a second, or seconds on a loaded node).
RELEASE_WAIT_S = 10.0


def _why_wait(cfg: PlacementConfig) -> str | None:
    """Why a shortfall in the free resources may be gone in a moment (None: it will not).

    Another Ray job still holds placement groups (a killed run's, until Ray notices its driver is gone), or the pools
    fit what the live placement groups leave of each node's total, so what is missing is held by actors that are
    ending or by Ray's per-node view of freed resources, which lags on a loaded machine."""
    import ray
    import ray.util
    from ray._private.state import total_resources_per_node

    own = ray.get_runtime_context().get_job_id()
    groups = {i: g for i, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}
    totals = total_resources_per_node()
    shown = {m.group(2) for res in totals.values() for k in res if (m := _PG_RESOURCE.search(k))}
    # A placement group's id ends with the id of the job that made it (Ray's id layout).
    if any(not i.endswith(own) for i in set(groups) | shown):
        return "other Ray jobs hold placement groups"
    left = {
        node: {k: v for k, v in res.items() if not _PG_RESOURCE.search(k)} for node, res in totals.items()
    }
    for g in groups.values():
        for i, bundle in g["bundles"].items():
            node = g["bundles_to_node_id"].get(i)  # none yet for a group still pending
            for k, v in bundle.items() if node in left else ():
                left[node][k] = left[node].get(k, 0.0) - v
    try:
        check_placement(cfg, list(left.values()))
    except PlacementError:
        return None
    return "resources not in any placement group are held: ending actors, or a view of freed ones not yet updated"


def _check_free(cfg: PlacementConfig) -> None:
    """check_placement on the free resources; while the shortfall may be gone in a moment (_why_wait), check again
    for up to RELEASE_WAIT_S (at most ready_timeout_s), so that resuming a run killed a moment ago works."""
    wait = min(RELEASE_WAIT_S, cfg.ready_timeout_s)
    deadline = time.monotonic() + wait
    while True:
        try:
            check_placement(cfg, cluster_free_resources())
            return
        except PlacementError as e:
            why = _why_wait(cfg)
            if why is None:
                raise
            if time.monotonic() >= deadline:
                raise PlacementError(f"{e}\n  ({why}; waited {wait:g}s for them)") from e
        time.sleep(0.2)


@dataclass(frozen=True)
class Pool:
    """A placed pool: its Ray placement group, the bundle shape, and the roles colocated on its bundles."""

    name: str
    placement_group: PlacementGroup
    bundle: dict[str, float]
    num_bundles: int
    roles: tuple[str, ...]

    def rank_resources(self) -> dict[str, float]:
        """Resources one rank of one role takes from its bundle: the bundle split evenly among colocated roles."""
        # Round down to Ray's 1e-4 granularity so that the shares of all colocated roles fit in the bundle.
        return {k: math.floor(v / len(self.roles) * 1e4) / 1e4 for k, v in self.bundle.items()}

    def bundle_nodes(self) -> list[str]:
        """Node id of each bundle, in bundle order ("" for a bundle not placed: its node lost, not yet placed again)."""
        import ray.util

        table: dict[str, Any] = ray.util.placement_group_table(self.placement_group)
        return [table["bundles_to_node_id"].get(i, "") for i in range(self.num_bundles)]


def place_pools(cfg: PlacementConfig) -> dict[str, Pool]:
    """Reserve one placement group per pool; return role -> Pool (colocated roles share one Pool).

    Checks the cluster's free resources first (unless cfg.check_resources is off), then waits at most
    cfg.ready_timeout_s for all groups; on failure removes what it reserved and raises PlacementError.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    if cfg.check_resources:
        _check_free(cfg)

    pools = [
        Pool(
            name=p.name,
            placement_group=placement_group(
                [dict(p.resources) for _ in range(p.bundles)],
                strategy=p.strategy,
                name=f"loopline-{p.name}-{uuid.uuid4().hex[:8]}",
            ),
            bundle=dict(p.resources),
            num_bundles=p.bundles,
            roles=cfg.roles_on(p.name),
        )
        for p in cfg.pools
    ]
    deadline = time.monotonic() + cfg.ready_timeout_s
    for pool in pools:
        if not pool.placement_group.wait(max(0.0, deadline - time.monotonic())):
            for p in pools:
                remove_placement_group(p.placement_group)
            conf = next(p for p in cfg.pools if p.name == pool.name)
            raise PlacementError(
                f"{_who(cfg, conf)} was not placed within {cfg.ready_timeout_s:g}s: "
                f"{pool.num_bundles} x {_fmt(pool.bundle)} with strategy {conf.strategy}; "
                f"free per node: {', '.join(_fmt(_relevant(n, pool.bundle)) for n in cluster_free_resources())}"
            )
    return {role: pool for pool in pools for role in pool.roles}


def remove_pools(pools: Mapping[str, Pool], timeout_s: float = 10.0) -> None:
    """Release the placement groups of `pools` (as returned by place_pools); Ray kills the actors in them.

    Waits (at most timeout_s) until the cluster's resource view no longer shows the groups, so that a
    check made right after this (place_pools) sees the freed resources, not a stale view.
    """
    from ray._private.state import total_resources_per_node
    from ray.util.placement_group import remove_placement_group

    unique = list({id(p): p for p in pools.values()}.values())  # colocated roles share one Pool
    for pool in unique:
        remove_placement_group(pool.placement_group)
    ids = [pool.placement_group.id.hex() for pool in unique]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keys = [k for res in total_resources_per_node().values() for k in res]
        if not any(k.endswith(pg_id) for k in keys for pg_id in ids):
            return
        time.sleep(0.05)
