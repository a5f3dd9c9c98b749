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
