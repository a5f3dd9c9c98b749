"""Notices sealed with the cluster's token: each one carries an HMAC over its bytes, its sender and
its receiver, checked before the connector acts on it.

Why at the connector and not in each backend: a notice ends a lease (FINISH hands the blocks to
decode, ABORT lets them be reused), so a forged one corrupts a request whatever carried it — the
cuda_ipc inbox (a Unix socket), a TCP connection, NIXL's notifications. Sealing it here covers all
of them once. The MAC names the receiver, so a notice sealed for one worker is refused by another;
a replayed one names a lease that has ended, which both ends ignore.

What the token cannot tell apart is one holder from another: the sender a notice names is then
checked against the lease it ends (decode_end.py, transfers.py).

Wire: a msgpack array [notice bytes (Notice.pack), 32-byte HMAC-SHA256].
"""

import hashlib
import hmac
import logging

import msgpack

from pdserve.kvtransfer.wire import Notice
from pdserve.refusals import Refusals

log = logging.getLogger(__name__)
MAX_NOTICE_BYTES = 64 * 1024  # a notice is ids, a token and its logprobs: anything longer is no notice


class BadNotice(ValueError):
    """A notice that is not one of our cluster's; `reason` is the counter it is dropped under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class NoticeSeal:
    """Seals the notices one worker (`engine_id`) sends and opens the ones it receives."""

    def __init__(self, token: str | None, engine_id: str):
        self.engine_id = engine_id
        # No token (a connector built outside a cluster): the empty key, as cluster_proof's.
        self._key = hmac.new((token or "").encode(), b"pdserve-kv-notice", hashlib.sha256).digest()
        # Notices dropped unread, by why: "malformed", "oversized", "foreign" (not sealed for us with
        # our cluster's token), "not_the_lease_holder" (a peer's notice for a lease it does not hold).
        self.dropped = Refusals(f"KV notices to {engine_id}", log)

    def _mac(self, receiver: str, body: bytes) -> bytes:
        return hmac.digest(self._key, receiver.encode() + b"\0" + body, "sha256")

    def seal(self, notice: Notice, receiver: str) -> bytes:
        """The notice as it goes to `receiver`; its sender is this worker."""
        notice.sender = self.engine_id
        body = notice.pack()
        return msgpack.packb([body, self._mac(receiver, body)])

    def open(self, data: bytes) -> Notice:
        """The notice in `data`, sealed for this worker; raises BadNotice (its reason) otherwise."""
        if len(data) > MAX_NOTICE_BYTES:
            raise BadNotice("oversized", f"{len(data)} bytes")
        try:
            body, mac = msgpack.unpackb(data)
        except Exception:
            raise BadNotice("malformed", "not a sealed notice") from None
        if not isinstance(body, bytes) or not isinstance(mac, bytes):
            raise BadNotice("malformed", "not a sealed notice")
        if not hmac.compare_digest(mac, self._mac(self.engine_id, body)):
            raise BadNotice("foreign", "its seal is not our cluster's, or it was sealed for another worker")
        try:
            n = Notice.unpack(body)
            ok = isinstance(n.request_id, str) and isinstance(n.first_token, int) and isinstance(n.sender, str)
            n.logprob()  # (its shape)
        except Exception:
            ok = False
        if not ok:  # sealed by a token holder, yet not a notice: another pdserve version
            raise BadNotice("malformed", "sealed, but not a notice of this pdserve version")
        return n

    def receive(self, data: bytes) -> Notice | None:
        """open(), or None where the notice is dropped (counted): a worker never stops for one."""
        try:
            return self.open(data)
        except BadNotice as e:
            self.drop(e.reason, str(e))
            return None

    def drop(self, reason: str, detail: str) -> None:
        """Count a notice dropped (and log it where due)."""
        self.dropped.refuse(reason, f"a notice ({detail})")
