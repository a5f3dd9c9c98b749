"""One kernel that copies a request's KV blocks, for any number of layers, into a peer GPU's cache.

Why a kernel rather than copy engines: a request's blocks are runs scattered over the allocation,
and each (layer, K/V, run) would be its own cudaMemcpy — thousands of calls for a fragmented
request, each paying a launch. Here one launch covers every (layer, plane, block) of the request
(the planes are K and V, or MLA's one latent):
each program moves one block with wide loads and stores, the stores going over NVLink into the
peer's memory (mapped through CUDA IPC), so fresh and fragmented allocations cost the same.
It comes close to the copy engine's peer rate from 4k tokens up, in one process
(pdserve.benchmarks.p2p_probe, in git history at eccf932). 16 warps per program looked faster in
one sweep (p2p_sweep) but made the two-process transfer slower end to end
(docs/benchmarks-history.md, KV transfer between two GPUs): 4 it is.
"""

import torch
import triton
import triton.language as tl
from triton import knobs

NUM_WARPS = 4
CHUNK_WORDS = 1024


# Integer arguments are not specialised (Triton would compile a variant per value class, e.g. for
# n_blocks == 1): one compiled kernel per block size serves every request, so no request ever
# waits for a compilation after warm-up. Alignment still follows from BLOCK_WORDS.
@triton.jit(do_not_specialize=["n_blocks", "first_lkv", "src_num_blocks", "dst_num_blocks"])
def _copy_blocks(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, n_blocks, first_lkv,
                 src_num_blocks, dst_num_blocks,
                 BLOCK_WORDS: tl.constexpr, CHUNK: tl.constexpr):
    # Program p moves block p % n_blocks of the (layer * planes + plane) slab first_lkv + p // n_blocks.
    pid = tl.program_id(0)
    i = pid % n_blocks
    lkv = (pid // n_blocks + first_lkv).to(tl.int64)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    src = src_ptr + (lkv * src_num_blocks + s) * BLOCK_WORDS
    dst = dst_ptr + (lkv * dst_num_blocks + d) * BLOCK_WORDS
    for off in tl.static_range(0, BLOCK_WORDS, CHUNK):
        o = off + tl.arange(0, CHUNK)
        m = o < BLOCK_WORDS
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def _words(kv: torch.Tensor) -> torch.Tensor:
    """The allocation as 8-byte words (4 or 2 if its size forbids): fewer, wider memory operations."""
    flat = kv.view(-1).view(torch.uint8)
    bpb = kv[0, 0, 0].numel() * kv.element_size()
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if bpb % size == 0:
            return flat.view(dt)
    return flat


def _hooked() -> bool:
    """Launch hooks installed (a profiler, proton): launches go through the JIT, which calls them."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class BlockCopy:
    """The copy from one cache into another, its word views and sizes worked out once: a post then
    costs the kernel launch alone (the connector posts per request, or per layer while streaming).

    The first call goes through Triton's JIT (compiling or finding the kernel); later calls hand
    the arguments straight to the compiled kernel's launcher: the JIT's per-call binding,
    specialisation key and cache lookup cost host time on every post, on a path where every
    microsecond delays the copy's start (docs/benchmarks-history.md, KV transfer between two GPUs). The
    specialisation the kernel was compiled for stays valid: the caches are the same tensors and
    the ids pointers are checked to keep the 16-byte alignment Triton assumed."""

    def __init__(self, src_kv: torch.Tensor, dst_kv: torch.Tensor, num_warps: int = NUM_WARPS,
                 chunk: int = CHUNK_WORDS):
        self.src_w, self.dst_w = _words(src_kv), _words(dst_kv)
        self.src_num_blocks, self.dst_num_blocks = src_kv.shape[2], dst_kv.shape[2]
        assert src_kv.shape[1] == dst_kv.shape[1] and src_kv.shape[3:] == dst_kv.shape[3:], "another KV layout"
        self.planes = src_kv.shape[1]  # K and V, or MLA's latent
        self.words_per_block = self.src_w.numel() // (src_kv.shape[0] * self.planes * src_kv.shape[2])
        self.chunk = min(chunk, triton.next_power_of_2(self.words_per_block))
        self.num_warps = num_warps
        self._src_addr, self._dst_addr = self.src_w.data_ptr(), self.dst_w.data_ptr()
        self._kernel = None  # the compiled kernel, once the JIT has run it with aligned ids

    def __call__(self, first_layer: int, num_layers: int, src_ids: torch.Tensor, dst_ids: torch.Tensor,
                 stream: int | None = None, n: int | None = None) -> None:
        """dst[l, :, dst_ids[i]] = src[l, :, src_ids[i]] for i < n, l in [first_layer, first_layer + num_layers).
        The ids are int32 tensors on the source's device or in pinned host memory (the kernel then
        reads them over PCIe: nothing to upload); `n` defaults to all of them. Runs on `stream` (a
        raw CUDA stream handle) or else the current stream."""
        n = src_ids.numel() if n is None else n
        if n == 0 or num_layers == 0:
            return
        k = self._kernel
        aligned = src_ids.data_ptr() % 16 == 0 and dst_ids.data_ptr() % 16 == 0
        if k is not None and aligned and not _hooked():
            if stream is None:
                stream = torch.cuda.current_stream(self.src_w.device).cuda_stream
            # The caches as plain device addresses: the launcher skips their pointer lookups.
            k.run(num_layers * self.planes * n, 1, 1, stream, k.function, k.packed_metadata, None, None, None,
                  self._src_addr, self._dst_addr, src_ids, dst_ids, n, first_layer * self.planes, self.src_num_blocks,
                  self.dst_num_blocks, self.words_per_block, self.chunk)
            return
        args = (self.src_w, self.dst_w, src_ids, dst_ids, n, first_layer * self.planes, self.src_num_blocks,
                self.dst_num_blocks)
        if stream is not None:  # (entering the stream also makes its device the current one)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.src_w.device)):
                k = _copy_blocks[(num_layers * self.planes * n,)](*args, BLOCK_WORDS=self.words_per_block,
                                                        CHUNK=self.chunk, num_warps=self.num_warps)
        else:
            k = _copy_blocks[(num_layers * self.planes * n,)](*args, BLOCK_WORDS=self.words_per_block,
                                                    CHUNK=self.chunk, num_warps=self.num_warps)
        # Under TRITON_INTERPRET there is no compiled kernel to keep: every call takes this path.
        if aligned and all(hasattr(k, a) for a in ("run", "function", "packed_metadata")):
            self._kernel = k


def copy_blocks(src_kv: torch.Tensor, dst_kv: torch.Tensor, first_layer: int, num_layers: int,
                src_ids: torch.Tensor, dst_ids: torch.Tensor, num_warps: int = NUM_WARPS,
                chunk: int = CHUNK_WORDS) -> None:
    """dst_kv[l, :, dst_ids[i]] = src_kv[l, :, src_ids[i]] for l in [first_layer, first_layer + num_layers).

    Both caches are [layers, planes, blocks, block_size, heads, dim] of one layout and dtype (their block
    counts may differ); the ids are int32 tensors on src_kv's device. Runs on the current stream.
    """
    BlockCopy(src_kv, dst_kv, num_warps, chunk)(first_layer, num_layers, src_ids, dst_ids)
