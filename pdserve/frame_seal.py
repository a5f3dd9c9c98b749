"""AES-256-GCM over one connection's frames, keyed from the cluster's token: the one sealing of every
internal channel that crosses hosts in the clear (the KV TCP backend, the router–worker channel over
TCP).

A connection's key is an HMAC of the token over a label naming the channel, the connection's hello
nonces and its two ends in one direction (`sender>receiver`): only token holders know it, and it
serves one direction of one connection. Each frame's number in that direction is its GCM nonce, so
a frame replayed (from this connection or another), reordered, injected or changed fails its tag.

Why AES-GCM and not an HMAC, nor TLS: measured, HMAC-SHA256 over a layer's KV cost several times
AES-GCM's encryption and check together (AES-NI), and GCM hides the bytes as well; it is TLS 1.3's
record protection, with the key from the token the cluster already shares instead of certificates
to hand out (docs/benchmarks.md, "CPU: authentication on internal channels")."""

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16
_NONCE = struct.Struct(">4xQ")  # GCM's 96-bit nonce: the frame's number (a key serves one direction's frames)


class BadSeal(ValueError):
    """A frame whose tag is wrong: forged, replayed, reordered or changed."""


def session_key(token: str | None, label: bytes, nonces: bytes, sender: str, receiver: str) -> bytes:
    """The AES-256 key of the frames `sender` sends `receiver` on one connection (`nonces`: its
    hello's). A hello's proof, which crosses the wire, is another HMAC of the token under another label."""
    return hmac.new((token or "").encode(), label + nonces + f"{sender}>{receiver}".encode(), hashlib.sha256).digest()


class Sealer:
    """One direction of one connection: seals (or opens) its frames in order, numbered from 0."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self.seq = 0  # the next frame's number

    def seal(self, payload: bytes, header: bytes = b"") -> bytes:
        """The payload encrypted, header and payload authenticated: len(payload) + TAG_BYTES."""
        out = self._aead.encrypt(_NONCE.pack(self.seq), payload, header)
        self.seq += 1
        return out

    def open(self, sealed: bytes, header: bytes = b"") -> bytes:
        """seal()'s payload where `sealed` is the sender's next frame as sent; raises BadSeal
        otherwise, and the number stays: the next frame sealed may still open."""
        try:
            out = self._aead.decrypt(_NONCE.pack(self.seq), sealed, header)
        except InvalidTag:
            raise BadSeal("a frame whose tag is wrong (forged, replayed, reordered or changed)") from None
        self.seq += 1
        return out
