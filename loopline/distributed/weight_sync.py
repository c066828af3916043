"""Execute a transfer plan: trainer shards in, engine tensors filled, bitwise.

Three ways to run one, all driven by the same `TransferPlan`:
- `copy_in_process`: the trainer's and the engines' tensors live in this process (the local backend's
  sync, tests); plain tensor copies.
- `sync_weights`: each rank of a torch.distributed world (gloo on CPU, any backend that has
  point-to-point) sends its shards straight to the engine ranks that need them, a bucket of
  parameters at a time, so staging memory is bounded by the bucket, never a second model.
- `sync_weights_naive`: the baseline: gather the full model on trainer rank 0, broadcast it.

Every rank of the world calls `sync_weights` / `sync_weights_naive` with the same plan; plan
ranks are global ranks (or ranks of the `group` passed). Nothing is negotiated at run time: each
rank derives what to send and receive from the plan, in the same order as its peers.

`SyncGroup` is the communicator of the ray backend: a gloo group over the trainer ranks and the
current engines, apart from the trainer's own world (FSDP2, checkpoints), rebuilt as a new
generation whenever the engines change, so an engine can die, join or leave without touching it.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loopline.distributed.resharding import (
    EngineLayout,
    ParamSpec,
    TpRule,
    TrainerLayout,
    Transfer,
    TransferPlan,
    box_numel,
    default_tp_dim,
    plan_transfers,
)

DEFAULT_BUCKET_BYTES = 64 * 2**20
_ALIGN = 16  # packed regions start on 16-byte boundaries so a byte buffer can be viewed as any dtype


@dataclass
class SyncStats:
    """What one rank did during a sync."""

    seconds: float = 0.0
    bytes_sent: int = 0  # to other ranks
    bytes_received: int = 0  # from other ranks
    bytes_local: int = 0  # copied inside this process (colocated source and destination)
    peak_buffer_bytes: int = 0  # most bytes of staging buffers alive at once on this rank
    buckets: int = 0


# ---------------------------------------------------------------------------------------------
# Model <-> plan helpers
# ---------------------------------------------------------------------------------------------


def param_specs(model: nn.Module, dtype: torch.dtype | None = None) -> list[ParamSpec]:
    """The planner's view of a model: names, full shapes (also under FSDP2/TP) and dtypes of its parameters (or
    `dtype`, the engines', for every floating-point one: the plan then moves the engines' dtype)."""
    return [
        ParamSpec(n, tuple(p.shape), dtype if dtype is not None and p.is_floating_point() else p.dtype)
        for n, p in model.named_parameters()
    ]


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter: the local tensor of a DTensor (FSDP2/TP), else the whole tensor."""
    with torch.no_grad():
        return {
            n: p.to_local() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()
        }


def engine_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of an unsharded engine model, as tensors a sync writes into in place."""
    return {n: p.detach() for n, p in model.named_parameters()}


def empty_engine_shards(plan: TransferPlan, rank: int) -> dict[str, torch.Tensor]:
    """Uninitialised tensors shaped like engine rank `rank`'s shards (for TP engines without a model)."""
    pos = plan.dst_position(rank)
    if pos is None:
        return {}
    return {
        s.name: torch.empty([hi - lo for lo, hi in plan.dst_box(p, pos[1])], dtype=s.dtype)
        for p, s in enumerate(plan.params)
    }


# ---------------------------------------------------------------------------------------------
# In-process copy
# ---------------------------------------------------------------------------------------------


def copy_in_process(
    plan: TransferPlan,
    shards: Mapping[int, Mapping[str, torch.Tensor]],
    targets: Mapping[int, Mapping[str, torch.Tensor]],
) -> int:
    """Run the plan's transfers into the engine ranks of `targets` as tensor copies in this process; returns the bytes
    copied (none for an engine tensor that is the shard itself).

    `shards[rank][name]` are trainer shards, `targets[rank][name]` engine tensors, written in place: every engine
    rank of the plan (a whole plan at once), or some (the local sync: each engine fills its own tensors).
    """
    copied = 0
    with torch.no_grad():
        for rank, tensors in targets.items():
            if plan.dst_position(rank) is None:
                raise ValueError(
                    f"rank {rank} holds no engine shard in the plan (its engine ranks: {plan.dst_ranks.tolist()})"
                )
            for t in plan.transfers_to(rank):
                dst, src = (
                    _block(tensors[t.name], t.dst_slice),
                    _block(shards[t.src_rank][t.name], t.src_slice),
                )
                if _same_memory(dst, src):  # a local engine on the actor's own parameters (share_weights)
                    continue
                dst.copy_(src)
                copied += t.nbytes
    return copied


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of the same storage (a copy between them would change nothing)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _block(tensor: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
    """`tensor[index]`; the tensor itself when the block is all of it (an unsharded trainer moves whole tensors,
    and the local sync runs at every step: indexing every tensor would cost half as much as copying them)."""
    if len(index) != tensor.dim():
        return tensor[index]
    for s, n in zip(index, tensor.shape):  # a plain loop: this runs once per tensor per push
        if s.start != 0 or s.stop != n:
            return tensor[index]
    return tensor


# ---------------------------------------------------------------------------------------------
# Planned sync across processes
# ---------------------------------------------------------------------------------------------


def sync_weights(
    plan: TransferPlan,
    src_shards: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: dist.ProcessGroup | None = None,
) -> SyncStats:
    """Send this rank's trainer shards to the engine ranks that need them and fill its engine tensors.

    Call on every rank of the world (or of `group`, whose ranks the plan's ranks are; None = the default world). `src_shards` is required on trainer ranks (from `local_shards`),
    `dst_tensors` on engine ranks; a colocated rank passes both and copies its own part in place.
    Parameters go in buckets of at most `bucket_bytes` (full size; a bigger parameter is its own
    bucket): per bucket each trainer rank packs one buffer per engine TP rank (the same bytes go to
    that TP rank of every engine) and each engine rank one buffer per trainer rank it hears from.
    """
    rank = dist.get_rank() if group is None else group.rank()
    _check_roles(plan, rank, src_shards, dst_tensors)
    src, dst = src_shards or {}, dst_tensors or {}
    # the engines' dtype (rollout.dtype): a trainer's shard is cast to it as it is packed
    wire = {s.name: s.dtype for s in plan.params}
    stats = SyncStats()
    start = time.perf_counter()
    with torch.no_grad():
        for tag, bucket in enumerate(plan.buckets(bucket_bytes)):
            stats.buckets += 1
            requests, live = [], 0
            # Sends: group by destination; one packed buffer per engine TP rank, reused across engines.
            by_dst: dict[int, list[Transfer]] = {}
            for t in plan.transfers_from(rank, bucket):
                if t.dst_rank == rank:
                    dst[t.name][t.dst_slice].copy_(src[t.name][t.src_slice])
                    stats.bytes_local += t.nbytes
                else:
                    by_dst.setdefault(t.dst_rank, []).append(t)
            packed: dict[int, torch.Tensor] = {}
            for peer, ts in by_dst.items():
                _, j = plan.dst_position(peer) or (0, 0)
                if j not in packed:
                    packed[j] = _pack(ts, src, wire)
                    live += packed[j].numel()
                requests.append(_isend(packed[j], peer, tag, group))
                stats.bytes_sent += sum(t.nbytes for t in ts)
            # Receives: one buffer per trainer rank, unpacked once everything in the bucket has arrived.
            by_src: dict[int, list[Transfer]] = {}
            for t in plan.transfers_to(rank, bucket):
                if t.src_rank != rank:
                    by_src.setdefault(t.src_rank, []).append(t)
            received = []
            for peer, ts in by_src.items():
                buf = torch.empty(_packed_size(ts), dtype=torch.uint8)
                live += buf.numel()
                requests.append(_irecv(buf, peer, tag, group))
                received.append((buf, ts))
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, live)
            for req in requests:
                req.wait()
            for buf, ts in received:
                _unpack(buf, ts, dst, wire)
                stats.bytes_received += sum(t.nbytes for t in ts)
    stats.seconds = time.perf_counter() - start
    return stats


def _isend(buf: torch.Tensor, peer: int, tag: int, group: dist.ProcessGroup | None) -> dist.Work:
    # a SyncGroup's gloo group is not registered with torch.distributed: call it directly, by its own ranks
    return dist.isend(buf, dst=peer, tag=tag) if group is None else group.send([buf], peer, tag)  # type: ignore[return-value]


def _irecv(buf: torch.Tensor, peer: int, tag: int, group: dist.ProcessGroup | None) -> dist.Work:
    return dist.irecv(buf, src=peer, tag=tag) if group is None else group.recv([buf], peer, tag)  # type: ignore[return-value]


def _check_roles(
    plan: TransferPlan,
    rank: int,
    src_shards: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
) -> None:
    if plan.is_src(rank) and src_shards is None:
        raise ValueError(f"rank {rank} is a trainer rank in the plan but was given no src_shards")
    if plan.dst_position(rank) is not None and dst_tensors is None:
        raise ValueError(f"rank {rank} is an engine rank in the plan but was given no dst_tensors")


def _packed_size(transfers: list[Transfer]) -> int:
    return sum(-(-t.nbytes // _ALIGN) * _ALIGN for t in transfers)


def _region(buf: torch.Tensor, offset: int, t: Transfer, dtype: torch.dtype) -> torch.Tensor:
    """A view of `buf[offset:]` as the transfer's block, in `dtype` (the plan's: what travels)."""
    shape = [s.stop - s.start for s in t.dst_slice]
    return buf[offset : offset + t.nbytes].view(dtype).view(shape)


def _pack(
    transfers: list[Transfer], shards: Mapping[str, torch.Tensor], wire: Mapping[str, torch.dtype]
) -> torch.Tensor:
    """Copy the source blocks of `transfers`, in order, into one aligned byte buffer, each cast to its wire dtype
    (a float32 master shard packed for a bfloat16 engine rounds to nearest even, as .to(bfloat16) does)."""
    buf = torch.empty(_packed_size(transfers), dtype=torch.uint8)
    offset = 0
    for t in transfers:
        src = shards[t.name]
        _region(buf, offset, t, wire[t.name]).copy_(src[t.src_slice])
        offset += -(-t.nbytes // _ALIGN) * _ALIGN
    return buf


def _unpack(
    buf: torch.Tensor,
    transfers: list[Transfer],
    targets: Mapping[str, torch.Tensor],
    wire: Mapping[str, torch.dtype],
) -> None:
    """Copy the blocks of a packed buffer into their destination slices."""
    offset = 0
    for t in transfers:
        dst = targets[t.name]
        dst[t.dst_slice].copy_(_region(buf, offset, t, wire[t.name]))
        offset += -(-t.nbytes // _ALIGN) * _ALIGN


# ---------------------------------------------------------------------------------------------
# The ray backend's communicator: trainer ranks + current engines, one generation at a time
# ---------------------------------------------------------------------------------------------


class SyncError(RuntimeError):
    """A weight sync failed on this rank (a peer died, or a timeout); its group is closed already."""


def engines_plan(
    specs: list[ParamSpec], trainer: TrainerLayout, targets: tuple[int, ...], tp_dims: TpRule = default_tp_dim
) -> TransferPlan:
    """The plan into the engines `targets` (engine indices) of a SyncGroup, where engine i is rank trainer.size + i.

    tp_dims: where the trainer's TP split each parameter (training.parallel.tp_param_dims when trainer.tp > 1)."""
    ranks = tuple(trainer.size + i for i in targets)
    return plan_transfers(specs, trainer, EngineLayout(len(targets), ranks=ranks), tp_dims)


class SyncGroup:
    """A gloo group over the trainer ranks (ranks 0..n-1) and the current engines (n, n+1, ...), for the sync.

    It is apart from the trainer's own world, so engines can die, join or leave without touching FSDP2's
    groups. Every generation is a new gloo group under its own key prefix of one TCP store, hosted by
    trainer rank 0 (which lives as long as the run's trainer); when the engines change, every member opens
    the next generation. A sync that fails closes its group at once: gloo closes its connections only when
    the group and its pending work are freed, and that is what makes the peers still waiting on this rank
    fail within a second instead of at the timeout (measured here: 0.3 s, against the whole 60 s timeout
    while the failed rank kept the group).
    """

    def __init__(self, store: dist.Store, address: tuple[str, int], host: str, timeout_s: float) -> None:
        """Use `serve` or `connect`. host: this process's address, where its gloo sockets listen."""
        self.store, self.address, self.host = store, address, host
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group: dist.ProcessGroup | None = None
        self.generation = 0

    @classmethod
    def serve(cls, host: str, timeout_s: float) -> SyncGroup:
        """Host the store on a free port of this node (trainer rank 0); `address` is what the others connect to."""
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_delta(timeout_s))
        return cls(store, (host, store.port), host, timeout_s)

    @classmethod
    def connect(cls, address: tuple[str, int], host: str, timeout_s: float) -> SyncGroup:
        """Connect to the store served at `address`; host: this process's address."""
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=_delta(timeout_s))
        return cls(store, tuple(address), host, timeout_s)  # type: ignore[arg-type]

    def open(self, generation: int, rank: int, size: int) -> None:
        """Close the current group; build generation `generation` as rank `rank` of `size` (all members at once)."""
        self.close()
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # no public way to set the device
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        prefix = dist.PrefixStore(f"loopline-sync/{generation}/", self.store)
        self.group = dist.ProcessGroupGloo(prefix, rank, size, options)  # type: ignore[assignment]
        self.generation = generation

    def sync(
        self,
        plan: TransferPlan,
        src_shards: Mapping[str, torch.Tensor] | None,
        dst_tensors: Mapping[str, torch.Tensor] | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> SyncStats:
        """`sync_weights` over this group; on failure the group is closed and SyncError raised."""
        if self.group is None:
            raise SyncError(
                "no sync group is open on this rank (a failed sync closed it; open the next generation)"
            )
        failure = ""
        try:
            return sync_weights(plan, src_shards, dst_tensors, bucket_bytes, group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError and DistError subclasses alike
            failure = f"{type(e).__name__}: {e}"
        # Out of the except block the traceback is gone, and with it the frames holding the group's pending work.
        self.close()
        raise SyncError(f"weight sync (generation {self.generation}) failed: {failure}")

    def close(self) -> None:
        """Drop the group: its connections close, and peers blocked on them fail now."""
        if self.group is not None:
            self.group = None
            gc.collect()  # the group goes only with its last reference (pending work may sit in cycles)


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------------
# Naive baseline: gather on trainer rank 0, broadcast
# ---------------------------------------------------------------------------------------------

_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def sync_weights_naive(
    plan: TransferPlan,
    src_shards: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
) -> SyncStats:
    """Baseline: trainer rank 0 gathers the full model, then broadcasts each parameter to every engine rank.

    What many RL frameworks do first (full state dict, then broadcast). Rank 0 holds a second full
    copy of the model; engine ranks that keep a TP shard stage each full parameter. Call on every rank.
    """
    rank = dist.get_rank()
    _check_roles(plan, rank, src_shards, dst_tensors)
    src, dst = src_shards or {}, dst_tensors or {}
    root = int(plan.src_ranks[0])
    members = tuple([root] + sorted({int(r) for r in plan.dst_ranks.reshape(-1)} - {root}))
    if members not in _groups:  # new_group is collective over the world: every rank creates it, once
        _groups[members] = dist.new_group(list(members))
    group = _groups[members]
    stats = SyncStats(buckets=1)
    start = time.perf_counter()
    with torch.no_grad():
        full = _gather_to_root(plan, rank, root, src, stats)
        pos = plan.dst_position(rank)
        for p, spec in enumerate(plan.params):
            box = plan.dst_box(p, pos[1]) if pos is not None else None
            if rank == root:
                buf = full[spec.name]
            elif rank in members:
                mine = dst[spec.name]
                whole = mine.shape == spec.shape and mine.is_contiguous()  # then receive in place
                buf = mine if whole else torch.empty(spec.shape, dtype=spec.dtype)
                if not whole:
                    stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, spec.nbytes)
            else:
                continue
            if len(members) > 1:
                dist.broadcast(buf, src=root, group=group)
                if rank == root:
                    stats.bytes_sent += spec.nbytes * (len(members) - 1)
                else:
                    stats.bytes_received += spec.nbytes
            if box is not None and buf is not dst[spec.name]:
                dst[spec.name].copy_(buf[tuple(slice(lo, hi) for lo, hi in box)])
    stats.seconds = time.perf_counter() - start
    return stats


def _gather_to_root(
    plan: TransferPlan,
    rank: int,
    root: int,
    src_shards: Mapping[str, torch.Tensor],
    stats: SyncStats,
) -> dict[str, torch.Tensor]:
    """Assemble every full parameter on `root` from the trainer shards; other trainer ranks send theirs."""
    if rank != root:
        if plan.is_src(rank):
            reqs = []
            for p, spec in enumerate(plan.params):
                if box_numel(plan.src_box(p, rank)) == 0:  # none of it here (or on another pipeline stage)
                    continue
                shard = src_shards[spec.name]
                if shard.numel():
                    reqs.append(dist.isend(shard.contiguous(), dst=root, tag=p))
                    stats.bytes_sent += shard.numel() * shard.element_size()
            for r in reqs:
                r.wait()  # type: ignore[union-attr]  # this rank is in the world: isend returns its Work
        return {}
    full = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in plan.params}
    full_bytes = sum(s.nbytes for s in plan.params)  # the second full copy
    stats.peak_buffer_bytes = full_bytes
    for p, spec in enumerate(plan.params):
        for other in plan.src_ranks.tolist():
            box = plan.src_box(p, other)
            if box_numel(box) == 0:
                continue
            region = full[spec.name][tuple(slice(lo, hi) for lo, hi in box)]
            if other == root:
                region.copy_(src_shards[spec.name])
                continue
            tmp = torch.empty(region.shape, dtype=spec.dtype)
            stats.peak_buffer_bytes = max(
                stats.peak_buffer_bytes, full_bytes + tmp.numel() * tmp.element_size()
            )
            dist.recv(tmp, src=other, tag=p)
            region.copy_(tmp)
            stats.bytes_received += tmp.numel() * tmp.element_size()
    return full
