"""What every rank of a role's worker group does alike: pick its device, load the run's seeded initial model,
take frozen log-probs, find its rendezvous and join a sharded world. Public, so that every role's worker
(runtime.actor_worker, engine, critic, reference) imports them from here rather than from another role."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.config import RunConfig
from loopline.data.batches import TokenBatch
from loopline.models.load import load_policy
from loopline.runtime.allocator import return_freed_memory
from loopline.training.policy import response_logprobs


def rank_device() -> torch.device:
    """The device a rank computes on: its GPU when Ray gave it one."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def use_threads(threads: int) -> None:
    """torch's CPU threads in this process: `threads` (0: torch's default), at most the CPUs Ray gave it when it is
    a Ray actor, so that ranks sharing a node's cores do not oversubscribe them."""
    if not threads:
        return
    ray = sys.modules.get("ray")  # imported by every Ray actor; never imported here for a local run
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        threads = max(1, min(threads, int(cpus)))
    torch.set_num_threads(threads)


def setup_process(cfg: RunConfig) -> None:
    """What a process that holds a model sets first: torch's threads and the allocator's threshold."""
    use_threads(cfg.threads)
    return_freed_memory(cfg.malloc_mmap_threshold_kib)


def seeded_model(cfg: RunConfig, rng_offset: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The run's initial policy (the same on every rank), with this process's torch RNG seeded."""
    setup_process(cfg)
    torch.manual_seed(cfg.seed + rng_offset)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    return model.to(rank_device()), tokenizer  # type: ignore[arg-type]  # transformers types .to() oddly


def frozen_logprobs(
    model: PreTrainedModel | None,
    batch: TokenBatch,
    packed: bool = False,
    share_prompts: bool = True,
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """The response tokens' log-probs under `model`, without gradients; `model` None: no reference was started."""
    if model is None:
        raise ValueError("no reference model: start the phase with reference=True (grpo.kl_coef > 0)")
    with torch.no_grad():
        return response_logprobs(
            model, batch, packed=packed, share_prompts=share_prompts, chunk_tokens=chunk_tokens
        )[0]


def rank_and_world() -> tuple[int, int]:
    """This rank's RANK and its group's WORLD_SIZE (WorkerGroup sets both, for the local rank too)."""
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s weights are (a rank given the model in this process computes where it lives)."""
    return next(model.parameters()).device


def rendezvous(timeout_s: float) -> str:
    """The address of a rank group's TCP store, hosted by rank 0 on its node (MASTER_ADDR) on a port it holds
    from now on; other ranks return "" (the group's driver hands rank 0's address to all)."""
    from loopline.training.parallel import open_rendezvous

    rank, _ = rank_and_world()
    return open_rendezvous(os.environ["MASTER_ADDR"], timeout_s) if rank == 0 else ""


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback-only local cluster)."""
    import ray.util

    return ray.util.get_node_ip_address()


def join_sharded(init_method: str, timeout_s: float) -> tuple[Any, Any]:
    """Join a world of FSDP2 ranks only (a critic's or a reference's) as RANK of WORLD_SIZE: its 1-D mesh and
    its checkpoint group."""
    from loopline.training.parallel import join_sharded_world

    rank, ranks = rank_and_world()
    return join_sharded_world(init_method, rank, ranks, timeout_s)
