"""Programmatic dependent launch (PDL, Hopper on): a kernel may start while the one before it in the
stream finishes.

A small-batch decode step is a chain of ~13 short kernels a layer, and each one's launch, block
scheduling and prologue used to wait for the previous kernel to end. Launched with PDL, the next
kernel's programs are scheduled once every program of the one before has signalled
(`gdc_launch_dependents`) and run their prologue meanwhile; `griddepcontrol.wait` then holds them
until that kernel has finished and its writes are visible. CUDA graphs keep these edges. One H200,
Qwen3-30B-A3B's shape (docs/benchmarks.md, "Programmatic dependent launch"): the decode step at batch
1 / 2 / 4 / 8 took 3.29 / 4.18 / 5.71 / 8.43 ms without, 2.99 / 3.93 / 5.46 / 8.26 ms with.

The rule every kernel launched with `launch_kwargs` keeps, so that completion stays transitive (a
kernel that has ended implies every kernel before it has): `wait` before reading anything an earlier
kernel wrote and before writing anything, and always, in every program. `launch_dependents` only
after `wait`. Hence when a kernel's programs start, every kernel but the one right before it has
ended: what only those wrote (or nothing did) may be read before the wait (`prefetches`).
(Data no kernel writes, weights, may be read before the wait: asking L2 for the w2 GEMV's
expert rows there was tried and measured slower, 3.06 / 8.92 ms at batch 1 / 8.)
"""

import functools
import os

import torch
import triton
import triton.language as tl

# PDSERVE_PDL=0 turns it off (an A/B switch); tests flip `ENABLED`.
ENABLED = os.environ.get("PDSERVE_PDL", "1") != "0"
# Which kernels load, before their wait, data that no kernel of the last two wrote (weights; the
# attention's cache below the new token): PDSERVE_PREFETCH, a comma-separated list of
# PREFETCH_KINDS or "1" for all; none by default until timed (a trial: issue 44). Tests set `PREFETCH`.
PREFETCH_KINDS = ("attention", "linear", "router")
_prefetch = os.environ.get("PDSERVE_PREFETCH", "0")
PREFETCH = set(PREFETCH_KINDS) if _prefetch == "1" else set(_prefetch.split(",")) - {"0", ""}


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: CUDA, compute capability 9 or more, not under
    Triton's interpreter, and not switched off."""
    return (ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and _capable(device.index if device.index is not None else torch.cuda.current_device()))


def prefetches(kind: str) -> bool:
    """Whether kernels of `kind` (one of PREFETCH_KINDS) load their prefetchable data before the wait."""
    return kind in PREFETCH


def launch_kwargs(device: torch.device) -> dict:
    """Keywords for a kernel launch: `USE_PDL` (the kernel's constexpr) and Triton's `launch_pdl`."""
    return dict(USE_PDL=True, launch_pdl=True) if enabled(device) else dict(USE_PDL=False)


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Until the kernel before has ended and its writes are visible; then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
