"""Which backend a prefill/decode pair moves KV over, agreed at the handshake from both ends'
metadata (each end computes the same answer from the same two records).

A worker with `kv_transfer.backend: auto` offers every backend it can run (`meta.offers`); one
with an explicit backend offers that one. Of what both offer: `cuda_ipc` when both ends are on GPUs
of one host (a copy kernel over NVLink), else `nixl` (UCX: RDMA where the hosts have it, TCP
otherwise), else `tcp`. A pair with nothing that can work is refused, naming why — e.g. `cuda_ipc`
between two hosts.
"""

from dataclasses import dataclass

from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata

PREFERENCE = ("cuda_ipc", "nixl", "tcp")


@dataclass(frozen=True)
class Pairing:
    backend: str
    why: str

    def record(self, local: KVAgentMetadata, peer: KVAgentMetadata) -> dict:
        """What the handshake records (the controller's status shows it)."""
        return {"peer": peer.engine_id, "backend": self.backend, "why": self.why,
                "hosts": [local.host, peer.host]}


def offered(meta: KVAgentMetadata) -> list[str]:
    return list(meta.offers) if meta.backend == "auto" else [meta.backend]


def choose_backend(local: KVAgentMetadata, peer: KVAgentMetadata) -> Pairing:
    """The backend for this pair; HandshakeError naming why none can work."""
    ours, theirs = offered(local), offered(peer)
    if local.backend != "auto" and peer.backend != "auto" and local.backend != peer.backend:
        raise HandshakeError(f"KV handshake refused — backend: ours {local.backend!r}, peer {peer.engine_id!r} "
                             f"has {peer.backend!r}: set one kv_transfer.backend (or auto) for the cluster")
    # (A backend outside PREFERENCE — a test's own — is used as named where both ends name it.)
    common = [b for b in PREFERENCE if b in ours and b in theirs] + [b for b in ours if b in theirs and b not in PREFERENCE]
    same_host = local.host == peer.host
    on_gpus = local.device.startswith("cuda") and peer.device.startswith("cuda")
    hosts = "hosts " + " and ".join(sorted([local.host or "?", peer.host or "?"]))
    if "cuda_ipc" in common:
        if same_host and on_gpus:
            return Pairing("cuda_ipc", f"both on GPUs of host {local.host or 'this host'}")
        common.remove("cuda_ipc")
        cannot = (f"cuda_ipc moves KV between GPUs of one host, and peer {peer.engine_id!r} is on host "
                  f"{peer.host or '?'}, this worker on {local.host or '?'}" if not same_host else
                  f"cuda_ipc needs both ends on GPUs ({local.device} and {peer.device})")
        if not common:
            raise HandshakeError(f"KV handshake refused — {cannot}: use nixl, tcp or auto")
    if "nixl" in common:
        return Pairing("nixl", f"{hosts} differ" if not same_host else
                       f"one host ({local.host or '?'}), not both on GPUs" if not on_gpus else
                       "one host, cuda_ipc not offered by both")
    if "tcp" in common:
        return Pairing("tcp", "nixl not offered by both" if local.backend == "auto" or peer.backend == "auto"
                       else "kv_transfer.backend: tcp")
    if common:
        return Pairing(common[0], f"kv_transfer.backend: {common[0]}")
    raise HandshakeError(f"KV handshake refused — no KV backend both ends offer (ours: {', '.join(ours) or 'none'}; "
                         f"peer {peer.engine_id!r}: {', '.join(theirs) or 'none'})")
