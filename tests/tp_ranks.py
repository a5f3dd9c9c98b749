"""The ranks of a tensor-parallel replica in processes of their own (gloo): each rank runs a
function with its TensorParallel and the parent collects what every rank returns."""

import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


def run_ranks(target: Callable, payload, size: int = 2, timeout: float = 240) -> list:
    """[target(tp, payload) on rank r for r in range(size)]; `target` must be importable (module level).
    The rendezvous store lives here, bound to port 0, held until every rank is done."""
    from pdserve.worker.rank_processes import run_rank_processes

    out = run_rank_processes(_rank_main, [(target, payload)] * size, timeout)
    return [out[r] for r in range(size)]


def _rank_main(rank: int, size: int, port: int, target: Callable, payload, results) -> None:
    torch.set_num_threads(1)  # the ranks share the test machine's cores
    try:
        from pdserve.models.tensor_parallel import TensorParallel

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=120))
        value = target(TensorParallel(rank, size), payload)
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def join_main(rank: int, size: int, port: int, token: str, results) -> None:
    """A rank that joins a tensor-parallel group as a served replica's do (join_tp_group, holding
    `token`), says one word over the group's control channel and leaves: what rank 0 said, or why
    it could not join."""
    torch.set_num_threads(1)
    try:
        from pdserve.worker.tp_group import TPRank, join_tp_group

        group = join_tp_group(TPRank(rank, size, "127.0.0.1", port, "g-test", token), timeout_s=120)
        if rank == 0:
            group._broadcast("hello")
            value = "hello"
        else:
            value = group.receive(torch.empty(0))
        dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as e:
        results.put((rank, True, f"{type(e).__name__}: {e}"))
