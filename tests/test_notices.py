"""cuda_ipc's notices: Unix sockets that the receiving connector reads when it polls (no thread),
and a sender that never blocks on a receiver that does not poll."""

import time

from pdserve.kvtransfer.backends.notices import NoticeInbox, NoticeOutbox, frame


def drain_until(inbox: NoticeInbox, count: int, timeout: float = 5) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += inbox.drain()
        time.sleep(0.001)
    return got


def test_notices_arrive_whole_and_in_each_senders_order():
    inbox, a, b = NoticeInbox(), NoticeOutbox(), NoticeOutbox()
    try:
        assert inbox.address.startswith("unix:@") and inbox.drain() == []
        for i in range(1000):  # sent before anyone reads, more than the socket holds: none blocks
            a.send("in", inbox.address, b"a%d" % i)
        b.send("in", inbox.address, b"b0")
        got = drain_until(inbox, 70)
        while len(got) < 1001:  # what the socket did not take goes on the next flush
            a.flush()
            more = inbox.drain()
            assert more, "the outbox kept notices the inbox had room for"
            got += more
        assert [g for g in got if g.startswith(b"a")] == [b"a%d" % i for i in range(1000)]
        assert b"b0" in got
    finally:
        a.close()
        b.close()
        inbox.close()


def test_a_frame_in_pieces_is_handed_out_once_whole_and_a_partial_one_dropped_with_its_sender():
    import socket

    inbox = NoticeInbox()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + inbox.address[len("unix:@"):])
    try:
        whole = frame(b"split")
        s.sendall(whole[:3])
        assert drain_until(inbox, 1, timeout=0.2) == []
        s.sendall(whole[3:] + frame(b""))
        assert drain_until(inbox, 2) == [b"split", b""]
        s.sendall(frame(b"last")[:5])
        s.close()  # gone mid-frame: the partial notice goes with it, the inbox forgets the sender
        assert drain_until(inbox, 1, timeout=0.2) == [] and inbox._conns == {}
    finally:
        inbox.close()


def test_a_gone_inbox_is_an_error_for_the_sender():
    inbox, out = NoticeInbox(), NoticeOutbox()
    out.send("p", inbox.address, b"x")
    inbox.close()
    try:
        for _ in range(3):  # a dead peer: the send (or the one after it) fails, nothing hangs
            out.send("p", inbox.address, b"y")
    except OSError:
        pass
    else:
        raise AssertionError("sent to a closed inbox")
    finally:
        out.close()
