"""The prefill end of a KV transfer: the engine's thread queues layers and finishes requests here.

send_layer(...) / send_layers(...) (return at once), finish(request, first_token, first_logprob);
poll() -> (done, failed); release(). The blocks belong to the engine: the connector says when they
may be freed (done / failed), it never frees them. Posting is poster.py's, the requests' bookkeeping
transfers.py's.
"""

import queue
import time

import torch

from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.wire import FirstLogprob, ReserveHandle
from pdserve.kvtransfer.metadata import KVAgentMetadata, Replays, accept_peer
from pdserve.kvtransfer.pairing import choose_backend
from pdserve.kvtransfer.ops import Finish, PostLayers, Release
from pdserve.kvtransfer.poster import CompletionThread, InlinePoster, PostThread
from pdserve.kvtransfer.transfers import Outcomes, Transfers


class PrefillConnector:
    def __init__(self, backend: KVBackend, meta: KVAgentMetadata, cluster_token: str | None = None):
        self.backend = backend
        self.meta = meta
        self.cluster_token = cluster_token
        self.peers: dict[str, KVAgentMetadata] = {}
        self.pairs: dict[str, dict] = {}  # peer -> the handshake's record: backend chosen, why
        self._replays = Replays()  # peers' records accepted lately
        self._outcomes = Outcomes()
        # A backend that can block until a post is done gets a completion thread, so delivery is
        # noticed at once rather than at the next poll.
        waits = queue.SimpleQueue() if backend.waits else None
        self._transfers = Transfers(backend, meta.engine_id, self._outcomes, waits, cluster_token)
        self.dropped = self._transfers.seal.dropped  # notices dropped unread, by why (NoticeSeal)
        self._post = PostThread(backend, self._transfers, name=f"kv-post-{meta.engine_id}")
        # A backend that posts on the caller's thread (device-ordered, never blocking) skips the
        # hand-off to the posting thread.
        self._inline = None
        if backend.inline:
            self._inline = InlinePoster(backend, self._transfers, self._post)
        self._completion = None
        if waits is not None:
            self._completion = CompletionThread(backend, self._transfers, self._post, waits,
                                                name=f"kv-done-{meta.engine_id}")

    @property
    def error(self) -> BaseException | None:
        """Why this end can move no KV any more (its posting or completion thread died), else None:
        every transfer fails then, and the worker reports itself down."""
        return self._post.error or (self._completion.error if self._completion is not None else None)

    def metadata(self) -> bytes:
        """What this end publishes for the handshake (msgpack)."""
        return self.meta.pack(self.cluster_token)

    def add_peer(self, data: bytes) -> str:
        """Handshake with a decode worker; raises HandshakeError on any mismatch."""
        peer = accept_peer(self.meta, data, self.cluster_token, self._replays)
        self._post.call(lambda: self.backend.add_peer(peer))
        self.peers[peer.engine_id] = peer
        self.pairs[peer.engine_id] = choose_backend(self.meta, peer).record(self.meta, peer)
        return peer.engine_id

    def send_layer(self, request_id: str, layer: int, src_blocks: list[int], handle: ReserveHandle,
                   first: int = 0) -> None:
        """Queue one layer's KV of the request's blocks [first, first + len(src_blocks)) for writing
        into the decode blocks the handle has for them (past its cached ones); returns at once."""
        self.send_layers(request_id, layer, 1, src_blocks, handle, first)

    def send_layers(self, request_id: str, first_layer: int, num_layers: int, src_blocks: list[int],
                    handle: ReserveHandle, first: int = 0) -> None:
        """send_layer for the layers [first_layer, first_layer + num_layers) at once: KV that is
        complete already (a whole request, a cached prefix) moves as one post."""
        dst = handle.destination(first, len(src_blocks))
        src = list(src_blocks)
        nbytes = self.meta.num_planes * len(src) * num_layers * self.meta.bytes_per_block
        if self._inline is not None:
            self._inline.post(request_id, first_layer, num_layers, src, dst, handle, nbytes)
            return
        ready = None
        if self.meta.device.startswith("cuda"):
            # The layer's KV is written by kernels still in flight: post only once they finish.
            ready = torch.cuda.Event()
            ready.record()
        parts = [(layer, src, dst) for layer in range(first_layer, first_layer + num_layers)]
        self._post.put(PostLayers(request_id, parts, handle, ready, nbytes, time.monotonic()))

    def finish(self, request_id: str, first_token: int, first_logprob: FirstLogprob | None = None) -> None:
        """Every layer is queued: once all have landed, tell the decode worker (with the first token,
        and its logprob where the request asked for logprobs)."""
        self._forget(request_id)
        self._post.put(Finish(request_id, first_token, first_logprob))

    def poll(self) -> tuple[list[str], list[str]]:
        """Requests whose KV was delivered (source blocks may be freed), and ones that failed."""
        return self._outcomes.take()

    def delivered(self) -> list[tuple[int, float]]:
        """(KV bytes, seconds from first post to delivered) of each request delivered since the last call."""
        return self._outcomes.take_delivered()

    def wait(self, timeout: float) -> None:
        """Block (GIL released) until poll() has something or timeout seconds pass.

        A caller with nothing else to do waits here instead of spinning on poll(): a spinning
        thread holds the GIL, and the posting thread would get it only every switch interval (5 ms).
        """
        self._outcomes.wait(timeout)

    def release(self, request_id: str, handle: ReserveHandle | None = None) -> None:
        """Abort a transfer from this side; the decode worker is told (pass the handle in case
        no layer was sent yet)."""
        self._forget(request_id)
        self._post.put(Release(request_id, handle))

    def close(self) -> None:
        self._post.stop()
        if self._completion is not None:
            self._completion.close()
        self._post.join()
        self.backend.close()

    def _forget(self, request_id: str) -> None:
        if self._inline is not None:
            self._inline.forget(request_id)
