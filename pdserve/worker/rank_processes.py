"""The ranks of one group (tensor or expert parallel) as processes of this host, outside Ray: what
benchmarks and tests run where no cluster is wanted. One spawned process a rank; the rendezvous
store lives in the caller's process (bound to port 0: no port picked here that another could take),
as the controller holds a served group's, until every rank is done."""

import multiprocessing as mp
from collections.abc import Callable


def run_rank_processes(main: Callable, rank_args: list[tuple], timeout: float, join_s: float = 10,
                       before_start: Callable[[str, int], None] | None = None) -> dict[int, object]:
    """`main(rank, size, store_port, *rank_args[rank], results)` in a process a rank (`main` must be
    importable: module level); each puts `(rank, ok, value)` on `results` (ok False: value is the
    traceback). Returns {rank: value}; raises naming the first rank that failed, or queue.Empty
    when none says anything within `timeout` s. `before_start(host, port)` sees the store's address
    before any rank starts."""
    from pdserve.worker.rendezvous import rendezvous_store

    size = len(rank_args)
    store = rendezvous_store("127.0.0.1")
    port = store.port
    if before_start is not None:
        before_start("127.0.0.1", port)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=main, args=(r, size, port, *rank_args[r], results)) for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} of {size} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
        del store  # the ranks are gone: the port may go
    return out
