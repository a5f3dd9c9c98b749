"""The contract between the connector ends and a KV backend (kvtransfer/backends/): a byte mover
that writes runs of blocks of some layers into a peer's KV allocation and carries small notices.
Leases, ordering and bookkeeping are the connector's.

A backend subclasses KVBackend and declares every capability (tests/test_kv_backend_contract.py
checks each backend). The ends read the capabilities, never probe for methods: an operation only
some backends have is a capability, and what a backend without it does is stated here, once.
"""

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.wire import ReserveHandle

# A backend's own handle of one post (an int, a Future, a CUDA event, None): opaque to the ends.
Token = Any

# (layer, source block ids, destination block ids): one layer's part of a post.
Part = tuple[int, list[int], list[int]]


@runtime_checkable
class KVBackend(Protocol):
    """What a connector end needs of a byte mover; a backend subclasses it for its defaults."""

    # -- capabilities: declared by every backend, read by the prefill end ------------------------

    # write_range only enqueues device work, ordered after the caller's stream, and never blocks:
    # the engine's thread posts it itself, without waiting for the layer's kernels on the host or
    # handing off to the posting thread.
    inline: ClassVar[bool]
    # wait(token) blocks (the GIL released) until a post is done: a completion thread delivers each
    # request the moment its copies end. Otherwise the posting thread polls state().
    waits: ClassVar[bool]

    # -- peers -----------------------------------------------------------------------------------

    def add_peer(self, peer: KVAgentMetadata) -> None:
        """Accept a handshaked peer's metadata (again after a restart: start afresh)."""
        ...

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer; its writes in flight read as failed from then on."""
        ...

    # -- leases (receiving side) -----------------------------------------------------------------

    def grant(self, peer_id: str | None, request_id: str, block_ids: list[int]) -> None:
        """The decode end opened a lease: `peer_id` (None: any handshaked peer) may write these
        blocks until revoke(request_id). A backend that sees each write (tcp) refuses the others;
        one whose peers write one-sided into registered memory (nixl, cuda_ipc) cannot, and ignores it."""

    def revoke(self, request_id: str) -> None:
        """The lease ended (KV arrived, or settled): its blocks take no more writes."""

    # -- writes ----------------------------------------------------------------------------------

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> Token:
        """Post one layer's planes from src_blocks into the peer's dst_blocks; returns at once."""
        ...

    def write_layers(self, peer_id: str, parts: list[Part]) -> list[Token]:
        """Post several layers; returns the tokens of the posts made (as few as the backend can)."""
        return [self.write(peer_id, *p) for p in parts]

    def write_range(self, peer_id: str, first_layer: int, num_layers: int, src_blocks: list[int],
                    dst_blocks: list[int]) -> Token:
        """Post layers [first_layer, first_layer + num_layers) of the same blocks as one, on the
        caller's thread, after the work its stream has queued: only where `inline`."""
        raise NotImplementedError(f"{type(self).__name__} does not post inline")

    # -- staging (kvtransfer/staging.py): a backend that can move a request's KV through slots --

    def reserve_staging(self, peer_id: str | None, block_ids: list[int]) -> int | None:
        """Decode end: a slot that takes every layer of a lease's blocks from peer_id (None:
        whichever peer the lease names later), or None: the per-block path.
        The default stages nothing, so the three below are only ever called on a backend that did."""
        return None

    def write_staged(self, handle: ReserveHandle, parts: list[Part]) -> list[Token]:
        """Prefill end: post parts into the handle's staging slot on the decode end."""
        raise NotImplementedError(f"{type(self).__name__} does not stage")

    def unstage(self, slot: int, block_ids: list[int]) -> None:
        """Decode end, every write landed: unpack the slot into the lease's blocks (ordered before
        the caller's later device work) and free it."""
        raise NotImplementedError(f"{type(self).__name__} does not stage")

    def drop_staging(self, slot: int) -> None:
        """Decode end, the lease ended without its KV and no write can land any more: free the slot."""
        raise NotImplementedError(f"{type(self).__name__} does not stage")

    def state(self, token: Token) -> str:
        """'done' | 'pending' | 'failed' of a post."""
        ...

    def wait(self, token: Token) -> bool:
        """Block until a post is done; True when it landed: only where `waits`."""
        raise NotImplementedError(f"{type(self).__name__} cannot block on a post")

    def release(self, token: Token) -> None:
        """Let go of a post (one still in flight is cancelled where the transport can)."""
        ...

    def settled(self, token: Token) -> bool:
        """No write of this released post can land in the peer's blocks any more: at once unless
        the backend says otherwise (a copy it could not cancel)."""
        return True

    # -- notices ---------------------------------------------------------------------------------

    def notify(self, peer_id: str, payload: bytes) -> None:
        """Send a small message to a peer; raises where the peer cannot be told."""
        ...

    def notifications(self) -> list[bytes]:
        """Every notice received since the last call, from any peer."""
        ...

    def progress(self) -> None:
        """Drive the transport while waiting for a peer's writes (where no thread of its own does)."""
        ...

    def refusals(self) -> dict[str, Mapping[str, int]]:
        """What the backend's own endpoints refused so far, by endpoint and why (pdserve/refusals.py):
        the worker's stats carry it to the routers' /metrics. None by default."""
        return {}

    def close(self) -> None:
        """Stop, letting go of peers and memory; idempotent."""
        ...
