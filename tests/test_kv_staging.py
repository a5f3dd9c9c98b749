"""NIXL's staging slots for real (two NixlBackends over UCX on CPU memory, one process driving both):
a request's blocks, wherever they lie, cross in a few descriptors and land where the lease says,
for K/V and latent caches and FP8 bytes; the slots are bounded, never waited for, and come back.

The serving path (a prefill and a decode process, greedy output against colocated, faults) is in
tests/test_kvtransfer.py and tests/test_fp8_kv.py.
"""

import random
import time
import uuid

import pytest
import torch

from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.kvtransfer.backends.nixl_find import nixl_module
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.staging import cache_words
from pdserve.kvtransfer.wire import ReserveHandle

pytestmark = pytest.mark.skipif(nixl_module() is None, reason="nixl is not installed")

LAYERS, NUM_BLOCKS, N = 3, 40, 10  # N: the request's blocks
SLOT_MB = 0.03  # 32 KiB a slot (rounded up to pages): a request of N blocks (15 KiB at most) fits, one of NUM_BLOCKS does not


def _layout(kind: str, dtype: torch.dtype) -> KVLayout:
    return KVLayout(LAYERS, NUM_BLOCKS, 4, *((2, 8) if kind == "kv" else (1, 16)), dtype, kind)


class Pair:
    """A writer and a reader backend on two KV allocations of one layout, handshaked both ways."""

    def __init__(self, kind="kv", dtype=torch.float32, writer_slots=2, reader_slots=2):
        from pdserve.kvtransfer.backends.nixl import NixlBackend

        layout = _layout(kind, dtype)
        self.src = allocate_kv_cache(layout, torch.device("cpu"))
        raw = self.src.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))
        self.dst = allocate_kv_cache(layout, torch.device("cpu"))
        tag = uuid.uuid4().hex[:8]
        self.wmeta = KVAgentMetadata.for_cache(f"w-{tag}", "nixl", self.src, layout, "f")
        self.rmeta = KVAgentMetadata.for_cache(f"r-{tag}", "nixl", self.dst, layout, "f")
        self.writer = NixlBackend(self.wmeta, self.src, telemetry=True, staging_slots=writer_slots,
                                  staging_slot_mb=SLOT_MB)
        self.reader = NixlBackend(self.rmeta, self.dst, staging_slots=reader_slots, staging_slot_mb=SLOT_MB)
        self.writer.add_peer(self.rmeta)
        self.reader.add_peer(self.wmeta)
        self.planes = layout.num_planes

    def wait(self, tokens, timeout=5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while any(self.writer.state(t) == "pending" for t in tokens) and time.monotonic() < deadline:
            self.reader.progress()  # UCX on host memory: the target side progresses too
            time.sleep(0.001)
        return [self.writer.state(t) for t in tokens]

    def landed(self, src_blocks, dst_blocks) -> bool:
        s = cache_words(self.src, LAYERS, self.planes, NUM_BLOCKS)
        d = cache_words(self.dst, LAYERS, self.planes, NUM_BLOCKS)
        others = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
        return torch.equal(s[:, :, src_blocks], d[:, :, dst_blocks]) and not d[:, :, others].any()

    def close(self):
        self.writer.close()
        self.reader.close()


def scattered(seed: int) -> list[int]:
    return random.Random(seed).sample(range(NUM_BLOCKS), N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "fp8"])
@pytest.mark.parametrize("kind", ["kv", "latent"])
def test_staged_posts_land_every_layer_in_the_leases_blocks(kind, dtype):
    """Two posts (a chunked prompt: its first 6 blocks, then 4), scattered on both sides: each is
    gathered into a slot of the writer's and crosses as a descriptor per layer and plane; the
    reader's scatter puts every byte where the lease says and touches no other block."""
    pair = Pair(kind, dtype)
    try:
        src, dst = scattered(1), scattered(2)
        slot = pair.reader.reserve_staging(pair.wmeta.engine_id, dst)
        assert slot is not None and pair.reader.staging.idle() == 1
        handle = ReserveHandle("r", pair.rmeta.engine_id, dst, 10.0, staging=slot)
        tokens = []
        for lo, hi in ((0, 6), (6, N)):
            tokens += pair.writer.write_staged(handle, [(layer, src[lo:hi], dst[lo:hi]) for layer in range(LAYERS)])
        assert pair.wait(tokens) == ["done", "done"]
        assert [pair.writer.descriptor_count(t) for t in tokens] == [LAYERS * pair.planes] * 2
        assert pair.writer.posts_gathered == 2 and pair.writer.staging.idle() == 2  # free once written
        pair.reader.unstage(slot, dst)
        assert pair.landed(src, dst)
        assert pair.reader.staging.idle() == 2
        for t in tokens:
            pair.writer.release(t)
    finally:
        pair.close()


def test_a_whole_prompt_crosses_as_one_descriptor_where_per_block_takes_one_a_block():
    """The reason for the slots: scattered blocks cost NIXL a descriptor per block, layer and
    plane; staged, the same KV is one descriptor."""
    pair = Pair()
    try:
        src, dst = scattered(3), scattered(4)
        parts = [(layer, src, dst) for layer in range(LAYERS)]
        [direct] = pair.writer.write_layers(pair.rmeta.engine_id, parts)
        slot = pair.reader.reserve_staging(None, dst)
        [staged] = pair.writer.write_staged(ReserveHandle("r", pair.rmeta.engine_id, dst, 10.0, staging=slot), parts)
        assert pair.wait([direct, staged]) == ["done", "done"]
        assert pair.writer.descriptor_count(direct) == LAYERS * 2 * N
        assert pair.writer.descriptor_count(staged) == 1
        pair.reader.unstage(slot, dst)
        assert pair.landed(src, dst)
    finally:
        pair.close()


def test_with_no_slot_of_its_own_a_post_goes_run_by_run_into_the_peers_slot():
    """Every slot of the writer's held: the post does not wait, it writes each run of blocks into
    the reader's slot, and the KV lands all the same."""
    pair = Pair(writer_slots=1)
    try:
        held = pair.writer.staging.acquire()
        src, dst = scattered(5), scattered(6)
        slot = pair.reader.reserve_staging(None, dst)
        tokens = pair.writer.write_staged(ReserveHandle("r", pair.rmeta.engine_id, dst, 10.0, staging=slot),
                                          [(layer, src, dst) for layer in range(LAYERS)])
        assert pair.wait(tokens) == ["done"]
        assert pair.writer.posts_direct == 1 and pair.writer.posts_gathered == 0
        pair.reader.unstage(slot, dst)
        assert pair.landed(src, dst)
        pair.writer.staging.release(held)
        assert pair.writer.staging.idle() == 1
    finally:
        pair.close()


def test_the_reader_gives_no_slot_to_blocks_in_one_run_a_request_larger_than_one_or_when_all_are_held():
    """Bounded: a lease gets a slot only where one is free and large enough, and only where its
    blocks are not one run already (else the per-block path); a lease that ends without its KV
    gives its slot back."""
    pair = Pair(reader_slots=2)
    try:
        assert pair.reader.reserve_staging(None, list(range(5, 5 + N))) is None  # one run: one descriptor a plane
        every = random.Random(0).sample(range(NUM_BLOCKS), NUM_BLOCKS)
        assert pair.reader.reserve_staging(None, every) is None  # 3 layers x 2 planes x 40 blocks x 256 B > 32 KiB
        a, b = pair.reader.reserve_staging(None, scattered(1)), pair.reader.reserve_staging(None, scattered(2))
        assert {a, b} == {0, 1} and pair.reader.reserve_staging(None, scattered(3)) is None
        assert pair.reader.staging.idle() == 0
        pair.reader.drop_staging(a)
        pair.reader.drop_staging(b)
        assert pair.reader.staging.idle() == 2 and pair.reader.slots_given == 2
    finally:
        pair.close()


def test_source_blocks_in_one_run_are_written_without_a_gather():
    """A post whose source blocks are one run (a fresh prefill cache) into a scattered lease: a
    descriptor per layer and plane, as a gather would give, and no slot of the writer's taken."""
    pair = Pair()
    try:
        src, dst = list(range(2, 2 + N)), scattered(11)
        slot = pair.reader.reserve_staging(None, dst)
        tokens = pair.writer.write_staged(ReserveHandle("r", pair.rmeta.engine_id, dst, 10.0, staging=slot),
                                          [(layer, src, dst) for layer in range(LAYERS)])
        assert pair.wait(tokens) == ["done"]
        assert pair.writer.posts_direct == 1 and pair.writer.posts_gathered == 0
        assert pair.writer.descriptor_count(tokens[0]) == LAYERS * 2  # one run a layer's plane, on both sides
        pair.reader.unstage(slot, dst)
        assert pair.landed(src, dst)
    finally:
        pair.close()


def test_a_released_write_gives_the_writers_slot_back():
    """An abort releases a post at once: once NIXL lets go of it, its slot is free again."""
    pair = Pair(writer_slots=1)
    try:
        src, dst = scattered(7), scattered(8)
        slot = pair.reader.reserve_staging(None, dst)
        [token] = pair.writer.write_staged(ReserveHandle("r", pair.rmeta.engine_id, dst, 10.0, staging=slot),
                                           [(0, src, dst)])
        assert pair.writer.posts_gathered == 1
        pair.writer.release(token)
        deadline = time.monotonic() + 5
        while not pair.writer.settled(token) and time.monotonic() < deadline:
            pair.reader.progress()
            time.sleep(0.001)
        assert pair.writer.settled(token) and pair.writer.staging.idle() == 1
        pair.reader.drop_staging(slot)
    finally:
        pair.close()


def test_a_post_that_does_not_fit_the_leases_slot_is_refused_by_name():
    pair = Pair()
    try:
        dst = scattered(9)
        handle = ReserveHandle("r", pair.rmeta.engine_id, list(range(NUM_BLOCKS)), 10.0, staging=0)
        with pytest.raises(ValueError, match="staging slot 0 of .* cannot hold 40 blocks"):
            pair.writer.write_staged(handle, [(0, dst, dst)])
        assert pair.writer.staging.idle() == 2
    finally:
        pair.close()
