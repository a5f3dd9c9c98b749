"""kv_transfer.backend "auto": every backend this worker can run, side by side, and per peer the
one the pair agreed on at the handshake (kvtransfer/pairing.py).

Each backend is built over the same KV allocation and publishes its own blob and address in
`meta.offers`; a peer is added to the chosen one only, seen as that backend's peer (its blob and
address for that backend). Writes and notices go through the peer's backend; notices are read
from all of them.

Posting goes through the connector's posting thread for every pair — cuda_ipc's too, whose copy
is then ordered by the layer's CUDA event on the host rather than on the device: the explicit
`cuda_ipc` backend, which posts inline, is the one for a cluster of one GPU host.
"""

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.kvtransfer.backend import KVBackend, Part
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.backends.nixl_find import nixl_module
from pdserve.kvtransfer.pairing import choose_backend


def available(kv_cache: torch.Tensor) -> list[str]:
    """What this worker can offer: cuda_ipc on a GPU, nixl where it is installed, tcp always."""
    names = ["cuda_ipc"] if kv_cache.is_cuda else []
    if nixl_module() is not None:
        names.append("nixl")
    return names + ["tcp"]


@dataclass
class _Token:
    backend: str
    tokens: list  # the backend's own tokens of one post


class AutoBackend(KVBackend):
    inline = False  # cuda_ipc's posts too go through the posting thread (see above)
    waits = False  # the posting thread polls state(), whichever backend a peer has

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1",
                 cluster_token: str | None = None, offer: list[str] | None = None,
                 staging_slots: int = 4, staging_slot_mb: float = 64.0):
        from pdserve.kvtransfer.backends import make_backend

        self.meta = meta
        self._device = kv_cache.device
        self.backends: dict[str, KVBackend] = {}
        try:
            for name in offer or available(kv_cache):
                own = dataclasses.replace(meta, backend=name, offers={})
                kw = ({"host": host, "cluster_token": cluster_token} if name == "tcp" else
                      {"staging_slots": staging_slots, "staging_slot_mb": staging_slot_mb} if name == "nixl" else {})
                self.backends[name] = make_backend(name, own, kv_cache, **kw)
                meta.offers[name] = {"agent_metadata": own.agent_metadata, "address": own.address,
                                     "staging": [own.staging_addr, own.staging_slots, own.staging_slot_bytes]}
        except BaseException:
            self.close()
            raise
        self._route: dict[str, str] = {}  # peer -> its backend
        self._staged: dict[int, str] = {}  # staging slot -> the backend that gave it

    def add_peer(self, peer: KVAgentMetadata) -> None:
        name = choose_backend(self.meta, peer).backend
        if peer.backend == "auto":  # the peer as that backend sees its peers
            offer = peer.offers[name]
            addr, slots, slot_bytes = offer.get("staging", (0, 0, 0))
            peer = dataclasses.replace(peer, backend=name, agent_metadata=offer["agent_metadata"],
                                       address=offer["address"], offers={}, staging_addr=addr,
                                       staging_slots=slots, staging_slot_bytes=slot_bytes)
        old = self._route.get(peer.engine_id)
        if old is not None and old != name:
            self.backends[old].remove_peer(peer.engine_id)
        self.backends[name].add_peer(peer)
        self._route[peer.engine_id] = name

    def remove_peer(self, engine_id: str) -> None:
        name = self._route.pop(engine_id, None)
        if name is not None:
            self.backends[name].remove_peer(engine_id)

    def grant(self, peer_id: str | None, request_id: str, block_ids: list[int]) -> None:
        for be in self.backends.values():  # (a peer's writes come through its backend only)
            be.grant(peer_id, request_id, block_ids)

    def revoke(self, request_id: str) -> None:
        for be in self.backends.values():
            be.revoke(request_id)

    def write_layers(self, peer_id: str, parts: list[Part]) -> list[_Token]:
        """One token of all the posts the peer's backend made."""
        name = self._route[peer_id]
        be = self.backends[name]
        if name == "cuda_ipc":  # on the posting thread, whose current device need not be the cache's
            with torch.cuda.device(self._device):
                return [_Token(name, be.write_layers(peer_id, parts))]
        return [_Token(name, be.write_layers(peer_id, parts))]

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> _Token:
        return self.write_layers(peer_id, [(layer, src_blocks, dst_blocks)])[0]

    def reserve_staging(self, peer_id: str | None, block_ids: list[int]) -> int | None:
        """A slot of the peer's backend (none for a peer not named: its backend is not known yet)."""
        name = self._route.get(peer_id)
        if name is None:
            return None
        slot = self.backends[name].reserve_staging(peer_id, block_ids)
        if slot is not None:
            assert slot not in self._staged, "two backends stage: slots must be told apart"
            self._staged[slot] = name
        return slot

    def write_staged(self, handle, parts: list[Part]) -> list[_Token]:
        name = self._route[handle.engine_id]
        return [_Token(name, self.backends[name].write_staged(handle, parts))]

    def unstage(self, slot: int, block_ids: list[int]) -> None:
        self.backends[self._staged.pop(slot)].unstage(slot, block_ids)

    def drop_staging(self, slot: int) -> None:
        self.backends[self._staged.pop(slot)].drop_staging(slot)

    def state(self, token: _Token) -> str:
        states = [self.backends[token.backend].state(t) for t in token.tokens]
        return "failed" if "failed" in states else "pending" if "pending" in states else "done"

    def release(self, token: _Token) -> None:
        for t in token.tokens:
            self.backends[token.backend].release(t)

    def settled(self, token: _Token) -> bool:
        be = self.backends[token.backend]
        return all(be.settled(t) for t in token.tokens)

    def notify(self, peer_id: str, payload: bytes) -> None:
        self.backends[self._route[peer_id]].notify(peer_id, payload)

    def notifications(self) -> list[bytes]:
        return [n for be in self.backends.values() for n in be.notifications()]

    def progress(self) -> None:
        for be in self.backends.values():
            be.progress()

    def refusals(self) -> dict:
        return {endpoint: counts for be in self.backends.values() for endpoint, counts in be.refusals().items()}

    def close(self) -> None:
        for be in self.backends.values():
            be.close()
