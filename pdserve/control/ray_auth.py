"""Whether the Ray cluster `pdserve up` runs on keeps strangers out, and the refusal when it does not.

Whoever reaches an unauthenticated Ray cluster's GCS runs code on every node and reads what the
cluster holds (the weights, the KV, pdserve's cluster token). Ray (2.5x on) guards its cluster with
a token only where the cluster was started in token mode (`RAY_AUTH_MODE=token` and a token);
`ray start` does so only where a token already exists. So the cluster is asked, not the settings
here: a call to its GCS that carries no token is answered (the door is open) or refused
(UNAUTHENTICATED).
"""

from dataclasses import dataclass

PROBE_S = 10.0  # a GCS that answers `pdserve up` answers a call this small within it


@dataclass(frozen=True)
class Door:
    """What the GCS did with a call that carried no token."""

    open: bool | None  # True: answered; False: refused for want of a token; None: could not tell
    detail: str


def probe(gcs_address: str, timeout_s: float = PROBE_S) -> Door:
    """Ask Ray's GCS at `gcs_address` (host:port) for its nodes, with no token."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return Door(False, "refuses a caller without the token")
            return Door(None, f"{e.code().name}: {e.details()}")
    return Door(True, f"told a caller without a token its {len(reply.node_info_list)} nodes")


def check_cluster_auth(gcs_address: str, joined: bool, nodes: int, allow_unauthenticated: bool, log) -> None:
    """Refuse (ValueError naming `ray.allow_unauthenticated`) a cluster of several nodes, or one joined
    (`ray start`ed to take nodes), whose GCS answers without a token; `allow_unauthenticated` runs
    on it anyway, saying so. A cluster this `pdserve up` started alone on its host is not asked."""
    if not joined and nodes <= 1:
        return
    door = probe(gcs_address)
    if door.open is False:
        return
    if door.open is None:
        log(f"could not tell whether Ray at {gcs_address} requires its token ({door.detail}); going on")
        return
    risk = (f"Ray at {gcs_address} {door.detail}: it has no token authentication, so anyone who reaches "
            f"it runs code on every node and reads the weights, the KV and pdserve's cluster token")
    if allow_unauthenticated:
        log(f"{risk}. Going on, as ray.allow_unauthenticated: true says")
        return
    raise ValueError(f"ray.address: {risk}. Start every node with Ray's token authentication "
                     f"(RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH naming one secret file on every host, "
                     f"as the README's 'Across nodes' recipe does) and run `pdserve up` with the same two "
                     f"variables; or, on a network nobody else reaches, set ray.allow_unauthenticated: true")
