"""`loopline bench sync`: weight sync across processes, naive (gather + broadcast) vs planned.

One command spawns a gloo world on this machine: `--trainer` ranks hold the model under FSDP2
(`fully_shard` per decoder layer and on the root), `--engines` x `--engine-tp` ranks hold engine
weights (a whole model at TP=1, TP shards otherwise). For the built-in model and a ~100M-parameter
config it times both syncs (median of `--repeats`), counts the bytes that cross ranks, and
measures each rank's peak extra memory during the sync two ways: the bytes of staging buffers
the sync allocates, and the rise of peak RSS (VmHWM after resetting it). It also plans a
Llama-70B-shaped sync from 4,096 FSDP ranks to 512 engines at TP=8, without running ranks.
Prints `name: value` lines, ending with the headline ratios planned/naive.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loopline.bench._procstat import reset_peak, status_bytes
from loopline.bench.args import require_positive

# FSDP2 exactly as the trainer applies it (the tests import these from here too)
from loopline.training.parallel import shard_model, trainer_mesh

BENCH_MODELS: dict[str, dict[str, int]] = {
    "builtin": {},  # the default TinyModelConfig, ~0.8M parameters
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2560),
}


# ---------------------------------------------------------------------------------------------
# A local gloo world (also used by the tests)
# ---------------------------------------------------------------------------------------------


# What a rank imports before its function runs. The ranks fork from a server that imported these once (per
# process that calls run_world), instead of each importing torch and transformers anew: seconds per rank here.
_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers.modeling_utils", "loopline.training.parallel"]


def run_world(fn: Callable[..., None], world_size: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes joined in one gloo group.

    The processes fork from multiprocessing's fork server (started once, with `_PRELOAD` imported) and take this
    process's environment as it is now, as spawned ones would. Rendezvous goes through a file (no listening store
    socket); gloo binds the loopback interface. Raises if a rank fails or the world is not done within `timeout_s`
    (the ranks are then killed).
    """
    # read when the server starts (the first call): later calls change nothing
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="loopline-world-") as tmp:
        ctx = mp.start_processes(
            _world_entry,
            args=(fn, world_size, os.path.join(tmp, "store"), dict(os.environ), args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo world of {world_size} ranks did not finish in {timeout_s:.0f}s")
        finally:
            for proc in ctx.processes:  # only the processes this call started
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)


def _world_entry(
    rank: int, fn: Callable[..., None], world_size: int, store_path: str, env: dict[str, str], args: tuple
) -> None:
    os.environ.clear()  # the caller's environment, not the fork server's (started by an earlier call)
    os.environ.update(env)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo's sockets on 127.0.0.1
    torch.set_num_threads(1)  # several ranks share few cores
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # no rank tears its group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # A rank that finished leaves without interpreter finalization, where gloo's threads and the work objects
    # they hold are torn down (a suite run once lost a rank to SIGABRT, "terminate called without an active
    # exception", the mark of threads destroyed while running). A rank that raised exits through multiprocessing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """Entry point of `loopline bench sync ARGS...`."""
    parser = argparse.ArgumentParser(
        prog="loopline bench sync", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--trainer", type=int, default=2, help="FSDP ranks of the trainer")
    parser.add_argument("--engines", type=int, default=1, help="engine replicas")
    parser.add_argument("--engine-tp", type=int, default=2, help="TP ranks per engine")
    parser.add_argument("--colocated", action="store_true", help="put the engine ranks on the trainer ranks")
    parser.add_argument("--models", default="builtin,100m", help=f"comma list of {sorted(BENCH_MODELS)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs per method (median reported)")
    parser.add_argument("--bucket-mb", type=float, default=16.0, help="bucket size of the planned sync, MiB")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before the world is killed")
    parser.add_argument("--skip-plan-70b", action="store_true", help="skip planning the 70B-shaped sync")
    args = parser.parse_args(argv)
    require_positive(parser, args, "trainer", "engines", "engine_tp", "repeats", "bucket_mb", "timeout")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in BENCH_MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; accepted: {sorted(BENCH_MODELS)}")
    engine_ranks = args.engines * args.engine_tp
    world = max(args.trainer, engine_ranks) if args.colocated else args.trainer + engine_ranks
    first = 0 if args.colocated else args.trainer
    print(f"world: {world}")
    print(f"trainer: fsdp={args.trainer} on ranks 0-{args.trainer - 1}")
    print(f"engines: {args.engines} x tp={args.engine_tp} on ranks {first}-{first + engine_ranks - 1}")
    print(f"bucket_bytes: {int(args.bucket_mb * 2**20)}")
    if not args.skip_plan_70b:
        _plan_70b()

    headline: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="loopline-bench-sync-") as out:
        conf = dict(
            trainer=args.trainer,
            engines=args.engines,
            engine_tp=args.engine_tp,
            colocated=args.colocated,
            models=models,
            repeats=args.repeats,
            bucket_bytes=int(args.bucket_mb * 2**20),
        )
        start = time.perf_counter()
        run_world(_bench_rank, world, args=(conf, out), timeout_s=args.timeout)
        print(f"wall_s: {time.perf_counter() - start:.1f}")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    for name in models:
        headline = _report(name, [r[name] for r in ranks])
    last = models[-1]
    print(f"headline.model: {last}")
    print(f"headline.time_planned_over_naive: {headline['time']:.3f}")
    print(f"headline.peak_buffer_planned_over_naive: {headline['buffer']:.3f}")
    print(f"headline.peak_rss_planned_over_naive: {headline['rss']:.3f}")
    return 0


def _plan_70b() -> None:
    """Plan and check the Llama-70B-shaped case at 4,096 -> 512 x TP8 and print its numbers."""
    from loopline.distributed.resharding import (
        EngineLayout,
        TrainerLayout,
        check_plan,
        llama_specs,
        plan_transfers,
    )

    specs = llama_specs()
    t0 = time.perf_counter()
    plan = plan_transfers(specs, TrainerLayout(fsdp=4096), EngineLayout(engines=512, tp=8))
    t1 = time.perf_counter()
    report = check_plan(plan)
    t2 = time.perf_counter()
    print(f"plan_70b.params: {sum(s.nbytes // s.dtype.itemsize for s in specs)}")
    print("plan_70b.layout: fsdp=4096 -> engines=512 x tp=8")
    print(f"plan_70b.plan_s: {t1 - t0:.3f}")
    print(f"plan_70b.check_s: {t2 - t1:.3f}")
    print(f"plan_70b.exact_once: {str(report.exact).lower()}")
    print(f"plan_70b.transfers: {report.num_transfers}")
    print(f"plan_70b.bytes_moved: {report.bytes_moved}")
    print(f"plan_70b.lower_bound: {report.lower_bound}")
    print(f"plan_70b.moved_over_lower_bound: {report.moved_over_lower_bound:.6f}")
    print(f"plan_70b.naive_bytes: {report.naive_bytes}")
    print(f"plan_70b.max_rank_send: {report.max_rank_send}")
    print(f"plan_70b.naive_max_rank_send: {report.naive_max_rank_send}")


def _report(name: str, ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Print one model's lines; the sync's time is the slowest rank's, memory the worst rank's."""
    first = ranks[0]
    print(f"{name}.params: {first['params']}")
    print(f"{name}.param_bytes: {first['param_bytes']}")
    out = {}
    for method in ("naive", "planned"):
        times = [max(r[method]["seconds"][i] for r in ranks) for i in range(len(first[method]["seconds"]))]
        t = statistics.median(times)
        sent = sum(r[method]["bytes_sent"] for r in ranks)
        local = sum(r[method]["bytes_local"] for r in ranks)
        buf = max(r[method]["peak_buffer_bytes"] for r in ranks)
        rss = max(r[method]["peak_rss_delta"] for r in ranks)
        print(f"{name}.{method}.time_s: {t:.4f}")
        print(f"{name}.{method}.bytes_across_ranks: {sent}")
        print(f"{name}.{method}.bytes_local: {local}")
        print(f"{name}.{method}.peak_buffer_bytes_max_rank: {buf}")
        print(f"{name}.{method}.peak_rss_delta_bytes_max_rank: {rss}")
        out[method] = (t, buf, rss)
    print(f"{name}.planned_equals_naive_bitwise: {str(all(r['verified'] for r in ranks)).lower()}")
    (tn, bn, rn), (tp, bp, rp) = out["naive"], out["planned"]
    return {"time": tp / tn, "buffer": bp / max(bn, 1), "rss": rp / max(rn, 1)}


def _bench_rank(rank: int, world: int, conf: dict[str, Any], out: str) -> None:
    """One rank of the benchmark world: build, shard, sync both ways, write its numbers to out/rank{r}.json."""
    from loopline.distributed.resharding import EngineLayout, TrainerLayout, plan_transfers
    from loopline.distributed.weight_sync import (
        empty_engine_shards,
        engine_tensors,
        local_shards,
        param_specs,
        sync_weights,
        sync_weights_naive,
    )
    from loopline.models.config import ModelConfig
    from loopline.models.load import load_policy

    mesh = trainer_mesh(conf["trainer"])
    results: dict[str, Any] = {}
    for name in conf["models"]:
        model, _ = load_policy(ModelConfig(tiny=BENCH_MODELS[name]), seed=0 if rank < conf["trainer"] else 1)
        specs = param_specs(model)
        engine_ranks = tuple(range(conf["engines"] * conf["engine_tp"])) if conf["colocated"] else None
        layout = EngineLayout(conf["engines"], conf["engine_tp"], ranks=engine_ranks)
        plan = plan_transfers(specs, TrainerLayout(conf["trainer"]), layout)
        src = dst = None
        if plan.is_src(rank):
            src = local_shards(shard_model(model, mesh))
        if plan.dst_position(rank) is not None:
            if src is None and conf["engine_tp"] == 1:
                dst = engine_tensors(model)  # a whole engine model
            else:
                dst = empty_engine_shards(plan, rank)  # TP shards, or an engine beside a trainer shard
                if src is None:
                    model = None  # a TP engine keeps only its shards
        res: dict[str, Any] = {"params": sum(s.nbytes // s.dtype.itemsize for s in specs)}
        res["param_bytes"] = sum(s.nbytes for s in specs)
        digests = {}
        for method in ("naive", "planned"):
            runs = []
            for _ in range(conf["repeats"]):
                if dst is not None:
                    for t in dst.values():
                        t.fill_(float("nan"))  # a byte the sync misses stays NaN and spoils the digest
                dist.barrier()
                rss0 = reset_peak()
                if method == "naive":
                    stats = sync_weights_naive(plan, src, dst)
                else:
                    stats = sync_weights(plan, src, dst, bucket_bytes=conf["bucket_bytes"])
                rss_delta = status_bytes("VmHWM") - rss0
                dist.barrier()
                runs.append((stats, rss_delta))
            digests[method] = _digest(dst)
            res[method] = {
                "seconds": [s.seconds for s, _ in runs],
                "bytes_sent": runs[-1][0].bytes_sent,
                "bytes_local": runs[-1][0].bytes_local,
                "peak_buffer_bytes": max(s.peak_buffer_bytes for s, _ in runs),
                "peak_rss_delta": max(d for _, d in runs),
            }
        res["verified"] = digests["naive"] == digests["planned"]
        results[name] = res
        model = src = dst = None
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _digest(tensors: dict[str, torch.Tensor] | None) -> str:
    """SHA-256 of the raw bytes of a rank's engine tensors (empty for ranks without any)."""
    h = hashlib.sha256()
    for name, t in sorted((tensors or {}).items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
