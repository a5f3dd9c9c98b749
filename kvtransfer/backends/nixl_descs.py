"""NIXL's view of a KV allocation: its memory type, its registered regions (one per layer), and the
descriptor rows and indices of its blocks — row (layer * planes + plane) * num_blocks + block, so
that index order is address order (nixl.py prepares both sides' lists once; a write picks indices)."""

import numpy as np
import torch

from pdserve.kvtransfer.metadata import KVAgentMetadata


def memory_of(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of an allocation on `device` ("cpu" or "cuda:N")."""
    if device.startswith("cuda"):
        return "VRAM", torch.device(device).index or 0
    return "DRAM", 0  # NIXL wants device id 0 for host memory


def block_descs(base: int, num_layers: int, num_blocks: int, bytes_per_block: int, dev: int,
           num_planes: int = 2) -> np.ndarray:
    """Nx3 (address, length, device) rows, one per (layer, plane, block), row i at offset i * bpb."""
    # Row order equals KVAgentMetadata.offset's: (layer * planes + plane) * num_blocks + block.
    n = num_layers * num_planes * num_blocks
    if n >= 2**31:  # NIXL takes descriptor indices as int32
        raise ValueError(f"{n} KV descriptors exceed NIXL's int32 indices; use larger blocks")
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(bytes_per_block)
    out[:, 1] = bytes_per_block
    out[:, 2] = dev
    return out


def layer_regions(meta: KVAgentMetadata, dev: int) -> list[tuple[int, int, int, str]]:
    """The KV allocation as registered memory: one region per layer (its K and V, or latent, blocks).

    Per-layer regions and one region for the whole allocation move KV equally fast
    (docs/benchmarks-history.md, KV transfer between two GPUs); per layer keeps each region within
    what a peer maps.
    """
    size = meta.num_planes * meta.num_blocks * meta.bytes_per_block
    return [(meta.base_addr + layer * size, size, dev, "") for layer in range(meta.num_layers)]


def plane_indices(layer: int, blocks: np.ndarray, num_blocks: int, num_planes: int = 2) -> np.ndarray:
    """Descriptor indices of each plane of `layer` for these blocks, K then V (K's last and V's first
    may merge), or the latent alone."""
    first = blocks + layer * num_planes * num_blocks
    return np.concatenate([first + p * num_blocks for p in range(num_planes)]).astype(np.int32)


def block_array(ids, num_blocks: int, side: str) -> np.ndarray:
    """Block ids as an int64 array, refusing any outside [0, num_blocks): they would alias another layer."""
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= num_blocks):
        raise ValueError(f"{side} block ids must lie in [0, {num_blocks}), got {a.min()}..{a.max()}")
    return a
