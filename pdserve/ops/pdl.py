"""Programmatic dependent launch (PDL, Hopper on): a kernel may start while the one before it in the
stream finishes.

A small-batch decode step is a chain of ~13 short kernels a layer, and each one's launch, block
scheduling and prologue used to wait for the previous kernel to end. Launched with PDL, the next
kernel's programs are scheduled once every program of the one before has signalled
(`gdc_launch_dependents`) and run their prologue meanwhile; `griddepcontrol.wait` then holds them
until that kernel has finished and its writes are visible. CUDA graphs keep these edges.

The rule every kernel launched with `launch_kwargs` keeps, so that completion stays transitive (a
kernel that has ended implies every kernel before it has): `wait` before reading anything an earlier
kernel wrote and before writing anything, and always, in every program. `launch_dependents` only
after `wait`. Data no kernel writes (weights) may be read before the wait — that is the point of
prefetching there.
"""

import functools
import os

import torch
import triton
import triton.language as tl

# Off until measured on a GPU (docs/benchmarks.md says when): PDSERVE_PDL=1 turns it on, =prefetch
# with the weight prefetch below; tests flip `ENABLED` / `PREFETCH`.
ENABLED = os.environ.get("PDSERVE_PDL", "0") != "0"


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL: CUDA, compute capability 9 or more, not under
    Triton's interpreter, and not switched off."""
    return (ENABLED and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and _capable(device.index if device.index is not None else torch.cuda.current_device()))


def launch_kwargs(device: torch.device) -> dict:
    """Keywords for a kernel launch: `USE_PDL` (the kernel's constexpr) and Triton's `launch_pdl`."""
    return dict(USE_PDL=True, launch_pdl=True) if enabled(device) else dict(USE_PDL=False)


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Until the kernel before has ended and its writes are visible; then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# PDSERVE_PDL=prefetch: kernels that can also prefetch their weights into L2 before the wait do so
# (an A/B switch while it is measured).
PREFETCH = os.environ.get("PDSERVE_PDL", "0") == "prefetch"


def prefetch(device: torch.device) -> bool:
    """Whether kernels launched with PDL on this device also prefetch their weights before the wait."""
    return PREFETCH and enabled(device)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines these pointers fall in (one pointer per 128-byte line is enough); nothing
    is loaded into registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
