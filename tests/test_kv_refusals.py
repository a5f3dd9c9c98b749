"""KV's internal channels refuse what is not a peer's, and a worker serves on: notices from another
user, unsealed, of another cluster, malformed or for another peer's lease; TCP hellos that prove
nothing (counted, not kept); KV frames out of range, outside the sender's leases, or whose tag is
wrong. Real sockets and processes throughout."""

import socket
import struct
import time

import msgpack
import pytest
import torch

from kv_pair import Worker, _decode_main, _prefill_main, start_pair
from test_notices import drain_until
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.kvtransfer.backends.notices import MAX_FRAME_BYTES, NoticeInbox, NoticeOutbox, frame
from pdserve.frame_seal import Sealer
from pdserve.kvtransfer.backends.tcp import TcpBackend, hello_proof, session_key
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.notice_seal import NoticeSeal
from pdserve.kvtransfer.wire import Notice

LAYOUT = KVLayout(2, 8, 4, 2, 8, torch.float32, "kv")
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)
NOBODY = 65534  # a uid other than ours (the tests run as root; `nobody` on Linux)


def send_from_process(address: str, payload: bytes, user: int | None = None) -> None:
    """Another process (of `user`, where given) connects to the inbox and sends one framed notice.
    Forked, not started: a process of another user could not read this interpreter's files; the
    child makes syscalls only, then leaves."""
    import os

    child = os.fork()
    if child == 0:
        code = 1
        try:
            if user is not None:
                os.setuid(user)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect("\0" + address[len("unix:@"):])
                s.sendall(frame(payload))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- the cuda_ipc inbox ---------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="SO_PEERCRED is Linux's")
def test_the_inbox_takes_senders_of_our_user_only():
    import os
    if os.getuid() != 0:
        pytest.skip("starting a process of another user needs root")
    inbox = NoticeInbox()
    try:
        send_from_process(inbox.address, b"from nobody", user=NOBODY)
        send_from_process(inbox.address, b"from us")
        assert drain_until(inbox, 1) == [b"from us"]
        assert drain_until(inbox, 1, timeout=0.3) == []
        assert inbox.refused == {"other_user": 1}
    finally:
        inbox.close()


def test_an_oversized_frame_cuts_off_its_sender_and_the_others_are_served():
    inbox, friend = NoticeInbox(), NoticeOutbox()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + inbox.address[len("unix:@"):])
    try:
        s.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 1000)
        friend.send("d", inbox.address, b"ok")
        assert drain_until(inbox, 1) == [b"ok"]
        assert inbox.refused == {"oversized": 1} and len(inbox._conns) == 1  # the friend's only
    finally:
        s.close()
        friend.close()
        inbox.close()


def test_a_strangers_notices_are_dropped_and_counted_by_the_seal():
    """What a process of our user (past SO_PEERCRED) sends: unsealed, sealed with another cluster's
    token, sealed for another worker, garbage. None reaches the connector; a sealed one does."""
    inbox = NoticeInbox()
    ours, theirs = NoticeSeal("t1", "decode-0"), NoticeSeal("t2", "prefill-0")
    try:
        finish = Notice.finish("r1", 7, None)
        for payload in (finish.pack(), theirs.seal(finish, "decode-0"), NoticeSeal("t1", "p").seal(finish, "decode-1"),
                        b"\xc1garbage", msgpack.packb([b"x", 5])):
            send_from_process(inbox.address, payload)
        send_from_process(inbox.address, NoticeSeal("t1", "prefill-0").seal(finish, "decode-0"))
        got = [ours.receive(p) for p in drain_until(inbox, 6)]
        assert [n.request_id if n else None for n in got] == [None, None, None, None, None, "r1"]
        assert got[-1].sender == "prefill-0" and got[-1].first_token == 7
        assert ours.dropped == {"malformed": 3, "foreign": 2}
    finally:
        inbox.close()


# -- the connectors: a forged, a foreign and a malformed notice, then the real transfer ------------

def test_a_forged_finish_is_refused_and_the_request_completes():
    """Two prefill workers of the cluster paired with one decode worker (TCP, real processes): the
    one that holds no lease sends FINISH for the other's, then a malformed and an unsealed notice.
    The decode worker drops and counts all three, serves on, and the real transfer completes."""
    p, d = start_pair("tcp")
    other = Worker(_prefill_main, "tcp")
    try:
        pid = KVAgentMetadata.unpack(p.call("meta")).engine_id
        did = KVAgentMetadata.unpack(d.call("meta")).engine_id
        oid = KVAgentMetadata.unpack(other.call("meta")).engine_id
        d.call("add_peer", other.call("meta"))
        other.call("add_peer", d.call("meta"))
        prompt = list(range(40))
        handle = d.call("reserve", "r0", prompt, GREEDY, 30.0, pid)
        forged = NoticeSeal(None, oid).seal(Notice.finish("r0", 7, None), did)  # (the pair's token: none)
        for payload in (forged, b"\xc1 not msgpack", Notice.finish("r0", 7, None).pack()):
            other.call("notify", did, payload)
        time.sleep(0.5)  # (in the decode worker's socket before the real KV)
        p.call("prefill", "r0", prompt, GREEDY, handle)
        presults, pfree, pidle = p.call("run", 60)
        dresults, dfree, didle = d.call("run", 60)
        assert presults == {"r0": True}
        assert len(dresults["r0"]) == 12 and dresults["r0"][0] != "f"  # decoded, not failed
        assert d.call("dropped") == {"not_the_lease_holder": 1, "malformed": 2}
        assert pfree == pidle and dfree == didle
    finally:
        for w in (p, d, other):
            w.stop()


# -- the TCP backend ------------------------------------------------------------------------------

def _peer_meta(name: str) -> KVAgentMetadata:
    """A handshaked peer's record (its backend closed: RawPeer speaks for it)."""
    b = _tcp(name)
    b.close()
    return b.meta


def _tcp(name: str, token: str = "t") -> TcpBackend:
    kv = allocate_kv_cache(LAYOUT, torch.device("cpu"))
    return TcpBackend(KVAgentMetadata.for_cache(name, "tcp", kv, LAYOUT, "tiny", "127.0.0.1"), kv,
                      cluster_token=token)


class RawPeer:
    """A peer that speaks the TCP backend's wire by hand: the hello, then frames it chooses."""

    def __init__(self, receiver: TcpBackend, me: str, token: str = "t"):
        host, port = receiver.meta.address.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=10)
        nonce = self._exactly(16)
        to = receiver.meta.engine_id
        self._send_raw({"kind": "hello", "sender": me, "receiver": to, "proof": hello_proof(token, nonce, me, to),
                        "nbytes": 0}, b"")
        (n,) = struct.unpack(">I", self._exactly(4))
        self.answer = msgpack.unpackb(self._exactly(n))
        self.sealer = Sealer(session_key(token, nonce, me, to))

    def _exactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.s.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def _send_raw(self, header: dict, payload: bytes) -> None:
        h = msgpack.packb(header)
        self.s.sendall(struct.pack(">I", len(h)) + h + payload)

    def send(self, header: dict, payload: bytes, tag: bytes | None = None) -> None:
        """A frame sealed as the backend seals it (`tag`: a wrong one in its place)."""
        sealed = self.sealer.seal(payload, msgpack.packb(header))
        self._send_raw(header, sealed if tag is None else sealed[:-len(tag)] + tag)

    def closed(self, timeout: float = 5) -> bool:
        self.s.settimeout(timeout)
        try:
            return self.s.recv(1) == b""
        except ConnectionError:
            return True

    def close(self) -> None:
        self.s.close()


def notice_arrives(receiver: TcpBackend, payload: bytes, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if payload in receiver.notifications():
            return True
        time.sleep(0.01)
    return False


def test_a_flood_of_refused_hellos_is_counted_not_kept():
    receiver = _tcp("decode-0")
    host, port = receiver.meta.address.rsplit(":", 1)
    try:
        for i in range(300):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.recv(16)
                h = msgpack.packb({"kind": "hello", "sender": f"x{i}", "proof": "0" * 64, "nbytes": 0})
                s.sendall(struct.pack(">I", len(h)) + h)
                s.recv(4096)  # the refusal
        deadline = time.monotonic() + 10
        while sum(receiver.refused.values()) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.refused == {"not_a_peer": 300}  # one counter, however many come
    finally:
        receiver.close()


def test_a_write_outside_the_senders_leases_is_refused():
    receiver, sender = _tcp("decode-0"), _tcp("prefill-0")
    try:
        receiver.add_peer(sender.meta)
        sender.add_peer(receiver.meta)
        receiver.grant("prefill-0", "r1", [2, 3])
        receiver.grant("prefill-9", "r2", [6])  # another peer's lease
        sender.kv.fill_(5.0)
        before = receiver.kv.clone()
        for dst in ([2, 3], [4], [6]):
            sender.write("decode-0", 1, [0] * len(dst), dst).result(10)
        sender.notify("decode-0", b"after the writes")
        assert notice_arrives(receiver, b"after the writes")  # (frames are read in order)
        assert (receiver.kv[1, :, 2:4] == 5.0).all()
        assert torch.equal(receiver.kv[1, :, 4], before[1, :, 4]) and torch.equal(receiver.kv[1, :, 6], before[1, :, 6])
        receiver.revoke("r1")  # the lease ended: its blocks take no more writes
        receiver.kv[1, :, 2].zero_()
        sender.write("decode-0", 1, [0], [2]).result(10)
        sender.notify("decode-0", b"after the lease")
        assert notice_arrives(receiver, b"after the lease")
        assert (receiver.kv[1, :, 2] == 0).all()
        assert receiver.refused == {"not_leased": 3}
    finally:
        receiver.close()
        sender.close()


def test_frames_out_of_range_are_refused_and_the_connection_serves_on():
    receiver = _tcp("decode-0")
    receiver.add_peer(_peer_meta("prefill-0"))
    receiver.grant("prefill-0", "r", list(range(8)))
    block = LAYOUT.num_planes * LAYOUT.bytes_per_block
    peer = RawPeer(receiver, "prefill-0")
    try:
        assert peer.answer == {"ok": True}
        before = receiver.kv.clone()
        for layer, runs, nbytes in ((-1, [[0, 1]], block), (2, [[0, 1]], block), (0, [[-1, 1]], block),
                                    (0, [[7, 2]], 2 * block), (0, [[0, 0]], 0), (0, [[0, 2]], block)):
            peer.send({"kind": "kv", "layer": layer, "runs": runs, "nbytes": nbytes}, b"\x01" * nbytes)
        peer.send({"kind": "kv", "layer": 0, "runs": [[1, 1]], "nbytes": block}, torch.full(
            (block // 4,), 3.0).numpy().tobytes())
        peer.send({"kind": "notice", "nbytes": 2}, b"ok")
        assert notice_arrives(receiver, b"ok")
        assert receiver.refused == {"out_of_range": 6}
        assert (receiver.kv[0, :, 1] == 3.0).all()
        receiver.kv[0, :, 1] = before[0, :, 1]
        assert torch.equal(receiver.kv, before)  # nothing else was written
    finally:
        peer.close()
        receiver.close()


@pytest.mark.parametrize("frame_kind", ["oversized", "bad_mac", "replayed"])
def test_a_frame_that_breaks_the_stream_ends_its_connection_only(frame_kind):
    receiver = _tcp("decode-0")
    receiver.add_peer(_peer_meta("prefill-0"))
    peer, friend = RawPeer(receiver, "prefill-0"), RawPeer(receiver, "prefill-0")
    try:
        if frame_kind == "oversized":  # more bytes than a layer of the whole cache: refused unread
            peer.send({"kind": "kv", "layer": 0, "runs": [[0, 8]], "nbytes": 1 << 40}, b"")
        elif frame_kind == "bad_mac":
            peer.send({"kind": "notice", "nbytes": 1}, b"x", tag=b"\0" * 16)
        else:  # a frame sent again: its sequence number is past
            peer.send({"kind": "notice", "nbytes": 1}, b"x")
            peer.sealer.seq -= 1
            peer.send({"kind": "notice", "nbytes": 1}, b"x")
        assert peer.closed()
        assert receiver.refused == {"bad_frame" if frame_kind == "oversized" else "bad_mac": 1}
        friend.send({"kind": "notice", "nbytes": 2}, b"ok")
        assert notice_arrives(receiver, b"ok")
    finally:
        peer.close()
        friend.close()
        receiver.close()


# -- the cuda_ipc handshake's handle --------------------------------------------------------------

class _Runs:
    """A pickle that runs code when loaded: what a peer's blob could have done to pickle.loads."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_cuda_ipc_handle_crosses_as_fields_never_a_pickle(tmp_path):
    import pickle

    from pdserve.kvtransfer.backends.ipc_handle import BadIpcHandle, decode, encode

    # reduce_tensor's arguments for a GPU tensor, as their types are (the bytes are no real handle:
    # nothing here opens them).
    args = (torch.Tensor, torch.Size([2, 8]), (8, 1), 0, torch.storage.TypedStorage, torch.float16, 1, b"h" * 64,
            4096, 0, False, b"r" * 64, 3, b"e" * 64, True)
    got = decode(encode(args), device=0)
    assert got[:6] == args[:6] and got[6] == 0 and got[7:] == args[7:]  # opened on OUR device
    path = tmp_path / "ran"
    with pytest.raises(BadIpcHandle, match="not msgpack"):
        decode(pickle.dumps(_Runs(str(path))), device=0)
    assert not path.exists()  # never unpickled
    fields = msgpack.unpackb(encode(args))
    for key, value, says in (("dtype", "system", "wrong type: dtype"), ("handle", "x", "wrong type: handle"),
                             ("size", [2, "8"], "wrong type: size")):
        with pytest.raises(BadIpcHandle, match=says):
            decode(msgpack.packb({**fields, key: value}), device=0)
    with pytest.raises(BadIpcHandle, match="has fields"):
        decode(msgpack.packb({**fields, "tensor_cls": "os.system"}), device=0)
