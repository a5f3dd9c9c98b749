"""The descriptors of a staged NIXL write (kvtransfer/staging.py): (local address, remote address,
length) rows from our blocks or our slot into the peer's slot, joined where they are adjacent on
both sides, as the [N, 3] arrays NIXL takes.

The peer's slot holds the request's `n` blocks in the order (layer, plane, block index), so the
rows of a post that covers all of the request's blocks join into one per run of layers.
"""

import numpy as np

from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.staging import slot_offset

Row = tuple[int, int, int]  # (local address, remote address, bytes)


def gathered_rows(placed, base: int, remote: int, at: dict[int, int], n: int, planes: int, bpb: int) -> list[Row]:
    """Rows from our slot at `base`, packed by staging.gather (`placed`), into the peer's slot at
    `remote`; `at`: a destination block's index among the request's n."""
    rows = []
    for first, count, offset, dst, k in placed:
        pairs = runs(list(range(k)), [at[d] for d in dst])
        for layer in range(first, first + count):
            for plane in range(planes):
                local = base + offset + ((layer - first) * planes + plane) * k * bpb
                rows += [(local + s0 * bpb, remote + slot_offset(layer, plane, d0, planes, n, bpb), length * bpb)
                         for s0, d0, length in pairs]
    return rows


def block_rows(groups, meta: KVAgentMetadata, remote: int, at: dict[int, int], n: int) -> list[Row]:
    """Rows from each run of our blocks (groups: staging.layer_runs) straight into the peer's slot."""
    bpb, planes = meta.bytes_per_block, meta.num_planes
    rows = []
    for first, count, src, dst in groups:
        pairs = runs(list(src), [at[d] for d in dst])
        for layer in range(first, first + count):
            for plane in range(planes):
                rows += [(meta.base_addr + meta.offset(layer, plane, s0),
                          remote + slot_offset(layer, plane, d0, planes, n, bpb), length * bpb)
                         for s0, d0, length in pairs]
    return rows


def descriptors(rows: list[Row], local_dev: int, remote_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote (address, length, device) rows, rows adjacent on both sides joined (NIXL
    joins only a prepared list's descriptors)."""
    out: list[list[int]] = []
    for local, remote, length in rows:
        if out and out[-1][0] + out[-1][2] == local and out[-1][1] + out[-1][2] == remote:
            out[-1][2] += length
        else:
            out.append([local, remote, length])
    a = np.array(out, dtype=np.uint64).reshape(-1, 3)
    local_rows, remote_rows = np.empty_like(a), np.empty_like(a)  # C-contiguous, as NIXL wants
    local_rows[:, 0], remote_rows[:, 0] = a[:, 0], a[:, 1]
    local_rows[:, 1] = remote_rows[:, 1] = a[:, 2]
    local_rows[:, 2], remote_rows[:, 2] = local_dev, remote_dev
    return local_rows, remote_rows
