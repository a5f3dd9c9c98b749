"""Byte movers behind the connector: nixl, tcp, cuda_ipc, and auto (one of them per peer). Each is
a KVBackend (kvtransfer/backend.py), the contract the connector ends rely on."""

from pdserve.kvtransfer.backend import KVBackend


def make_backend(name: str, meta, kv_cache, **kw) -> KVBackend:
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
