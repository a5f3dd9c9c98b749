"""Where the ranks of a group (tensor or expert parallel) find each other: a TCPStore that the one
who starts the group (the controller, a benchmark, a test) hosts and holds for the group's life."""

import torch.distributed as dist


def rendezvous_store(host: str | None = None) -> dist.TCPStore:
    """A group's rendezvous, hosted by the caller: a TCPStore bound to port 0 and listening from now
    on, so no port is picked and given up. The caller holds it for the group's life (dropping it
    closes the port); every rank joins it at (host, store.port). `host`: default Ray's node IP."""
    if host is None:
        import ray

        host = ray.util.get_node_ip_address()
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
