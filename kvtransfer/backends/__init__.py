"""Byte movers behind the connector. A backend writes runs of blocks of one layer into a peer's
KV allocation and carries small notices; leases, ordering and bookkeeping are the connector's.

Every backend offers:
    add_peer(meta) / remove_peer(engine_id)
    write(peer_id, layer, src_blocks, dst_blocks) -> token     # posts, returns at once
    state(token) -> "done" | "pending" | "failed";  release(token)
    settled(token) -> bool   # optional: a released write can no longer land (absent: at once)
    notify(peer_id, payload: bytes);  notifications() -> list[bytes]
    progress()    # drive the transport while waiting for a peer's writes (NIXL has no thread for it)
    close()
"""


def make_backend(name: str, meta, kv_cache, **kw):
    """Create backend `name` for this KV allocation; fills meta's backend-specific fields."""
    if name == "nixl":
        from pdserve.kvtransfer.backends.nixl import NixlBackend
        return NixlBackend(meta, kv_cache, **kw)
    if name == "tcp":
        from pdserve.kvtransfer.backends.tcp import TcpBackend
        return TcpBackend(meta, kv_cache, **kw)
    if name == "cuda_ipc":
        from pdserve.kvtransfer.backends.cuda_ipc import CudaIpcBackend
        return CudaIpcBackend(meta, kv_cache, **kw)
    if name == "auto":
        from pdserve.kvtransfer.backends.auto import AutoBackend
        return AutoBackend(meta, kv_cache, **kw)
    raise ValueError(f"kv_transfer.backend: must be 'nixl', 'tcp', 'cuda_ipc' or 'auto', got {name!r}")
