"""KV transfer: the connector API (handshake, decode end, prefill end) and its backends (NIXL, TCP, CUDA IPC)."""

from pdserve.kvtransfer.decode_end import DecodeConnector, DecodePoll, Finished
from pdserve.kvtransfer.messages import ReserveHandle
from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata
from pdserve.kvtransfer.prefill_end import PrefillConnector

__all__ = ["DecodeConnector", "DecodePoll", "Finished", "HandshakeError", "KVAgentMetadata",
           "PrefillConnector", "ReserveHandle", "make_connector"]


def make_connector(role: str, backend: str, engine_id: str, kv_cache, layout, fingerprint: str, **kw):
    """A connector of `role` ('prefill' or 'decode') over `backend` ('nixl', 'tcp' or 'cuda_ipc')."""
    from pdserve.kvtransfer.backends import make_backend

    meta = KVAgentMetadata.for_cache(engine_id, backend, kv_cache, layout, fingerprint)
    be = make_backend(backend, meta, kv_cache, **kw)
    cls = {"prefill": PrefillConnector, "decode": DecodeConnector}.get(role)
    if cls is None:
        raise ValueError(f"role: must be 'prefill' or 'decode', got {role!r}")
    return cls(be, meta)
