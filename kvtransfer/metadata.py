"""The handshake: what a worker publishes about its KV allocation, and the check a peer must pass.

KVAgentMetadata (msgpack) carries the engine id, the backend and what it offers, the model
fingerprint, the layout (K/V or MLA's latent, planes, heads, dim), the cache dtype and an FP8
cache's scales, the block geometry, the base address, the worker's host, and a proof of the
cluster token: an HMAC under it of every other field, among them the time it was packed and a
nonce (the token itself never travels). `accept_peer` checks a peer's record in this order: it
proves our cluster's token, it is fresh and not seen before (`Replays`: a record captured and sent
again is refused), a backend can work between the two (pairing.py), the KV's shape matches
(`check_peer`); each refusal names what differs.

A record is packed afresh for each handshake (the connectors' metadata(), which the controller
asks each time it pairs), so a replay window bounds only how long one may take."""

import dataclasses
import hashlib
import hmac
import secrets
import time
from dataclasses import asdict, dataclass, field

import msgpack
import torch


class HandshakeError(ValueError):
    """A peer's KV cache cannot be exchanged with ours; the message names every mismatch."""


@dataclass
class KVAgentMetadata:
    engine_id: str  # unique per worker; also the NIXL agent name
    backend: str  # "nixl" | "tcp" | "cuda_ipc"
    fingerprint: str  # model identity: architecture, shapes, weights, dtype
    kv_cache_dtype: str  # what the cache stores: the model's dtype, or "float8_e4m3fn"
    layout: str  # dimension order of the allocation, naming what its planes hold (KVLayout.dims)
    num_layers: int
    num_planes: int  # 2 (K, V) or 1 (MLA's latent)
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_block: int  # one block of one layer's plane (K, V or latent)
    base_addr: int  # address of the allocation's first byte
    device: str  # "cpu" or "cuda:N"
    agent_metadata: bytes = b""  # NIXL: the agent's metadata blob; cuda_ipc: the allocation's IPC handle
    address: str = ""  # where notices (and TCP data) go: "host:port", or "unix:@name" on one host
    # An FP8 cache's scales, per layer and plane (KVLayout.scales): both ends must read the bytes alike.
    kv_scales: list[list[float]] = field(default_factory=list)
    host: str = ""  # the worker's node (its Ray node address): which pairs share a host (cuda_ipc)
    cluster_proof: str = ""  # cluster_proof(token, the other fields): names the cluster without showing its token
    issued_at: float = 0.0  # when it was packed (wall clock: the two ends run on different hosts)
    nonce: str = ""  # fresh in each packing: the same record accepted twice is a replay
    # backend "auto": every backend this worker offers -> {"agent_metadata", "address"} of its own;
    # a pair agrees on one at the handshake (kvtransfer/pairing.py).
    offers: dict = field(default_factory=dict)
    # NIXL: the registered staging slots (kvtransfer/staging.py) a peer writes a request's KV into.
    staging_addr: int = 0
    staging_slots: int = 0
    staging_slot_bytes: int = 0

    @classmethod
    def for_cache(cls, engine_id: str, backend: str, kv_cache: torch.Tensor, layout, fingerprint: str,
                  host: str = "") -> "KVAgentMetadata":
        """Describe an engine's KV allocation (`layout` is its pdserve.forward.kv_cache.KVLayout) on `host`."""
        assert kv_cache.is_contiguous() and tuple(kv_cache.shape) == layout.shape
        assert kv_cache.dtype == layout.dtype
        return cls(engine_id, backend, fingerprint, str(layout.dtype).removeprefix("torch."), layout.dims,
                   layout.num_layers, layout.num_planes, layout.num_blocks, layout.block_size,
                   layout.num_kv_heads, layout.head_dim, layout.bytes_per_block, kv_cache.data_ptr(),
                   str(kv_cache.device), kv_scales=[list(s) for s in layout.scales], host=host)

    def pack(self, token: str | None = None) -> bytes:
        """The record as published for one handshake: stamped now with a fresh nonce, and proven
        under the cluster token `token`."""
        fields = {**asdict(self), "issued_at": time.time(), "nonce": secrets.token_hex(16)}
        fields["cluster_proof"] = cluster_proof(token, fields)
        return msgpack.packb(fields)

    @classmethod
    def unpack(cls, data: bytes) -> "KVAgentMetadata":
        """A peer's metadata; one from another pdserve version (fields missing or unknown) is refused
        by name, as a mismatch is."""
        fields = msgpack.unpackb(data)
        names = set(cls.__dataclass_fields__)
        required = {n for n, f in cls.__dataclass_fields__.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, unknown = sorted(required - set(fields)), sorted(set(fields) - names)
        if missing or unknown:
            peer = fields.get("engine_id", "?")
            raise HandshakeError(f"KV handshake refused — peer {peer!r} speaks another pdserve version's "
                                 f"metadata (missing: {', '.join(missing) or 'none'}; unknown: "
                                 f"{', '.join(unknown) or 'none'}): run one pdserve version on every worker")
        return cls(**fields)

    def offset(self, layer: int, plane: int, block: int) -> int:
        """Byte offset of (layer, plane — K or V, or the latent —, block) from base_addr."""
        return ((layer * self.num_planes + plane) * self.num_blocks + block) * self.bytes_per_block


def cluster_proof(token: str | None, fields: dict) -> str:
    """What a worker publishes to show its record comes from the cluster of `token` unchanged: an
    HMAC over every field but the proof (sorted by name: both ends encode the same bytes). No token
    (a connector built outside a cluster): the empty key."""
    body = msgpack.packb(sorted((k, v) for k, v in fields.items() if k != "cluster_proof"))
    return hmac.new((token or "").encode(), b"pdserve-kv-meta:" + body, hashlib.sha256).hexdigest()


def check_cluster(token: str | None, remote: KVAgentMetadata) -> None:
    """Refuse a peer whose record does not prove our cluster's token (or was changed on its way)."""
    if not hmac.compare_digest(remote.cluster_proof, cluster_proof(token, asdict(remote))):
        raise HandshakeError(f"KV handshake refused — peer {remote.engine_id!r} (host {remote.host or '?'}) "
                             f"belongs to another cluster: its cluster token differs from ours "
                             f"(PDSERVE_CLUSTER_TOKEN, or the one `pdserve up` generated)")


class Replays:
    """The records a connector has accepted lately: one older than WINDOW_S, or seen already, is a
    replay and refused. The window is wide for clocks of different hosts (NTP keeps them within
    far less) and for a handshake's calls (each under a 60 s deadline)."""

    WINDOW_S = 300.0

    def __init__(self):
        self._seen: dict[str, float] = {}  # nonce -> issued_at, of records within the window

    def check(self, remote: KVAgentMetadata) -> None:
        now = time.time()
        age = now - remote.issued_at
        if abs(age) > self.WINDOW_S:
            raise HandshakeError(f"KV handshake refused — peer {remote.engine_id!r}'s record was packed {age:.0f} s "
                                 f"ago (more than {self.WINDOW_S:g} s either way): a replay, or clocks that disagree")
        if remote.nonce in self._seen:
            raise HandshakeError(f"KV handshake refused — peer {remote.engine_id!r}'s record was accepted once "
                                 f"already: a replay (each handshake packs a fresh one)")
        for nonce, at in list(self._seen.items()):  # (a handful: one per peer and window)
            if now - at > self.WINDOW_S:
                del self._seen[nonce]
        self._seen[remote.nonce] = remote.issued_at


def check_peer(local: KVAgentMetadata, remote: KVAgentMetadata) -> None:
    """Refuse a peer whose KV blocks do not mean the same bytes as ours (the layout first: a latent
    cache and a K/V cache never exchange blocks). Which backend the pair uses, and whether one can
    work at all, is pairing.choose_backend's."""
    fields = ["layout", "fingerprint", "kv_cache_dtype", "kv_scales", "block_size", "num_layers", "num_planes",
              "num_kv_heads", "head_dim", "bytes_per_block"]
    if local.kv_cache_dtype != remote.kv_cache_dtype:
        fields.remove("kv_scales")  # scales of two dtypes: the dtype says it
    bad = [f"{f}: ours {getattr(local, f)!r}, peer {remote.engine_id!r} has {getattr(remote, f)!r}"
           for f in fields if getattr(local, f) != getattr(remote, f)]
    if bad:
        raise HandshakeError("KV handshake refused — " + "; ".join(bad))


def accept_peer(local: KVAgentMetadata, data: bytes, token: str | None = None,
                replays: Replays | None = None) -> KVAgentMetadata:
    """A peer's published metadata (msgpack), refused with HandshakeError where it is of another
    cluster (`token`), a replay (of those `replays` saw), its KV does not match ours, or no backend
    can move KV between us."""
    from pdserve.kvtransfer.pairing import choose_backend

    peer = KVAgentMetadata.unpack(data)
    check_cluster(token, peer)
    (replays or Replays()).check(peer)
    choose_backend(local, peer)
    check_peer(local, peer)
    return peer
