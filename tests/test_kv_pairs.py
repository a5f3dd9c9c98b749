"""The controller's book of KV pairs (pdserve/control/kv_pairs.py): a pair is paired only once both
ends took each other, a failed pairing is tried again with a doubling backoff up to a minute and
counted by reason, a stopped worker's pairs go, and `pdserve status` lists a failed pair with why.
(The pairing itself, under load, is tests/test_chaos.py's.)"""

import time

from pdserve.control.kv_pairs import PairBook

REC = {"peer": "?", "backend": "nixl", "why": "one host", "hosts": ["a", "a"]}


def test_a_pair_is_complete_only_once_both_ends_took_each_other():
    book = PairBook()
    book.half("d0", "p0", dict(REC, peer="p0"))
    assert not book.complete(["p0"], ["d0"])
    assert [p["worker"] for p in book.status({"p0", "d0"})] == ["d0"]  # (status lists pairs from the prefill side)
    book.paired("p0", "d0", dict(REC, peer="d0"), dict(REC, peer="p0"))
    assert book.complete(["p0"], ["d0"])
    assert not book.complete(["p0", "p1"], ["d0"])


def test_a_failed_pairing_backs_off_doubling_to_a_minute_and_is_counted(monkeypatch):
    book = PairBook()
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    backoffs = [book.failed("p0", "d1", "timeout", "d1 did not answer").backoff for _ in range(8)]
    assert backoffs == [2, 4, 8, 16, 32, 60, 60, 60]
    assert book.failing[("p0", "d1")].attempts == 8
    assert book.due() == []
    now[0] += 60
    assert book.due() == [("p0", "d1")]
    book.failed("p1", "d1", "refused", "KV handshake refused — dtype")
    assert dict(book.failures) == {"timeout": 8, "refused": 1}
    [p] = [p for p in book.status({"p0", "d1"}) if p["state"] == "failed"]
    assert p == {"worker": "p0", "peer": "d1", "state": "failed", "backend": None, "reason": "timeout",
                 "why": "d1 did not answer", "attempts": 8, "retry_in_s": 0.0}
    book.paired("p0", "d1", REC, REC)  # a retry that worked: no longer failing
    assert ("p0", "d1") not in book.failing


def test_a_stopped_workers_pairs_go():
    book = PairBook()
    book.paired("p0", "d0", REC, REC)
    book.paired("p0", "d1", REC, REC)
    book.failed("p1", "d0", "died", "p1's process died")
    book.forget(["d0"])
    assert set(book.records) == {("p0", "d1"), ("d1", "p0")}
    assert not book.failing


def test_status_prints_a_failed_pair_with_its_reason():
    """`pdserve status`'s lines, from the controller's status as it returns it."""
    from pdserve.control.commands import status_lines

    status = {"state": "running", "pid": 7, "endpoints": {}, "replicas": {}, "routers": {}, "restarts": {},
              "kv_pairs": [{"worker": "pdserve-prefill-0", "state": "paired", **dict(REC, peer="pdserve-decode-0")},
                           {"worker": "pdserve-decode-0", "state": "paired", **dict(REC, peer="pdserve-prefill-0")},
                           {"worker": "pdserve-prefill-0", "peer": "pdserve-decode-1", "state": "failed",
                            "backend": None, "reason": "timeout", "why": "pdserve-decode-1 did not answer",
                            "attempts": 2, "retry_in_s": 3.6}]}
    out = status_lines(status)
    assert "pdserve-controller (pid 7)" in out
    assert "KV pdserve-prefill-0 -> pdserve-decode-0: nixl (one host)" in out
    assert ("KV pdserve-prefill-0 -> pdserve-decode-1: not paired (timeout: pdserve-decode-1 did not answer); "
            "attempt 2 failed, next in 4 s") in out
    assert len([ln for ln in out if ln.startswith("KV ")]) == 2  # each pair once
