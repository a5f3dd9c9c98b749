"""A tensor-parallel replica's ranks as processes of this host, outside Ray: what the benchmarks
(pdserve/benchmarks/tp_scaling.py) and the GPU tests (tests/test_tensor_parallel_gpu.py) run.

Rank 0 runs `lead(replica, payload)` in its own process, where `replica.engine(config)` builds
rank 0's engine and has every other rank build its own (the same config on its device); each step
rank 0's engine takes is run by the others as a served replica's followers run it
(tp_follower.follow_steps), until `replica.close(engine)`. Several engines may be opened one after
the other over the one group. What `lead` returns (plain data: it crosses a process boundary) is
run_replica's answer.

The rendezvous store lives in the caller's process (bound to port 0), as the controller holds a
served replica's. The rank processes end with os._exit: a NCCL communicator whose collectives live
in captured CUDA graphs hangs when destroyed (torch 2.11 / NCCL 2.28, decode/ep_group.py).
"""

import gc
import os
import traceback
from collections.abc import Callable

import torch

from pdserve.config import EngineConfig

_EXIT = "exit"  # rank 0 is done: the followers' processes end
_ENGINE = "engine"  # (_ENGINE, config as JSON, fill_kv seed): build the next engine
_ALL_REDUCE = "all_reduce"  # (_ALL_REDUCE, shape, dtype name, count, rounds): the group's all-reduces alone


class LocalReplica:
    """Rank 0's handle: opens engines on every rank. With one rank, a plain engine (the reference)."""

    def __init__(self, group, device: str):
        self.group, self.device = group, device
        self.staged = None  # a prefill engine's (KV cache, layout) as its KV would leave the replica

    def engine(self, config: EngineConfig, log: Callable[[str], None] | None = None, fill_kv: int | None = None):
        """Rank 0's engine of `config` (on this rank's device), the others built alongside. `fill_kv`:
        a seed; every rank's KV cache is filled with random values (a benchmark's decode reads it)."""
        from pdserve.engine.engine import Engine

        config = config.model_copy(update={"device": self.device})
        if self.group is None:
            engine = Engine(config, log=log)
            self.staged = engine.kv_cache, engine.layout
            _fill(engine, fill_kv, 0)
            return engine
        self.group._broadcast((_ENGINE, config.model_dump_json(), fill_kv))  # (typed: no pickle between ranks)
        engine = Engine(config, log=log, tp=self.group.tp)
        _fill(engine, fill_kv, 0)
        engine.runner.on_batch = self.group.send
        if config.role == "prefill":  # the KV a prefill replica posts: every head, on rank 0 (tp_group.py)
            self.staged = self.group.stage_kv(engine)
        return engine

    def close(self, engine) -> None:
        """The followers drop their engines too; call before opening the next (and drop yours)."""
        if self.group is not None:
            self.group.stop()
        del engine
        _free()

    def time_all_reduce(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, rounds: int = 10) -> float:
        """Milliseconds of `count` all-reduces of a `shape` tensor back to back, on this group alone
        (median of `rounds`, after two; rank 0's clock): what a step's all-reduces cost by themselves.
        Call between engines (no engine open); 0 with one rank."""
        if self.group is None:
            return 0.0
        self.group._broadcast((_ALL_REDUCE, tuple(shape), str(dtype).removeprefix("torch."), count, rounds))
        return _all_reduces(self.group, self.device, shape, dtype, count, rounds)

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size


def run_replica(lead: Callable, payload, devices: list[str], timeout: float = 600):
    """lead(LocalReplica, payload) on rank 0 of a replica of len(devices) ranks (rank r on
    devices[r]); `lead` must be importable (module level). Raises naming the rank that failed."""
    from pdserve.worker.rank_processes import run_rank_processes

    return run_rank_processes(_rank_main, [(d, lead, payload) for d in devices], timeout, join_s=30)[0]


def _rank_main(rank: int, size: int, port: int, device: str, lead: Callable, payload, results) -> None:
    ok, value = True, None
    try:
        if device == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the host's cores
        group = None
        if size > 1:
            from pdserve.worker.tp_group import TPRank, join_tp_group

            group = join_tp_group(TPRank(rank, size, "127.0.0.1", port), device)
        elif device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if rank == 0:
            value = lead(LocalReplica(group, device), payload)
            if group is not None:
                group._broadcast(_EXIT)
        else:
            _serve(group, device)
    except BaseException:
        ok, value = False, traceback.format_exc()
    results.put((rank, ok, value))
    results.close()
    results.join_thread()  # the result is in the pipe before the process ends
    os._exit(0)


def _serve(group, device: str) -> None:
    """A follower: build each engine rank 0 opens, run its steps until it closes it; until _EXIT."""
    from pdserve.engine.engine import Engine
    from pdserve.worker.tp_follower import follow_steps

    while True:
        msg = group.receive(None)
        if msg == _EXIT:
            return
        if msg is None:
            continue  # a keepalive
        if msg[0] == _ALL_REDUCE:
            _, shape, dtype, count, rounds = msg
            _all_reduces(group, device, shape, getattr(torch, dtype), count, rounds)
            continue
        kind, config, fill_kv = msg
        assert kind == _ENGINE, msg
        config = EngineConfig.model_validate_json(config)
        engine = Engine(config.model_copy(update={"device": device}), tp=group.tp)
        _fill(engine, fill_kv, group.rank)
        if config.role == "prefill":
            group.stage_kv(engine)  # this rank's heads go to rank 0's staging cache each step
        follow_steps(group, engine)
        del engine
        _free()


def _all_reduces(group, device: str, shape, dtype: torch.dtype, count: int, rounds: int) -> float:
    """Every rank: `rounds` + 2 rounds of `count` all-reduces; the median round's ms (CUDA events, or
    the host clock on the CPU)."""
    import statistics
    import time

    dev = torch.device(device)
    x = torch.randn(shape, device=dev).to(dtype)
    times = []
    for _ in range(rounds + 2):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(count):
            group.tp.all_reduce(x)
        if dev.type == "cuda":
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def _fill(engine, seed: int | None, rank: int) -> None:
    """N(0, 1) values in the KV cache (not zeros: they can run faster than real data); an FP8 cache
    layer by layer through bfloat16 (it has no normal_)."""
    if seed is None:
        return
    cache = engine.kv_cache
    gen = torch.Generator(cache.device).manual_seed(seed + rank)
    if cache.dtype.itemsize > 1:
        cache.normal_(generator=gen)
        return
    for layer in cache:
        layer.copy_(torch.randn(layer.shape, generator=gen, device=layer.device, dtype=torch.bfloat16))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
