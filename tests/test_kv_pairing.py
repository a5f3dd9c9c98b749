"""The KV backend a prefill/decode pair agrees on (kv_transfer.backend: auto, or an explicit one),
the pairs refused by name, and the cluster token: a peer of another cluster is refused at the
handshake, and a TCP KV endpoint takes connections from handshaked peers of its cluster only."""

import time

import msgpack

import pytest
import torch

from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.kvtransfer import make_connector
from pdserve.kvtransfer.backends.tcp import PeerRefused, TcpBackend
from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata, Replays, accept_peer, cluster_proof
from pdserve.kvtransfer.pairing import choose_backend

LAYOUT = KVLayout(2, 8, 4, 2, 8, torch.float32, "kv")


def meta(name: str, backend: str, host: str, device: str = "cpu", offers=("nixl", "tcp")):
    m = KVAgentMetadata.for_cache(name, backend, allocate_kv_cache(LAYOUT, torch.device("cpu")), LAYOUT, "tiny",
                                  host)
    m.device = device  # the choice reads the device as published: a GPU worker's needs no GPU here
    if backend == "auto":
        m.offers = {b: {"agent_metadata": b"", "address": ""} for b in offers}
    return m


@pytest.mark.parametrize("a, b, backend, why", [
    # auto: cuda_ipc within a host when both are on GPUs; NIXL between hosts; tcp as the fallback.
    (("auto", "h1", "cuda:0", ("cuda_ipc", "nixl", "tcp")), ("auto", "h1", "cuda:1", ("cuda_ipc", "nixl", "tcp")),
     "cuda_ipc", "both on GPUs of host h1"),
    (("auto", "h1", "cuda:0", ("cuda_ipc", "nixl", "tcp")), ("auto", "h2", "cuda:0", ("cuda_ipc", "nixl", "tcp")),
     "nixl", "hosts h1 and h2 differ"),
    (("auto", "h1", "cpu", ("nixl", "tcp")), ("auto", "h1", "cpu", ("nixl", "tcp")),
     "nixl", "one host (h1), not both on GPUs"),
    (("auto", "h1", "cpu", ("nixl", "tcp")), ("auto", "h2", "cpu", ("tcp",)), "tcp", "nixl not offered by both"),
    # An auto end meets an explicit one on what the explicit one runs.
    (("auto", "h1", "cpu", ("nixl", "tcp")), ("tcp", "h2", "cpu", ()), "tcp", "nixl not offered by both"),
    (("nixl", "h1", "cpu", ()), ("nixl", "h2", "cpu", ()), "nixl", "hosts h1 and h2 differ"),
])
def test_auto_picks_per_pair(a, b, backend, why):
    ma, mb = meta("a", a[0], a[1], a[2], a[3]), meta("b", b[0], b[1], b[2], b[3])
    for x, y in ((ma, mb), (mb, ma)):  # both ends agree
        p = choose_backend(x, y)
        assert (p.backend, p.why) == (backend, why)


@pytest.mark.parametrize("a, b, says", [
    (("cuda_ipc", "h1", "cuda:0"), ("cuda_ipc", "h2", "cuda:0"),
     r"cuda_ipc moves KV between GPUs of one host, and peer 'b' is on host h2, this worker on h1: use nixl, tcp or auto"),
    (("cuda_ipc", "h1", "cuda:0"), ("cuda_ipc", "h1", "cpu"), r"cuda_ipc needs both ends on GPUs \(cuda:0 and cpu\)"),
    (("nixl", "h1", "cpu"), ("tcp", "h1", "cpu"), r"backend: ours 'nixl', peer 'b' has 'tcp'"),
    (("auto", "h1", "cpu"), ("cuda_ipc", "h2", "cuda:0"), r"no KV backend both ends offer \(ours: nixl, tcp; peer 'b': cuda_ipc\)"),
])
def test_a_pair_that_cannot_work_is_refused_naming_why(a, b, says):
    ma, mb = meta("a", *a), meta("b", *b)
    with pytest.raises(HandshakeError, match=says):
        accept_peer(ma, mb.pack())


def test_a_peer_of_another_cluster_is_refused_at_the_handshake():
    ours, theirs = meta("d", "tcp", "h1"), meta("p", "tcp", "h2")
    with pytest.raises(HandshakeError, match=r"peer 'p' \(host h2\) belongs to another cluster: its cluster token differs"):
        accept_peer(ours, theirs.pack("secret-2"), "secret-1")
    assert accept_peer(ours, theirs.pack("secret-1"), "secret-1").engine_id == "p"
    # A proof covers the whole record: one field changed on its way (here the KV's address) is refused.
    record = msgpack.unpackb(theirs.pack("secret-1"))
    record["base_addr"] += 4096
    with pytest.raises(HandshakeError, match="belongs to another cluster"):
        accept_peer(ours, msgpack.packb(record), "secret-1")


def test_a_replayed_handshake_is_refused():
    """A record accepted once is refused when it comes again, and so is one packed too long ago,
    even though each proves the cluster's token; a fresh packing of the same worker is accepted."""
    ours, theirs = meta("d", "tcp", "h1"), meta("p", "tcp", "h2")
    seen = Replays()
    record = theirs.pack("t")
    accept_peer(ours, record, "t", seen)
    with pytest.raises(HandshakeError, match=r"peer 'p'.s record was accepted once already: a replay"):
        accept_peer(ours, record, "t", seen)
    old = msgpack.unpackb(theirs.pack("t"))
    old["issued_at"] -= Replays.WINDOW_S + 60
    old["cluster_proof"] = cluster_proof("t", old)  # (proven: as one captured long ago would be)
    with pytest.raises(HandshakeError, match=r"packed 360 s ago \(more than 300 s either way\): a replay"):
        accept_peer(ours, msgpack.packb(old), "t", seen)
    assert accept_peer(ours, theirs.pack("t"), "t", seen).engine_id == "p"


def _tcp(name: str, token: str) -> TcpBackend:
    kv = allocate_kv_cache(LAYOUT, torch.device("cpu"))
    return TcpBackend(KVAgentMetadata.for_cache(name, "tcp", kv, LAYOUT, "tiny", "127.0.0.1"), kv,
                      cluster_token=token)


def test_tcp_endpoint_takes_handshaked_peers_of_its_cluster_only():
    receiver, friend, stranger = _tcp("decode-0", "t1"), _tcp("prefill-0", "t1"), _tcp("prefill-0", "t2")
    intruder = _tcp("prefill-9", "t1")
    try:
        receiver.add_peer(friend.meta)  # the handshake made prefill-0 a peer of decode-0
        receiver.grant("prefill-0", "r", [5])  # and the decode end leased it block 5
        for sender in (friend, stranger, intruder):
            sender.add_peer(receiver.meta)
        before = receiver.kv.clone()
        # The friend's KV lands.
        friend.kv[1, :, 3].fill_(7.0)
        tok = friend.write("decode-0", 1, [3], [5])
        tok.result(10)
        friend.notify("decode-0", b"done")
        deadline = time.monotonic() + 10  # the notice follows the KV on the connection: read, the KV is in place
        while not (got := receiver.notifications()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [b"done"]
        assert torch.equal(receiver.kv[1, :, 5], friend.kv[1, :, 3])
        # One naming a handshaked peer but proving another cluster's token, and a worker of this
        # cluster that is no handshaked peer: refused by name, nothing written.
        receiver.kv.copy_(before)
        stranger.kv.fill_(9.0)
        intruder.kv.fill_(9.0)
        with pytest.raises(PeerRefused, match=r"KV peer 'decode-0' refused 'prefill-0': 'prefill-0' belongs to "
                                              r"another cluster: its cluster token differs"):
            stranger.write("decode-0", 0, [0], [0]).result(10)
        with pytest.raises(PeerRefused, match=r"refused 'prefill-9': 'prefill-9' is not a handshaked peer of 'decode-0'"):
            intruder.write("decode-0", 0, [0], [0]).result(10)
        assert receiver.refused == {"other_cluster": 1, "not_a_peer": 1}
        assert torch.equal(receiver.kv, before) and receiver.notifications() == []
    finally:
        for b in (receiver, friend, stranger, intruder):
            b.close()


@pytest.mark.parametrize("backend", ["auto", "tcp"])
def test_connectors_record_the_pairs_choice(backend):
    """make_connector's ends on one host (CPU): auto offers nixl and tcp and the pair takes nixl."""
    kv_p, kv_d = (allocate_kv_cache(LAYOUT, torch.device("cpu")) for _ in range(2))
    p = make_connector("prefill", backend, "p0", kv_p, LAYOUT, "tiny", host="127.0.0.1", cluster_token="t")
    d = make_connector("decode", backend, "d0", kv_d, LAYOUT, "tiny", host="127.0.0.1", cluster_token="t")
    try:
        d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        want = "nixl" if backend == "auto" else "tcp"
        assert p.pairs["d0"]["backend"] == d.pairs["p0"]["backend"] == want
        if backend == "auto":
            assert sorted(p.meta.offers) == ["nixl", "tcp"]
    finally:
        p.close()
        d.close()
