"""KV between GPUs of one host through CUDA IPC: the prefill worker maps the decode worker's KV
allocation and copies into it over NVLink with the copy engines; notices go over TCP.

Why besides NIXL: on one host, NIXL/UCX's cuda_ipc path pays about a millisecond per request
and reaches 60-70 % of the peer-copy rate (docs/benchmarks.md); a plain peer copy of a strided
view — every layer of a run of blocks in one call — reaches 87-91 %.
"""

import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kvtransfer.backends.tcp import TcpBackend
from kvtransfer.blocks import runs
from kvtransfer.metadata import KVAgentMetadata

_STORAGE_DEVICE = 6  # position of the storage's device index in reduce_tensor's rebuild arguments


class CudaIpcBackend:
    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1"):
        if not kv_cache.is_cuda:
            raise ValueError("kv_transfer.backend 'cuda_ipc' needs the KV cache on a GPU; use 'nixl' or 'tcp'")
        self.kv = kv_cache
        self.meta = meta
        self.notices = TcpBackend(meta, kv_cache, host=host)  # the notice channel (sets meta.address)
        # The handle lets a peer on this host map our allocation; the args hold no tensor data.
        _, args = reduce_tensor(kv_cache)
        meta.agent_metadata = pickle.dumps(args)
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._handles: dict[str, bytes] = {}
        self._peers: dict[str, torch.Tensor] = {}

    def add_peer(self, peer: KVAgentMetadata) -> None:
        self.notices.add_peer(peer)
        self._handles[peer.engine_id] = peer.agent_metadata

    def remove_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        self._handles.pop(engine_id, None)
        self.notices.remove_peer(engine_id)

    def _peer_kv(self, engine_id: str) -> torch.Tensor:
        """The peer's KV allocation mapped into our GPU's context (on first write only: the
        decode side never writes and never maps)."""
        kv = self._peers.get(engine_id)
        if kv is None:
            args = list(pickle.loads(self._handles[engine_id]))
            # Open the handle in OUR device's context (peer access over NVLink), not the owner's:
            # our copy kernels run on our device, and an address mapped only in the other
            # device's context faults there. The tensor thus reads as ours; its bytes live on the peer.
            args[_STORAGE_DEVICE] = self.kv.device.index
            kv = self._peers[engine_id] = rebuild_cuda_tensor(*args)
        return kv

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]):
        return self.write_layers(peer_id, [(layer, src_blocks, dst_blocks)])

    def write_layers(self, peer_id: str, parts: list[tuple[int, list[int], list[int]]]):
        """Copy several layers' K and V; consecutive layers with the same blocks are one strided copy."""
        dst_kv = self._peer_kv(peer_id)
        with torch.cuda.stream(self.stream):
            i = 0
            while i < len(parts):
                first, src, dst = parts[i]
                j = i + 1
                while j < len(parts) and parts[j][0] == parts[j - 1][0] + 1 and parts[j][1:] == parts[i][1:]:
                    j += 1
                last = parts[j - 1][0]
                for s, d, n in runs(src, dst):
                    dst_kv[first:last + 1, :, d:d + n].copy_(self.kv[first:last + 1, :, s:s + n], non_blocking=True)
                i = j
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    @staticmethod
    def state(token) -> str:
        return "done" if token.query() else "pending"

    @staticmethod
    def release(token) -> None:
        pass

    def notify(self, peer_id: str, payload: bytes) -> None:
        self.notices.notify(peer_id, payload)

    def progress(self) -> None:
        """Nothing to drive: a thread of our own receives."""

    def notifications(self) -> list[bytes]:
        return self.notices.notifications()

    def close(self) -> None:
        self.stream.synchronize()
        self._peers.clear()
        self.notices.close()
