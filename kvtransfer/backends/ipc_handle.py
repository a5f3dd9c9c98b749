"""A CUDA allocation's IPC handle as the cuda_ipc handshake carries it: explicit msgpack fields,
never a pickle.

torch's own form (`reduce_tensor`) is a rebuild function's arguments, types among them; pickled, a
peer's blob would run whatever it names on unpickling. Here the peer sends numbers and byte
strings only; the types are ours (a plain tensor over a typed storage), the dtype one of torch's by
name, and a blob that is anything else is refused by name."""

import msgpack
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

# reduce_tensor's rebuild arguments, in order; the two types and requires_grad are not sent.
_FIELDS = ("size", "stride", "offset", "dtype", "device", "handle", "storage_size_bytes", "storage_offset_bytes",
           "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
_INTS = ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_BYTES = ("handle", "ref_counter_handle", "event_handle")


class BadIpcHandle(ValueError):
    """A peer's cuda_ipc handle that is not one this pdserve packs."""


def encode(args: tuple) -> bytes:
    """reduce_tensor's rebuild arguments (for a GPU tensor) as msgpack fields."""
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_size_bytes, storage_offset_bytes,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return msgpack.packb({"size": list(size), "stride": list(stride), "offset": offset,
                          "dtype": str(dtype).removeprefix("torch."), "device": device, "handle": handle,
                          "storage_size_bytes": storage_size_bytes, "storage_offset_bytes": storage_offset_bytes,
                          "ref_counter_handle": ref_counter_handle, "ref_counter_offset": ref_counter_offset,
                          "event_handle": event_handle, "event_sync_required": event_sync_required})


def decode(blob: bytes, device: int) -> tuple:
    """The rebuild arguments of a peer's handle, its storage opened on our `device`; raises BadIpcHandle."""
    try:
        f = msgpack.unpackb(blob)
    except Exception:
        raise BadIpcHandle("the peer's cuda_ipc handle is not msgpack (a pickle from an older pdserve?)") from None
    if not isinstance(f, dict) or set(f) != set(_FIELDS):
        raise BadIpcHandle(f"the peer's cuda_ipc handle has fields {sorted(f) if isinstance(f, dict) else '?'}, "
                           f"not {sorted(_FIELDS)}")
    dtype = getattr(torch, str(f["dtype"]), None)
    bad = [k for k in _INTS if type(f[k]) is not int] + [k for k in _BYTES if not isinstance(f[k], bytes)]
    bad += [k for k in ("size", "stride") if not (isinstance(f[k], list) and all(type(x) is int for x in f[k]))]
    bad += [] if isinstance(dtype, torch.dtype) else ["dtype"]
    bad += [] if type(f["event_sync_required"]) is bool else ["event_sync_required"]
    if bad:
        raise BadIpcHandle(f"the peer's cuda_ipc handle has fields of the wrong type: {', '.join(bad)}")
    # Opened in OUR device's context (see CudaIpcBackend._peer_copy), hence `device`.
    return (torch.Tensor, torch.Size(f["size"]), tuple(f["stride"]), f["offset"], torch.storage.TypedStorage,
            dtype, device, f["handle"], f["storage_size_bytes"], f["storage_offset_bytes"], False,
            f["ref_counter_handle"], f["ref_counter_offset"], f["event_handle"], f["event_sync_required"])


def share(kv_cache: torch.Tensor) -> bytes:
    """What a worker publishes so that a peer on its host can map its KV allocation."""
    _, args = reduce_tensor(kv_cache)
    return encode(args)


def open_peer(blob: bytes, device: int) -> torch.Tensor:
    """A peer's KV allocation, mapped into `device`'s context."""
    return rebuild_cuda_tensor(*decode(blob, device))
