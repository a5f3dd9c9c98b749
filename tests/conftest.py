"""Shared by every test module: threads, and the order xdist hands files out in.

One torch thread per test process under pytest-xdist's workers (`-n N`): the workers share the
host's cores, as a cluster's workers do (the controller gives each `cpu_count // workers` threads),
and the clusters the tests start compete for them too. The engines of the tests run steps of a few
tokens, where a second thread has little to share; on a loaded host its OpenMP spin-waits cost far
more: tiny-moe's 8 reference prompts took 30.8 s with 2 threads against 2.1 s with 1, on 2 cores
beside a running cluster.
"""

import os

import torch


# The README's `-n 2 --dist loadfile` runs each file whole on one worker. xdist hands the files out
# with the most tests first, so a file of a few long tests (a cluster each) came last and ran alone
# while the other worker sat idle (test_tune's one test, 3-4 min, was the last file of a run). These,
# the longest by their seconds in one README run on 2 cores, go first; the rest follow in collection
# order. Only the order changes (an entry no longer true costs balance, nothing else).
LONGEST_FIRST = [
    # The two chaos files first, side by side: their TTFT bounds were checked (5 runs in a row) with
    # each other as the only neighbour on the 2 cores.
    "test_chaos.py",  # ~265 s
    "test_chaos_node.py",  # 217 s
    "test_recovery.py",  # 445 s
    "test_serving.py",  # 320 s
    "test_multinode.py",  # 315 s
    "test_kvtransfer.py",  # 304 s
    "test_tune.py",  # 194 s
    "test_cluster_auth.py",  # 137 s alone on the 2 cores (four Ray/pdserve starts)
    "test_tensor_parallel.py",  # 161 s
    "test_prefix_routing.py",  # 128 s
    "test_faults.py",  # 115 s
    "test_routers.py",  # 87 s
    "test_bench_serving.py",  # 87 s
    "test_warm_up.py",  # 66 s
    "test_kv_reuse.py",  # 63 s
    "test_expert_parallel.py",  # 63 s
    "test_overload.py",  # 58 s
    "test_dashboard.py",  # 57 s
    "test_cold_start.py",  # 45 s
]


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if getattr(config.option, "dist", "no") == "loadfile":  # the controller: keep the workers' order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection is the order the controller deals
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests stay in order

