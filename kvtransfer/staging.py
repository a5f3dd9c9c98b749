"""Staging slots: a bounded pool of contiguous buffers, allocated and registered once, where a
request's KV blocks are packed so that they cross the wire in a few large descriptors whatever
their places in the paged cache.

A slot holds a request's new blocks for every layer in the order (layer, plane, block index):
`slot_offset` says where. The prefill end gathers the blocks of a post into one of its slots and
writes it to the decode end's slot for the request; the decode end scatters its slot into the
reserved blocks once the finish notice says every write landed. Gather and scatter are one
`index_select` / `index_copy_` per run of layers with the same blocks: torch ops that run on the
CPU and on a GPU at memory speed, over the cache's bytes, so FP8 KV and MLA's one latent plane
take the same path as K/V.

A slot goes back to the pool only once nothing can touch it any more: the write that read it
settled (prefill end), the lease it received for ended (decode end), and on a GPU the kernel that
read it finished (`release(after=event)`). Nothing waits for a slot: a caller that gets none
takes the per-block path.
"""

import threading
from collections import deque

import torch


def cache_words(kv: torch.Tensor, num_layers: int, num_planes: int, num_blocks: int) -> torch.Tensor:
    """The KV allocation as [layer, plane, block, words of one block], in the order of
    KVAgentMetadata.offset whatever the cache's dtype, in the widest integer that divides a block:
    index_copy_ moves bytes one by one (a quarter of the memory's speed on a CPU), words at speed."""
    raw = kv.view(-1).view(torch.uint8)
    block = raw.numel() // (num_layers * num_planes * num_blocks)
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if block % w.itemsize == 0)
    return raw.view(word).view(num_layers, num_planes, num_blocks, -1)


def slot_offset(layer: int, plane: int, index: int, num_planes: int, num_blocks: int, bytes_per_block: int) -> int:
    """Byte offset in a slot of a request's block `index` (of its `num_blocks` new ones) of one
    layer's plane."""
    return ((layer * num_planes + plane) * num_blocks + index) * bytes_per_block


def layer_runs(parts) -> list[tuple[int, int, list[int], list[int]]]:
    """Parts (layer, src, dst) as (first layer, layers, src, dst): consecutive layers with the
    same blocks joined, so each run is one gather."""
    out: list[tuple[int, int, list[int], list[int]]] = []
    for layer, src, dst in parts:
        if out and out[-1][0] + out[-1][1] == layer and out[-1][2] == list(src) and out[-1][3] == list(dst):
            first, n, s, d = out[-1]
            out[-1] = (first, n + 1, s, d)
        else:
            out.append((layer, 1, list(src), list(dst)))
    return out


class StagingPool:
    """`slots` buffers of `slot_bytes` each, in one allocation on `device` (one registration)."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device | str):
        self.slots = slots
        # Page-aligned slots: any word view of one is aligned, and so is what the NIC reads.
        self.slot_bytes = -(-slot_bytes // 4096) * 4096
        self.buffer = torch.empty(max(slots * self.slot_bytes, 1), dtype=torch.uint8, device=device)
        self._free: deque[int] = deque(range(slots))
        self._fenced: dict[int, torch.cuda.Event] = {}  # slot -> the kernel reading it; free once it ends
        self._lock = threading.Lock()  # the posting thread and the engine's thread may both hold slots

    @property
    def base_addr(self) -> int:
        return self.buffer.data_ptr()

    def idle(self) -> int:
        """Slots no transfer holds (counting those whose last reader is still finishing)."""
        with self._lock:
            return len(self._free) + len(self._fenced)

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.slot_bytes

    def acquire(self) -> int | None:
        """A free slot, or None at once when every slot is held."""
        with self._lock:
            for slot, event in list(self._fenced.items()):
                if event.query():
                    del self._fenced[slot]
                    self._free.append(slot)
            return self._free.popleft() if self._free else None

    def release(self, slot: int, after: torch.cuda.Event | None = None) -> None:
        """Give a slot back; `after`: a GPU kernel still reading it, which must end before reuse."""
        assert 0 <= slot < self.slots
        with self._lock:
            assert slot not in self._free and slot not in self._fenced, f"slot {slot} released twice"
            if after is None:
                self._free.append(slot)
            else:
                self._fenced[slot] = after

    def addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first nbytes of a slot, as bytes."""
        assert nbytes <= self.slot_bytes
        start = slot * self.slot_bytes
        return self.buffer[start:start + nbytes]


def gather(cache: torch.Tensor, runs, out: torch.Tensor) -> list[tuple[int, int, int, list[int], int]]:
    """Pack the blocks of each run (first layer, layers, src, dst) of `cache` (cache_words) into
    `out` (bytes) one after another, each [layers, plane, block]; returns (first layer, layers,
    byte offset in out, dst, block count) per run."""
    planes, words = cache.shape[1], cache.shape[3]
    out = out.view(cache.dtype)
    at = 0
    placed = []
    for first, n, src, dst in runs:
        k = len(src)
        size = n * planes * k * words
        idx = torch.tensor(src, dtype=torch.long).to(cache.device, non_blocking=True)
        torch.index_select(cache[first:first + n], 2, idx, out=out[at:at + size].view(n, planes, k, words))
        placed.append((first, n, at * cache.dtype.itemsize, dst, k))
        at += size
    return placed


def scatter(cache: torch.Tensor, staged: torch.Tensor, blocks: list[int]) -> None:
    """Unpack a slot (bytes) holding every layer's planes of `blocks` (in slot order) into those
    blocks of `cache` (cache_words)."""
    layers, planes, words = cache.shape[0], cache.shape[1], cache.shape[3]
    idx = torch.tensor(blocks, dtype=torch.long).to(cache.device, non_blocking=True)
    cache.index_copy_(2, idx, staged.view(cache.dtype).view(layers, planes, len(blocks), words))
