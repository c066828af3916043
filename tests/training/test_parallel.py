"""The rendezvous of a role's ranks: rank 0 hosts the store on a port it holds from the moment it is chosen
(a port probed free and released could be taken by another process before rank 0 binds it: EADDRINUSE)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loopline.training.parallel import init_distributed, open_rendezvous


def test_the_rendezvous_port_is_held_until_the_world_is_joined() -> None:
    address = open_rendezvous("127.0.0.1", timeout_s=30)
    port = int(address.rsplit(":", 1)[1])
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))  # no one else can take it between rendezvous and join


def _rank(rank: int, addresses: mp.Queue, results: mp.Queue) -> None:
    if rank == 0:
        address = open_rendezvous("127.0.0.1", timeout_s=30)
        addresses.put(address)  # the driver hands rank 0's address to the others
    else:
        address = addresses.get(timeout=60)
    init_distributed(address, rank, 2, timeout_s=30)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    results.put((rank, total.item()))
    dist.destroy_process_group()


@pytest.mark.gloo  # two spawned ranks (the rest of this module: unit)
def test_two_processes_join_through_rank_0s_store() -> None:
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, addresses, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in range(2)) == [(0, 3.0), (1, 3.0)]


def test_a_rendezvous_address_that_is_not_tcp_is_named() -> None:
    with pytest.raises(ValueError, match="file:///x"):
        init_distributed("file:///x", 1, 2, timeout_s=1)
