"""The last program of a group to finish its part, found with one atomic: it does the group's
second pass in the same launch.

A split kernel and its reduce kernel are two launches; in a small-batch decode step each kernel
boundary costs microseconds. Instead, every program of a group writes its partial result, then
increments the group's counter; the program that sees count - 1 knows every partial is written and
visible, adds them, and resets the counter to zero for the next launch. The merge order does not
depend on which program arrives last, so the result is deterministic.

Used where it measured faster: the down GEMV's partial rows of a token (pdserve/ops/gemv_moe.py,
the `moe_sum` launch gone; one H200, decode at batch 1 0.98x). It lost everywhere else it was tried
(docs/benchmarks.md, 2026-11-30): decode attention's slices merged by the last slice (1.15x slower
at batch 1), the router's top-k by the last of its GEMV's programs (1.05x), the o projection's GEMV
adding the residual and normalising (1.02x at batch 2). There the last program's serial work
(eight heads' merge, a top-k over four warps, a 2,048-wide norm) and the release/acquire atomic
cost more than the kernel boundary they save.

Counters live in one zeroed int32 buffer per device, allocated on first use and kept for the
process (CUDA graphs bake its address in). Every kernel that uses it leaves it zeroed, and kernels
on one stream do not overlap (a PDL launch waits for the kernel before to end before it touches
memory: pdserve/ops/pdl.py), so one buffer serves every layer.
"""

import functools
import os

import torch
import triton
import triton.language as tl

# PDSERVE_FUSED_MERGE=0: the separate launches (an A/B switch for benchmarks).
ENABLED = os.environ.get("PDSERVE_FUSED_MERGE", "1") != "0"
NUM_COUNTERS = 1 << 16


@functools.cache
def _buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)


def buffer(device: torch.device) -> torch.Tensor:
    """The device's counters, all of them (zero between launches)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _buffer(device)


def counters(device: torch.device, groups: int) -> torch.Tensor | None:
    """`groups` zeroed counters on `device`, or None (take the separate launch) where the switch is
    off or there are more groups than counters."""
    if not ENABLED or groups > NUM_COUNTERS:
        return None
    return buffer(device)


@triton.jit
def last_to_arrive(counter_ptr, group_size):
    """Called by every program of a group after storing its partial result: True in the one that
    arrives last, which may then read every partial of the group (with `cache_modifier=".cg"`:
    from L2, never a stale L1 line). Resets the counter."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == group_size - 1
    tl.store(counter_ptr, 0, mask=last)
    return last
