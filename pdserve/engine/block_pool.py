"""The KV block pool: ref-counted blocks, contiguous runs where it can, and a prefix cache.

Free blocks are kept as sorted runs of consecutive ids so that a request gets one run (one
contiguous region per layer, one transfer descriptor) whenever the pool has one. A block whose
content is a full, hashed block of some prompt stays in the prefix cache after its last user
leaves; such blocks are evicted least-recently-used first, only when no plain free block is left.
"""

import hashlib
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence as Seq

from pdserve.engine.kv_events import KVEventLog


class NoFreeBlocksError(RuntimeError):
    pass


ROOT = bytes(32)  # the parent key of a prompt's first block


def hash_block(parent: bytes | None, tokens: bytes) -> bytes:
    """A full block's key: sha256 of its parent's key (ROOT for the first block) and its token ids
    (int64, as block_hashes encodes them). Equal keys mean equal prefixes: a cryptographic hash
    over an exact encoding, where Python's hash() of a tuple collides (hash(2**61 - 1) == hash(0))
    and a crafted prompt could be served another's KV (vLLM's CVE-2025-25183)."""
    return hashlib.sha256((parent or ROOT) + tokens).digest()


def salt_root(cache_salt: str | None) -> bytes | None:
    """The parent key of a salted prompt's first block (None: unsalted, ROOT): a different salt
    starts a different chain, so no block of one salt's prompt is found under another's."""
    if not cache_salt:
        return None
    return hashlib.sha256(b"pdserve-cache-salt\0" + cache_salt.encode()).digest()


def block_hashes(token_ids: Seq[int], block_size: int, parent: bytes | None = None, start: int = 0) -> list[bytes]:
    """Hash chain over the full blocks of token_ids, starting at block index `start`."""
    # Encoded once, sliced per block: a block then costs little beside its sha256.
    ids = array("q", token_ids[start * block_size:len(token_ids) // block_size * block_size])
    raw, step = ids.tobytes(), block_size * ids.itemsize
    out = []
    for i in range(0, len(raw), step):
        parent = hash_block(parent, raw[i:i + step])
        out.append(parent)
    return out


class HashChain(Seq[bytes]):
    """block_hashes(token_ids, block_size, parent), each computed when first read: a walk that stops
    at the first block no cache holds (a fresh prompt's: at its first) hashes that far only, and the
    rest can wait until the prompt is on its way (`complete`). Reads as the list would."""

    __slots__ = ("_ids", "_block_size", "_root", "_done", "_len")

    def __init__(self, token_ids: Seq[int], block_size: int, parent: bytes | None = None):
        self._ids: Seq[int] | None = token_ids
        self._block_size, self._root = block_size, parent
        self._done: list[bytes] = []
        self._len = len(token_ids) // block_size

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.complete()[i]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("block index out of range")
        self._upto(i + 1)
        return self._done[i]

    def __iter__(self):
        for i in range(self._len):
            if i >= len(self._done):
                self._upto(i + 1)
            yield self._done[i]

    @property
    def is_complete(self) -> bool:
        return len(self._done) == self._len

    def complete(self) -> list[bytes]:
        """Every block's hash (computed now where not yet)."""
        self._upto(self._len)
        return self._done

    def prefix(self, n: int) -> list[bytes]:
        """The first n blocks' hashes (computed now where not yet), a list of its own."""
        self._upto(n)
        return self._done[:n]

    def _upto(self, n: int) -> None:
        done = len(self._done)
        if n <= done:
            return
        parent = self._done[-1] if done else self._root
        self._done += block_hashes(self._ids[:n * self._block_size], self._block_size, parent, start=done)
        if len(self._done) == self._len:
            self._ids = None  # (the tokens are not needed any more)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id holding that content
        # Free blocks that hold no cached content, as runs: run i is [starts[i], starts[i] + lengths[i]).
        self._run_starts: list[int] = [0]
        self._run_lengths: list[int] = [num_blocks]
        self._num_plain_free = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, still cached; LRU first
        # What the prefix cache stores and removes, for routers (a replica's worker sets it).
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (plain free plus evictable cached ones)."""
        return self._num_plain_free + len(self._evictable)

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take n blocks, preferring the run that continues block `after`, then one run that fits."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        out: list[int] = []
        if n == 0:
            return out
        i = self._run_index(after + 1) if after is not None else None
        if i is None:
            i = next((j for j, length in enumerate(self._run_lengths) if length >= n), None)
        while len(out) < n and self._run_starts:
            if i is None:  # no single run fits: take the longest runs first, fewest pieces
                i = max(range(len(self._run_lengths)), key=self._run_lengths.__getitem__)
            out.extend(self._take_from_run(i, n - len(out)))
            i = None
        while len(out) < n:
            out.append(self._evict_one())
        for b in out:
            assert self.ref_counts[b] == 0
            self.ref_counts[b] = 1
        return out

    def free(self, block_ids: Seq[int]) -> None:
        """Drop one reference to each block; tail blocks first so they are evicted first."""
        for b in reversed(block_ids):
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._insert_free(b)

    # -- prefix cache -------------------------------------------------------------------------

    def lookup(self, hashes: Seq[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of this hash chain; takes a reference to each."""
        if not self.enable_prefix_cache:
            return []
        hits = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        for b in hits:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
        return hits

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that block_id now holds the full block with this hash."""
        if not self.enable_prefix_cache or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:  # the same content already lives in another block
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request uses."""
        while self._evictable:
            self._insert_free(self._evict_one())

    # -- internals ----------------------------------------------------------------------------

    def _evict_one(self) -> int:
        b, _ = self._evictable.popitem(last=False)
        del self.cached[self.block_hash[b]]
        if self.events is not None:
            self.events.removed(self.block_hash[b])
        self.block_hash[b] = None
        return b

    def _run_index(self, start: int) -> int | None:
        i = bisect_left(self._run_starts, start)
        return i if i < len(self._run_starts) and self._run_starts[i] == start else None

    def _take_from_run(self, i: int, n: int) -> list[int]:
        start, length = self._run_starts[i], self._run_lengths[i]
        k = min(n, length)
        if k == length:
            del self._run_starts[i], self._run_lengths[i]
        else:
            self._run_starts[i] += k
            self._run_lengths[i] -= k
        self._num_plain_free -= k
        return list(range(start, start + k))

    def _insert_free(self, b: int) -> None:
        starts, lengths = self._run_starts, self._run_lengths
        i = bisect_left(starts, b)
        joins_left = i > 0 and starts[i - 1] + lengths[i - 1] == b
        joins_right = i < len(starts) and starts[i] == b + 1
        if joins_left and joins_right:
            lengths[i - 1] += 1 + lengths[i]
            del starts[i], lengths[i]
        elif joins_left:
            lengths[i - 1] += 1
        elif joins_right:
            starts[i] = b
            lengths[i] += 1
        else:
            starts.insert(i, b)
            lengths.insert(i, 1)
        self._num_plain_free += 1
