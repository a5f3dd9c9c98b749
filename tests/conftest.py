"""Shared by every test module.

One torch thread per test process under pytest-xdist's workers (`-n N`): the workers share the
host's cores, as a cluster's workers do (the controller gives each `cpu_count // workers` threads),
and the clusters the tests start compete for them too. The engines of the tests run steps of a few
tokens, where a second thread has little to share; on a loaded host its OpenMP spin-waits cost far
more: tiny-moe's 8 reference prompts took 30.8 s with 2 threads against 2.1 s with 1, on 2 cores
beside a running cluster.
"""

import os

import torch


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
