"""Notices between workers of one host over Unix sockets that no thread blocks on: the receiver
reads its inbox when its connector polls, the sender never waits for the receiver.

Why no receiving thread (the TCP backend has one): with a thread asleep on the socket, the
sender's 60-byte "finish" took several times as long (the send wakes that thread, and the
scheduler may well run it on the sender's core first) — on the path between the copy's end and
the request's delivery (docs/benchmarks-history.md, KV transfer between two GPUs). Nobody
waits on a notice anyway: the connectors read them when they poll. So the receiver reads the
socket then, and a send only copies bytes into a socket buffer.

That buffer holds ~70 unread notices (each send is its own kernel buffer). A receiver that does
not poll for a while must not block its senders (a prefill worker's completion thread serves
every peer), so what the socket does not take waits in the sender's outbox, sent on its next
notice or flush().

Frame: 4-byte big-endian length, then the notice's bytes. Addresses are "unix:@name", a name in
Linux's abstract namespace (no file to clean up; peers must share the host, as CUDA IPC needs).

An abstract name has no file permissions: anyone in the network namespace can connect (the name is
listed in /proc/net/unix). So the inbox takes only connections whose peer runs as our user
(SO_PEERCRED), at most MAX_SENDERS at once, and frames of at most MAX_FRAME_BYTES (a longer one
ends its connection: its stream is no sender's any more); each refusal is counted in `refused`.
What a frame says is the connector's to check (kvtransfer/notice_seal.py: sealed with the
cluster's token, from the lease's holder).
"""

import logging
import os
import secrets
import socket
import struct
import threading
from pdserve.kvtransfer.notice_seal import MAX_NOTICE_BYTES
from pdserve.refusals import Refusals

_LEN = struct.Struct(">I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_FRAME_BYTES = MAX_NOTICE_BYTES
MAX_SENDERS = 1024  # prefill workers of one host send here: far fewer
DRAIN_BYTES = 1 << 20  # read per sender per drain: one that never stops sending cannot hold the poll
log = logging.getLogger(__name__)


def _path(address: str) -> str:
    if not address.startswith("unix:@"):
        raise ValueError(f"not a notice inbox address: {address!r} (expected 'unix:@name')")
    return "\0" + address[len("unix:@"):]


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


class NoticeInbox:
    def __init__(self):
        self.address = f"unix:@pdserve-kv-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_path(self.address))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._conns: dict[socket.socket, bytearray] = {}  # each sender's bytes not yet a whole frame
        self._lock = threading.Lock()  # a connector may poll from more than one thread
        self._uid = os.getuid()
        # Connections refused, by why: "other_user" (SO_PEERCRED), "too_many_senders", "oversized".
        self.refused = Refusals(f"KV notice inbox {self.address}", log)

    def _refuse(self, conn: socket.socket | None, why: str) -> None:
        if conn is not None:
            conn.close()
        self.refused.refuse(why, "a sender")

    def _admit(self, conn: socket.socket) -> bool:
        pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != self._uid:
            self._refuse(conn, "other_user")
        elif len(self._conns) >= MAX_SENDERS:
            self._refuse(conn, "too_many_senders")
        else:
            return True
        return False

    def drain(self) -> list[bytes]:
        """Every whole notice that arrived since the last call, in each sender's order."""
        out: list[bytes] = []
        with self._lock:
            while True:
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, OSError):
                    break
                if self._admit(conn):
                    conn.setblocking(False)
                    self._conns[conn] = bytearray()
            for conn, buf in list(self._conns.items()):
                closed, budget = False, DRAIN_BYTES
                while not closed and budget > 0:
                    try:
                        chunk = conn.recv(1 << 16)
                    except BlockingIOError:
                        break
                    except OSError:
                        chunk = b""
                    buf += chunk
                    budget -= len(chunk)
                    closed = not chunk or not self._frames(buf, out)  # (read as it comes: buf stays bounded)
                if closed:  # the sender went away (or broke the frame cap); a partial frame goes with it
                    conn.close()
                    del self._conns[conn]
        return out

    def _frames(self, buf: bytearray, out: list[bytes]) -> bool:
        """Move buf's whole frames to out; False where a frame is over the cap (its sender is cut off)."""
        while len(buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(buf)
            if n > MAX_FRAME_BYTES:
                self._refuse(None, "oversized")
                return False
            if len(buf) < _LEN.size + n:
                break
            out.append(bytes(buf[_LEN.size:_LEN.size + n]))
            del buf[:_LEN.size + n]
        return True

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
            self._listener.close()


class NoticeOutbox:
    """One connection per peer inbox; sends never block once connected."""

    def __init__(self):
        self._socks: dict[str, socket.socket] = {}
        self._pending: dict[str, bytearray] = {}  # per peer: bytes its socket did not take yet
        self._lock = threading.Lock()  # notices go out from the poster and the completion thread

    def send(self, peer: str, address: str, payload: bytes) -> None:
        """Queue a notice to `peer`; raises OSError where its inbox cannot be reached (gone, closed)."""
        with self._lock:
            s = self._socks.get(peer)
            try:
                if s is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        s.settimeout(10)
                        s.connect(_path(address))
                    except OSError:
                        s.close()
                        raise
                    s.setblocking(False)
                    self._socks[peer] = s
                self._pending.setdefault(peer, bytearray()).extend(frame(payload))
                self._push(peer, s)
            except OSError:
                self._drop(peer)
                raise

    def flush(self) -> None:
        """Send what receivers that did not poll left waiting; peers whose inbox is gone are forgotten."""
        with self._lock:
            for peer in [p for p, buf in self._pending.items() if buf]:
                try:
                    self._push(peer, self._socks[peer])
                except OSError:
                    self._drop(peer)

    def forget(self, peer: str) -> None:
        with self._lock:
            self._drop(peer)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._socks):
                self._drop(peer)

    def _push(self, peer: str, s: socket.socket) -> None:
        buf = self._pending[peer]
        while buf:
            try:
                n = s.send(buf)
            except BlockingIOError:
                return  # the receiver's socket is full until it polls
            del buf[:n]

    def _drop(self, peer: str) -> None:
        self._pending.pop(peer, None)
        s = self._socks.pop(peer, None)
        if s is not None:
            s.close()
