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


def test_the_routers_connections_send_without_waiting_for_acks():
    """Every connection the router's listener accepts has TCP_NODELAY, as asyncio sets it where the
    socket names its protocol: without it, a response written in two parts (uvicorn's headers, then
    its body) waited ~40 ms for the client's delayed ACK on every kept-alive connection."""
    import asyncio

    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind_listener("127.0.0.1", 0, "router.http_port")
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)  # as uvicorn serves it
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            nodelay = await asyncio.wait_for(seen, 5)
            writer.close()
            return nodelay
        finally:
            server.close()

    assert asyncio.run(main()) != 0
