"""The router's listening sockets: bound here, once, so that a taken port fails at once and names
what holds it (uvicorn would log the error in a Ray worker's file and exit its task), and port 0
takes a free port without a pick-then-bind race."""

import socket


class PortInUseError(RuntimeError):
    """A configured port cannot be bound; the message names the key, the port and its holder."""


def bind_listener(host: str, port: int, key: str, shared: bool = False) -> socket.socket:
    """A TCP socket bound to host:port and listening; raises PortInUseError naming `key` (the
    cluster.yaml key, e.g. router.http_port) when the address is taken.

    shared: the port is served by several routers of this cluster (router.replicas > 1), each
    binding it with SO_REUSEPORT; the kernel spreads new connections over them, and a router that
    dies simply drops out. Only sockets that all ask for it share a port: one held without it (an
    unrelated server) still fails the bind. The first router checks the port is free first
    (`claim_shared`), so that a stale router of another cluster cannot silently split the traffic."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says
    # so (an accepted socket takes its listener's). Without it, a response written in two parts
    # (uvicorn's headers, then its body) waited for the client's delayed ACK: 40 ms on every answer
    # but the first of a kept-alive connection, as the openai client keeps them.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # Lets a restart bind while the previous server's connections sit in TIME_WAIT; a port that
    # another process *listens* on still fails.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise PortInUseError(f"{key}: cannot listen on {host}:{port} ({e.strerror}); {holder(port)}. "
                             f"Stop it, or set {key} to a free port (0 takes any)") from None
    return sock


def claim_shared(host: str, port: int, key: str) -> socket.socket:
    """The first of several routers' sockets on a shared port: the port must be free of any
    listener (checked with a plain bind, which fails against a SO_REUSEPORT listener too), then
    bound for sharing. Port 0 takes a free port; the other routers bind the one it got."""
    check_free(host, port, key)
    return bind_listener(host, port, key, shared=True)


def check_free(host: str, port: int, key: str) -> None:
    """Raise PortInUseError now if host:port cannot be bound (before starting anything that will bind it)."""
    if port:
        bind_listener(host, port, key).close()


def holder(port: int) -> str:
    """Who listens on `port` on this host, as far as this process may see."""
    try:
        import psutil  # only on this error path: a machine without it still serves
    except ImportError:
        return "another process holds it"
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):  # e.g. AccessDenied: not ours to see
        return "another process holds it"
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                return "another process holds it"
            try:
                proc = psutil.Process(c.pid)
                command = " ".join(" ".join(proc.cmdline()).split())[:120]
                return f"held by pid {c.pid} ({command or proc.name()})"
            except psutil.Error:
                return f"held by pid {c.pid}"
    return "another process holds it"
