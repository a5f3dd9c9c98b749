"""The block pool: contiguous runs, ref counts, prefix cache with LRU eviction, no leaks."""

import hashlib
import random
from array import array

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocksError, block_hashes


def test_fresh_pool_hands_out_one_run():
    pool = BlockPool(64)
    assert pool.allocate(10) == list(range(10))
    assert pool.allocate(5) == list(range(10, 15))
    assert pool.num_free_blocks == 49


def test_allocation_continues_the_previous_run():
    pool = BlockPool(64)
    a = pool.allocate(4)
    b = pool.allocate(4)
    pool.free(b)  # blocks 4..7 free again, right after a's last block
    assert pool.allocate(2, after=a[-1]) == [4, 5]


def test_fragmented_pool_prefers_a_run_that_fits():
    pool = BlockPool(16)
    blocks = pool.allocate(16)
    pool.free([blocks[i] for i in (0, 2, 3, 8, 9, 10, 11)])  # runs: [0], [2,3], [8..11]
    assert pool.allocate(3) == [8, 9, 10]
    # No single run of 3 is left ([0], [2,3], [11]): longest runs first.
    got = pool.allocate(3)
    assert sorted(got) == [2, 3, 11] or sorted(got) == [0, 2, 3]
    assert pool.num_free_blocks == 1


def test_exhaustion_raises_and_takes_nothing():
    pool = BlockPool(8)
    pool.allocate(6)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_caught():
    pool = BlockPool(4)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(b)


def test_prefix_cache_hit_shares_blocks_and_survives_free():
    pool = BlockPool(16)
    tokens = list(range(40))  # two full blocks of 16, then 8 tokens
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes):
        pool.register(b, h)
    assert pool.lookup(hashes) == blocks[:2]  # a second user takes references
    assert pool.ref_counts[blocks[0]] == 2
    pool.free(blocks)
    pool.free(blocks[:2])
    assert pool.num_free_blocks == 16  # cached blocks still count as free
    assert pool.lookup(hashes) == blocks[:2]  # and still hit after their users left
    pool.free(blocks[:2])


def test_different_prefix_misses():
    pool = BlockPool(8)
    a = block_hashes([1] * 32, 16)
    b = block_hashes([1] * 16 + [2] * 16, 16)
    assert a[0] == b[0] and a[1] != b[1]
    blocks = pool.allocate(2)
    for blk, h in zip(blocks, a):
        pool.register(blk, h)
    pool.free(blocks)
    assert pool.lookup(b) == blocks[:1]
    pool.free(blocks[:1])


def test_prefix_keys_are_sha256_digests_that_tell_apart_what_pythons_hash_confuses():
    """Python's hash() of an int is the int modulo 2**61 - 1, so a key built from hash((parent,
    tokens)) is the same for these two blocks; a sha256 over the token ids themselves is not, and a
    prompt is never served another prompt's KV."""
    a = [0] * 16
    b = [2**61 - 1] + [0] * 15
    assert hash((None, tuple(a))) == hash((None, tuple(b)))  # the old key: one entry for both
    ka, kb = block_hashes(a + a, 16), block_hashes(b + a, 16)
    assert ka[0] != kb[0] and ka[1] != kb[1]  # a child's key carries its parent's
    first = hashlib.sha256(bytes(32) + array("q", a).tobytes()).digest()
    assert ka == [first, hashlib.sha256(first + array("q", a).tobytes()).digest()]
    assert block_hashes(list(a + a), 16) == ka  # equal prefixes: equal keys
    pool = BlockPool(8)
    blocks = pool.allocate(2)
    for blk, h in zip(blocks, ka):
        pool.register(blk, h)
    pool.free(blocks)
    assert pool.lookup(kb) == []
    assert pool.lookup(ka) == blocks  # still there for the prompt that wrote it
    pool.free(blocks)


def test_eviction_is_lru_and_only_when_plain_blocks_run_out():
    pool = BlockPool(4)
    old = pool.allocate(2)
    pool.register(old[0], 111)
    pool.register(old[1], 222)
    pool.free([old[0]])
    pool.free([old[1]])  # 222 is the most recently used
    got = pool.allocate(2)
    assert got == [2, 3]  # plain free blocks first; the cache is kept
    assert 111 in pool.cached and 222 in pool.cached
    pool.allocate(1)  # evicts the least recently used cached block
    assert 111 not in pool.cached and 222 in pool.cached


def test_random_workload_returns_to_idle():
    rng = random.Random(0)
    pool = BlockPool(128)
    held: list[list[int]] = []
    for step in range(2000):
        if held and (rng.random() < 0.45 or pool.num_free_blocks < 10):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            blocks = pool.allocate(rng.randint(1, 9))
            if rng.random() < 0.3:
                pool.register(blocks[0], rng.randrange(50))
            hits = pool.lookup([rng.randrange(50)])
            held.append(blocks + hits)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == 128
    assert all(r == 0 for r in pool.ref_counts)
    pool.reset_prefix_cache()
    assert pool._run_starts == [0] and pool._run_lengths == [128]  # runs merged back into one
