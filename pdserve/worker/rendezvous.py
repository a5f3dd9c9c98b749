"""Where the ranks of a group (tensor or expert parallel) find each other: a TCPStore that the one
who starts the group (the controller, a benchmark, a test) hosts and holds for the group's life.

torch's TCPStore takes any client that reaches its port: it has no authentication of its own. So
the store binds privately where it can — loopback on a cluster of one node, where every rank runs
on this host — and, once the group has formed over it, every rank proves the cluster's token to
the others over the group itself (`prove_members`): a stranger that took a rank's place at the
rendezvous is named, and the group refuses to serve. What this cannot stop is a stranger on the
node's network disturbing a multi-node group's rendezvous (a join refused, never a rank
impersonated); docs/architecture.md ("Internal channels") says what guards what."""

import hashlib
import hmac
import secrets

import torch
import torch.distributed as dist

PROOF_BYTES = 32


def rendezvous_store(host: str | None = None) -> dist.TCPStore:
    """A group's rendezvous, hosted by the caller: a TCPStore bound to port 0 and listening from now
    on, so no port is picked and given up. The caller holds it for the group's life (dropping it
    closes the port); every rank joins it at (host, store.port). `host`: default `private_host()`."""
    return dist.TCPStore(host or private_host(), 0, is_master=True, wait_for_workers=False)


def private_host() -> str:
    """Loopback where the Ray cluster is one node (every rank runs here), else Ray's node IP."""
    import ray

    if sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def new_group_id() -> str:
    """A fresh name for one group's proofs: a proof of one group is worth nothing in another."""
    return secrets.token_hex(8)


def prove_members(rank: int, size: int, token: str | None, group_id: str, group=None) -> None:
    """Every rank shows the others it holds the cluster's token (an HMAC of the group's id and its
    rank: the token never travels), over the group just joined (`group`: a gloo one; None: the
    default). Raises PermissionError naming the ranks that could not."""
    key = (token or "").encode()
    proofs = [hmac.digest(key, f"pdserve-rank:{group_id}:{r}".encode(), hashlib.sha256) for r in range(size)]
    got = [torch.empty(PROOF_BYTES, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(got, torch.frombuffer(bytearray(proofs[rank]), dtype=torch.uint8), group=group)
    bad = [r for r in range(size) if not hmac.compare_digest(got[r].numpy().tobytes(), proofs[r])]
    if bad:
        raise PermissionError(f"rank {rank} of group {group_id}: rank(s) {bad} do not hold the cluster's token "
                              f"(a process that is not this cluster's joined the rendezvous): the group refuses to serve")
