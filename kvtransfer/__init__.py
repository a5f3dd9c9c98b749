"""KV transfer: the connector API (handshake, decode end, prefill end) and its backends (NIXL, TCP, CUDA IPC)."""

from pdserve.kvtransfer.decode_end import DecodeConnector, DecodePoll, Finished
from pdserve.kvtransfer.wire import ReserveHandle
from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata
from pdserve.kvtransfer.prefill_end import PrefillConnector

__all__ = ["DecodeConnector", "DecodePoll", "Finished", "HandshakeError", "KVAgentMetadata",
           "PrefillConnector", "ReserveHandle", "make_connector"]


def make_connector(role: str, backend: str, engine_id: str, kv_cache, layout, fingerprint: str,
                   host: str = "", cluster_token: str | None = None, **kw):
    """A connector of `role` ('prefill' or 'decode') over `backend` ('nixl', 'tcp', 'cuda_ipc' or
    'auto': chosen per peer) on `host` (the node's address: TCP listens there, and pairs on one host
    may use cuda_ipc), taking peers of the cluster of `cluster_token` only."""
    from pdserve.kvtransfer.backends import make_backend

    cls = {"prefill": PrefillConnector, "decode": DecodeConnector}.get(role)
    if cls is None:
        raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
    meta = KVAgentMetadata.for_cache(engine_id, backend, kv_cache, layout, fingerprint, host)
    if backend in ("tcp", "auto"):  # the socket backends listen on the node's address, and check the token
        kw.setdefault("cluster_token", cluster_token)
        if host:
            kw.setdefault("host", host)
    be = make_backend(backend, meta, kv_cache, **kw)
    return cls(be, meta, cluster_token=cluster_token)
