"""The router's listening sockets: a shared port (several routers, SO_REUSEPORT) is joined only by
sockets that ask to share it, and is never claimed while anything else listens on it."""

import socket

import pytest

from pdserve.router.listen import PortInUseError, bind_listener, claim_shared


def test_routers_share_a_claimed_port_and_the_kernel_serves_each():
    first = claim_shared("127.0.0.1", 0, "router.http_port")
    port = first.getsockname()[1]
    second = bind_listener("127.0.0.1", port, "router.http_port", shared=True)
    try:
        assert second.getsockname()[1] == port
        first.close()  # one router gone: the other still takes connections on the port
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = second.accept()
            conn.close()
    finally:
        first.close()
        second.close()


def test_a_port_held_by_another_server_is_neither_shared_nor_claimed():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortInUseError, match=rf"router\.http_port: cannot listen on 127\.0\.0\.1:{port}"):
            bind_listener("127.0.0.1", port, "router.http_port", shared=True)
        with pytest.raises(PortInUseError):
            claim_shared("127.0.0.1", port, "router.http_port")


def test_a_stale_router_sharing_the_port_stops_a_new_cluster_claiming_it():
    stale = bind_listener("127.0.0.1", 0, "router.http_port", shared=True)
    try:
        with pytest.raises(PortInUseError, match="router.http_port"):
            claim_shared("127.0.0.1", stale.getsockname()[1], "router.http_port")
    finally:
        stale.close()
